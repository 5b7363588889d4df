"""Reading what a tier holds, from its location alone.

``TierReader`` trusts only the commit log: it reads the committed tier (the newest root and
the commit records after it), then the segments and staging objects it names.  An object being written,
or written but never committed, is never read; rows past a queue's commit
offset are never returned.

A tier may hold several brokers (``connectors.brokers``), each with its own commit log and its
own queues.  A reader made for one broker sees only that one.  A reader for every broker (the
default) answers whole-tier questions (``read_all``, ``by_key``, ``queue_infos``) across all of
them; a question about one queue goes to the broker that holds it, and is refused, naming the
brokers, when several hold a queue of that topic and id.
"""

from __future__ import annotations

import enum
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.brokers import DEFAULT_BROKER
from connectors.commitlog.arrow import MESSAGE_SCHEMA, epoch_ms_array, project_schema
from connectors.tier import layout
from connectors.tier.backend import Backend
from connectors.tier.location import open_backend
from connectors.tier.errors import NotFoundInTier, ObjectNotFound, TierError
from connectors.tier.log import TierLog
from connectors.threads import name_native
from connectors.tier.manifest import QueueKey
from connectors.tier.committed import CommittedTier


READ_THREADS = 8  # objects read at once by one query (by_key, a range across segments and staging)


class GetStatus(enum.Enum):
    """The outcome of ``TierReader.get``, after RocketMQ's GetMessageStatus."""

    FOUND = "found"
    NO_QUEUE = "no_queue"  # the tier has no such queue
    OFFSET_TOO_SMALL = "offset_too_small"  # below the lowest retained offset: start at ``next_offset``
    OFFSET_OVERFLOW_ONE = "offset_overflow_one"  # exactly the commit offset: nothing new yet
    OFFSET_OVERFLOW_BADLY = "offset_overflow_badly"  # past the commit offset


@dataclass(frozen=True)
class GetResult:
    status: GetStatus
    messages: pa.Table  # message rows in queue-offset order; empty unless FOUND
    next_offset: int  # where the next read should start
    low: int  # the queue's lowest retained offset
    commit: int  # the queue's commit offset (one past the last committed message)


class AmbiguousBrokerError(TierError):
    """Several brokers could answer (a queue of the same topic and id, a whole tier): the question
    must name one."""


@dataclass(frozen=True)
class QueueInfo:
    broker: str
    topic: str
    queue_id: int
    low: int  # lowest retained offset
    commit: int  # one past the highest committed offset
    sealed: int  # one past the highest offset in a sealed segment
    segments: int
    bytes: int  # segment bytes, plus this queue's share of the staging objects


class TierReader:
    """Reads a tier given only its location.  Every method reads the committed tier afresh
    unless given one (``committed()``), so results never pass a commit the reader has not seen.

    A question about one queue reads the tier's root, the records after it, that queue's bucket
    and manifest, and the pages its offsets fall in: its cost does not grow with the tier.

    ``broker`` limits the reader to one broker's part of the tier; None reads every broker's.
    """

    def __init__(self, location: str | Backend, broker: str | None = None):
        self.backend = open_backend(location, create=False) if isinstance(location, str) else location
        self.broker = broker
        self._logs: dict[str, TierLog] = {}
        self._pool: ThreadPoolExecutor | None = None  # made on the first read of several objects

    def brokers(self) -> list[str]:
        """The brokers this reader covers: its own, or every broker that committed to the tier."""
        if self.broker is not None:
            return [self.broker]
        brokers, before = layout.brokers_in([o.name for o in self.backend.list(layout.LOG_PREFIX)])
        if before and not brokers:
            self._log(DEFAULT_BROKER).committed()  # refuses, saying how to upgrade
        return brokers

    def topics(self) -> list[str]:
        """Every topic of the brokers this reader covers (reads every bucket: for listings and errors)."""
        return sorted({t for committed in self.committed_each() for t in committed.topics()})

    def require_topic(self, topic: str) -> None:
        """Raise ``NotFoundInTier`` naming the topics there are, unless the tier holds ``topic``
        (one bucket read per broker when it does)."""
        if any(committed.queue_ids(topic) > 0 for committed in self.committed_each()):
            return
        raise NotFoundInTier.topic(topic, f"the tier at {self.backend.location}", self.topics())

    def _log(self, broker: str) -> TierLog:
        if broker not in self._logs:
            self._logs[broker] = TierLog(self.backend, broker)
        return self._logs[broker]

    def committed(self, broker: str | None = None) -> CommittedTier:
        """The committed tier of one broker's part of the tier: ``broker``, the reader's own, or
        the only broker the tier holds (an empty tier reads as an empty broker-a)."""
        broker = broker or self.broker
        if broker is None:
            brokers = self.brokers()
            if len(brokers) > 1:
                raise AmbiguousBrokerError(f"the tier at {self.backend.location} holds brokers {', '.join(brokers)}: "
                                          "name one")
            broker = brokers[0] if brokers else DEFAULT_BROKER
        return self._log(broker).committed()

    def committed_each(self) -> list[CommittedTier]:
        """The committed tier of each broker this reader covers, by broker name."""
        return [self._log(b).committed() for b in self.brokers()]

    def _fresh(self, question: Callable[[CommittedTier], object], committed: CommittedTier | None):
        """``question(committed)``; on a freshly read committed tier, asked again if a fold deleted what it named."""
        if committed is not None:
            return question(committed)
        return self._retry(lambda: question(self.committed()))

    @staticmethod
    def _retry(call):
        for attempt in range(5):
            try:
                return call()
            except ObjectNotFound:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _each(self, question: Callable[[CommittedTier], list], committed: CommittedTier | None) -> list:
        """``question`` of ``committed``, else of every broker's freshly read committed tier, in broker order."""
        if committed is not None:
            return [question(committed)]
        return [self._retry(lambda b=b: question(self._log(b).committed())) for b in self.brokers()]

    def committed_for_queue(self, topic: str, queue_id: int, committed: CommittedTier | None = None) -> CommittedTier:
        """The committed tier of the one broker holding queue ``topic``/``queue_id`` (``committed`` when given)."""
        if committed is not None:
            return committed
        if self.broker is not None:
            return self.committed()
        each = self.committed_each()
        holding = [v for v in each if v.state_of((topic, queue_id)) is not None]
        if len(holding) > 1:
            raise AmbiguousBrokerError(
                f"queue {topic}/{queue_id} is on brokers {', '.join(v.log.broker for v in holding)} of the tier at "
                f"{self.backend.location}: name one (--broker, or TierReader(..., broker=))"
            )
        if holding:
            return holding[0]
        return each[0] if each else self.committed()

    def queues(self, committed: CommittedTier | None = None, topic: str | None = None) -> list[QueueKey]:
        """The queues of one broker (``committed``, or the reader's only broker)."""
        return self._fresh(lambda st: st.queue_keys(topic), committed)

    def read_queue(self, topic: str, queue_id: int, committed: CommittedTier | None = None) -> pa.Table:
        """Every committed message of one queue, in queue-offset order."""
        def question(st: CommittedTier) -> pa.Table:
            q = st.state_of((topic, queue_id))
            if q is None:
                return MESSAGE_SCHEMA.empty_table()
            return self._range(topic, queue_id, q.low, q.commit, st)
        return self._retry(lambda: question(self.committed_for_queue(topic, queue_id, committed)))

    def read_all(self, committed: CommittedTier | None = None) -> pa.Table:
        """Every committed message, broker by broker and queue by queue (a staging object's row
        groups are cut at queue boundaries, so reading it once per queue decodes each row once)."""
        def question(st: CommittedTier) -> pa.Table:
            keys = st.queue_keys()
            st.prefetch(keys)
            tables = [self.read_queue(t, q, st) for t, q in keys]
            return pa.concat_tables(tables) if tables else MESSAGE_SCHEMA.empty_table()
        tables = self._each(question, committed)
        return pa.concat_tables(tables) if tables else MESSAGE_SCHEMA.empty_table()

    # ------------------------------------------------------------ queries

    def get(self, topic: str, queue_id: int, offset: int, max_messages: int = 32,
            committed: CommittedTier | None = None) -> GetResult:
        """Up to ``max_messages`` committed messages of one queue from queue offset ``offset``."""
        def question(st: CommittedTier) -> GetResult:
            q = st.state_of((topic, queue_id))
            empty = MESSAGE_SCHEMA.empty_table()
            if q is None:
                return GetResult(GetStatus.NO_QUEUE, empty, 0, 0, 0)
            if offset < q.low:
                return GetResult(GetStatus.OFFSET_TOO_SMALL, empty, q.low, q.low, q.commit)
            if offset >= q.commit:
                status = GetStatus.OFFSET_OVERFLOW_ONE if offset == q.commit else GetStatus.OFFSET_OVERFLOW_BADLY
                return GetResult(status, empty, q.commit, q.low, q.commit)
            end = min(q.commit, offset + max(1, max_messages))
            table = self._range(topic, queue_id, offset, end, st)
            return GetResult(GetStatus.FOUND, table, end, q.low, q.commit)
        return self._retry(lambda: question(self.committed_for_queue(topic, queue_id, committed)))

    def messages_at(self, topics, queue_ids, queue_offsets, columns: list[str]) -> pa.Table:
        """``columns`` of the committed messages at the given positions (three sequences of one
        length: topic, queue id, queue offset), a row per position in their order; the row of a
        position the tier does not hold (retention dropped it, or it is not committed) is all null.

        Each object is read once for every position it holds, and of a sealed segment only the row
        groups that hold them: a point read costs one group of the asked columns
        (``layout.group_rows``), many points in one queue a group each at most.  One broker's
        (the reader's, or the tier's only one)."""
        columns = list(dict.fromkeys(columns))
        wanted: dict[QueueKey, dict[int, list[int]]] = {}
        for i, (t, q, o) in enumerate(zip(topics, queue_ids, queue_offsets)):
            wanted.setdefault((t, int(q)), {}).setdefault(int(o), []).append(i)
        schema = project_schema(columns)
        if not wanted:
            return schema.empty_table()
        read = list(dict.fromkeys(["topic", "queue_id", "queue_offset", *columns]))
        found = self._fresh(lambda st: self._messages_at(wanted, read, st), None)
        at = np.full(sum(len(v) for offsets in wanted.values() for v in offsets.values()), -1, np.int64)
        if found.num_rows:
            rows = {(t, q, o): i for i, (t, q, o) in enumerate(zip(
                found["topic"].to_pylist(), found["queue_id"].to_pylist(), found["queue_offset"].to_pylist()))}
            for key, offsets in wanted.items():
                for offset, places in offsets.items():
                    row = rows.get((*key, offset))
                    if row is not None:
                        at[places] = row
        picked = found.select(columns).take(pa.array(at, mask=at < 0)) if found.num_rows else \
            pa.table([pa.nulls(len(at), f.type) for f in schema], schema=schema)
        return picked.cast(schema)

    def _messages_at(self, wanted: dict, columns: list[str], committed: CommittedTier) -> pa.Table:
        reads, staged = [], {}
        for key, offsets in wanted.items():
            q = committed.state_of(key)
            if q is None:
                continue
            kept = sorted(o for o in offsets if q.low <= o < q.commit)
            if not kept:
                continue
            for seg in committed.segments_for(key, kept[0], kept[-1] + 1):
                mine = [o for o in kept if seg.base <= o <= seg.end]
                if not mine:
                    continue
                if seg.dense:
                    reads.append(partial(layout.read_segment_rows, self.backend, seg.name,
                                         [o - seg.base for o in mine], columns, size=seg.size))
                else:
                    reads.append(partial(layout.read_object_rows, self.backend, seg.name,
                                         [("queue_offset", "in", mine)], columns, size=seg.size))
            unsealed = [o for o in kept if o >= q.sealed]
            for part in committed.staging_for(key) if unsealed else ():
                mine = [o for o in unsealed if part.first <= o <= part.last]
                if mine:  # a staging object holds many queues: read once for all of them
                    staged.setdefault(part.name, (part, {}))[1][key] = mine
        for part, mine in staged.values():
            reads.append(partial(self._staging_rows_at, part, mine, columns))
        parts = [t for t in self._parallel(reads) if t.num_rows]
        return pa.concat_tables(parts) if parts else project_schema(columns).empty_table()

    def _staging_rows_at(self, part, mine: dict[QueueKey, list[int]], columns: list[str]) -> pa.Table:
        """The rows of one staging object at ``mine``'s positions (queue -> offsets)."""
        filters = [("topic", "in", sorted({t for t, _ in mine})), ("queue_id", "in", sorted({q for _, q in mine})),
                   ("queue_offset", "in", sorted({o for offsets in mine.values() for o in offsets}))]
        rows = layout.read_object_rows(self.backend, part.name, filters, columns, size=part.size)
        wanted = {(t, q, o) for (t, q), offsets in mine.items() for o in offsets}
        keep = [k in wanted for k in zip(rows["topic"].to_pylist(), rows["queue_id"].to_pylist(),
                                         rows["queue_offset"].to_pylist())]
        return rows.filter(pa.array(keep, pa.bool_()))

    def _range(self, topic: str, queue_id: int, start: int, end: int, committed: CommittedTier,
               columns: list[str] | None = None) -> pa.Table:
        """Committed rows of one queue with ``start <= queue_offset < end``, in offset order."""
        key = (topic, queue_id)
        q = committed.queue(key)
        start, end = max(start, q.low), min(end, q.commit)
        reads = [partial(self._segment_range, seg, start, end, columns) for seg in committed.segments_for(key, start, end)]
        # Staging rows below the sealed offset are also in a segment: read them from there only.
        unsealed_from = max(start, q.sealed)
        filters = [("topic", "=", topic), ("queue_id", "=", queue_id), ("queue_offset", ">=", unsealed_from),
                   ("queue_offset", "<", end)]
        for part in committed.staging_for(key):
            if part.first < end and part.last >= unsealed_from:
                reads.append(partial(layout.read_object_rows, self.backend, part.name, filters, columns,
                                     size=part.size))
        parts = self._parallel(reads)
        schema = MESSAGE_SCHEMA if columns is None else project_schema(columns)
        table = pa.concat_tables(parts) if parts else schema.empty_table()
        offsets = table["queue_offset"].to_numpy()
        if len(offsets) > 1 and not (offsets[1:] > offsets[:-1]).all():  # segments, then staging: sorted already
            table = table.sort_by("queue_offset")
            offsets = table["queue_offset"].to_numpy()
        lo, hi = np.searchsorted(offsets, [start, end])
        return table.slice(lo, hi - lo)  # a slice, not a filter: no copy

    def _parallel(self, reads: list[Callable[[], pa.Table]]) -> list[pa.Table]:
        """Run ``reads`` (one per object) at once, results in their order: Arrow decodes without the
        GIL, and an S3 request mostly waits."""
        if len(reads) <= 1:
            return [read() for read in reads]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tier-read", initializer=name_native)
        return list(self._pool.map(lambda read: read(), reads))

    def _segment_range(self, seg, start: int, end: int, columns: list[str] | None) -> pa.Table:
        if seg.dense:
            first = max(start, seg.base) - seg.base
            stop = min(end, seg.end + 1) - seg.base
            return layout.read_segment_slice(self.backend, seg.name, first, stop, columns, size=seg.size)
        return layout.read_object_rows(self.backend, seg.name, [("queue_offset", ">=", start), ("queue_offset", "<", end)],
                                       columns, size=seg.size)

    def decoded_end(self, topic: str, queue_id: int, offset: int, committed: CommittedTier) -> int:
        """One past the last offset of the Parquet row group holding ``offset`` when that is in a
        sealed segment: a read of ``offset`` decodes the whole group anyway.  Else ``offset + 1``.
        A hint for how much to keep, from the most rows a group holds (``layout.ROW_GROUP_ROWS``):
        a segment of large bodies has smaller groups (``layout.group_rows``), and the hint then
        reaches into the groups after it, which are read right."""
        for seg in committed.segments_for((topic, queue_id), offset, offset + 1):
            if seg.base <= offset <= seg.end and seg.dense:
                group = (offset - seg.base) // layout.ROW_GROUP_ROWS + 1
                return min(seg.end + 1, seg.base + group * layout.ROW_GROUP_ROWS)
        return offset + 1

    def offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int, boundary: str = "lower",
                        committed: CommittedTier | None = None) -> int:
        """Like RocketMQ's searchOffset, over what the tier retains of one queue.

        ``lower``: the smallest offset whose store time is at or after ``timestamp_ms``
        (the commit offset when there is none).  ``upper``: the largest offset whose
        store time is at or before it (the lowest retained offset when there is none).
        Store times need not grow with offsets: each object's min and max store time
        only decide which objects to open.
        """
        if boundary not in ("lower", "upper"):
            raise ValueError(f"boundary must be lower or upper, not {boundary!r}")
        return self._retry(lambda: self._offset_for_time(topic, queue_id, timestamp_ms, boundary,
                                                         self.committed_for_queue(topic, queue_id, committed)))

    def _offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int, boundary: str, committed: CommittedTier) -> int:
        q = committed.state_of((topic, queue_id))
        if q is None or q.commit <= q.low:
            return 0 if q is None else q.commit
        lower = boundary == "lower"
        for first, last, min_ts, max_ts in self._time_pieces(topic, queue_id, committed, lower, timestamp_ms):
            if (max_ts < timestamp_ms) if lower else (min_ts > timestamp_ms):
                continue
            rows = self._range(topic, queue_id, first, last + 1, committed, ["queue_offset", "store_ts"])
            ts = epoch_ms_array(rows["store_ts"])
            hit = pc.greater_equal(ts, timestamp_ms) if lower else pc.less_equal(ts, timestamp_ms)
            offsets = rows["queue_offset"].filter(hit)
            if len(offsets):
                return (pc.min if lower else pc.max)(offsets).as_py()
        return q.commit if lower else q.low

    def _time_pieces(self, topic: str, queue_id: int, committed: CommittedTier, lower: bool, timestamp_ms: int):
        """(first offset, last offset, min store time, max store time) of each object that may hold
        the answer, walking from the low end (``lower``) or the high end.  Pages of segments are read
        only as the walk reaches them, so a search that ends early reads few."""
        key = (topic, queue_id)
        q = committed.queue(key)
        bounds = {"min_ts": timestamp_ms} if lower else {"max_ts": timestamp_ms}
        segments = ((s.base, s.end, s.min_ts, s.max_ts) for s in committed.segments_in_order(key, reverse=not lower, **bounds))
        staged = sorted((max(p.first, q.sealed), p.last, p.min_ts, p.max_ts) for p in committed.staging_for(key))
        pieces = itertools.chain(segments, staged) if lower else itertools.chain(reversed(staged), segments)
        return (p for p in pieces if p[1] >= q.low and p[0] < q.commit)

    def by_key(self, topic: str, key: str, begin_ms: int | None = None, end_ms: int | None = None,
               committed: CommittedTier | None = None) -> pa.Table:
        """Every committed message of ``topic`` whose key is ``key``, stored in ``[begin_ms, end_ms]``
        (either end open when None), broker by broker, each in physical order.

        Sealed segments are opened only when their time range overlaps and their key
        index (written at seal time, sorted by key) lists the key; then only the row
        groups holding those offsets are read.  Staging objects are filtered by key.
        """
        tables = self._each(lambda st: self._by_key(topic, key, begin_ms, end_ms, st), committed)
        return pa.concat_tables(tables) if tables else MESSAGE_SCHEMA.empty_table()

    def _by_key(self, topic: str, key: str, begin_ms: int | None, end_ms: int | None, committed: CommittedTier) -> pa.Table:
        lo = -(2**62) if begin_ms is None else begin_ms
        hi = 2**62 if end_ms is None else end_ms
        parts, staged = [], {}
        keys = committed.queue_keys(topic)
        committed.prefetch(keys)
        for queue_key in keys:
            q = committed.queue(queue_key)
            for seg in committed.segments_for(queue_key, min_ts=lo, max_ts=hi):
                parts.append(partial(self._segment_rows_for_key, seg, key))
            for part in committed.staging_for(queue_key):
                if part.last >= q.sealed and part.max_ts >= lo and part.min_ts <= hi:
                    staged.setdefault(part.name, (part, {}))[1][queue_key[1]] = q.sealed
        for part, sealed in staged.values():  # each staging object read once, for all its queues
            parts.append(partial(self._staging_rows_for_key, part, topic, key, sealed))
        parts = self._parallel(parts)
        table = pa.concat_tables(parts) if parts else MESSAGE_SCHEMA.empty_table()
        ts = epoch_ms_array(table["store_ts"])
        keep = pc.and_(pc.equal(table["key"], key), pc.and_(pc.greater_equal(ts, lo), pc.less_equal(ts, hi)))
        table = table.filter(keep)
        return table.filter(self._in_retained_range(table, committed)).sort_by("phy_offset")

    def _segment_rows_for_key(self, seg, key: str) -> pa.Table:
        if seg.keys is None:  # sealed before key indexes existed: filter the segment itself
            return layout.read_object_rows(self.backend, seg.name, [("key", "=", key)], size=seg.size)
        index = layout.read_where_equal(self.backend, seg.keys, {"key": key}, ["queue_offset"])
        if index.num_rows == 0:
            return MESSAGE_SCHEMA.empty_table()
        offsets = index["queue_offset"].to_pylist()
        return layout.read_object_rows(self.backend, seg.name, [("queue_offset", "in", offsets)], size=seg.size)

    def _staging_rows_for_key(self, obj, topic: str, key: str, sealed: dict[int, int]) -> pa.Table:
        """The key's unsealed rows in one staging object (``sealed``: queue id -> its sealed offset).
        Their offsets are found from three small columns before whole rows are read."""
        found = layout.read_where_equal(self.backend, obj.name, {"topic": topic, "key": key},
                                        ["queue_id", "queue_offset"], size=obj.size)
        mine = [(qid, off) for qid, off in zip(found["queue_id"].to_pylist(), found["queue_offset"].to_pylist())
                if qid in sealed and off >= sealed[qid]]
        if not mine:
            return MESSAGE_SCHEMA.empty_table()
        filters = [("topic", "=", topic), ("queue_id", "in", sorted({q for q, _ in mine})),
                   ("queue_offset", "in", sorted({o for _, o in mine}))]
        rows = layout.read_object_rows(self.backend, obj.name, filters, size=obj.size)
        wanted = set(mine)  # offsets repeat across queues, and the sealed part is read from segments
        keep = [(q, o) in wanted for q, o in zip(rows["queue_id"].to_pylist(), rows["queue_offset"].to_pylist())]
        return rows.filter(pa.array(keep, pa.bool_()))

    @staticmethod
    def _in_retained_range(table: pa.Table, committed: CommittedTier) -> pa.Array:
        """Rows within their queue's retained, committed range."""
        states = {}
        keep = []
        for t, q, o in zip(table["topic"].to_pylist(), table["queue_id"].to_pylist(), table["queue_offset"].to_pylist()):
            s = states.get((t, q)) or states.setdefault((t, q), committed.state_of((t, q)))
            keep.append(s.low <= o < s.commit)
        return pa.array(keep, pa.bool_())

    def queue_infos(self, committed: CommittedTier | None = None, topic: str | None = None) -> list[QueueInfo]:
        """Every queue (of ``topic``) of every broker with its retained range, sealed offset, segments
        and bytes.  Reads the buckets only, and the manifests of queues with unsealed rows (for their
        bytes)."""
        def question(st: CommittedTier) -> list[QueueInfo]:
            out = []
            for key, q in sorted(st.queue_states(topic).items()):
                staged = sum(p.bytes for p in st.staging_for(key)) if q.commit > q.sealed else 0
                out.append(QueueInfo(st.log.broker, key[0], key[1], q.low, q.commit, q.sealed, q.segments,
                                     q.bytes + staged))
            return out
        return [info for infos in self._each(question, committed) for info in infos]
