"""The changelog sink: one record per changed key per batch, to a compacted topic.

* Topic: ``kafka.changelog_topic_map`` for the RocketMQ topic, else the
  ``kafka.changelog_topic`` template.  Created with ``cleanup.policy=compact``.
* Key: the message key, partitioned as Kafka's default partitioner does.
* Value: the latest body; a delete is a real tombstone (a null value).
* Headers: the source position of the change (as the mirror's) and
  ``tierlog.op``: ``put``, ``delete``, or ``expire`` for a key whose time to
  live passed.

Contract: changes are sent in physical-offset order, so each partition's last
record says how far it got, and a change at or below that is not sent again.
Read as a compacted topic, the changelog equals the KV view.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.changes import CHANGE_ROW
from connectors.commitlog.arrow import epoch_ms_array
from connectors.kafka.columns import Records, constant, digits
from connectors.kafka.records import OP, QUEUE, QUEUE_OFFSET, STORE_TS, TOPIC, key_hashes
from connectors.kafka.settings import TopicRouter
from connectors.kafka.sink import BROKER, POSITION, KafkaSink, LastRecord
from connectors.threads import name_native


# Bodies of changes held at once on their way to the producer (``publish``): at 16 KiB, 4,000
# records, a few tenths of a second of a broker beside the service.
SLICE_BYTES = 64 << 20


class ChangelogSink(KafkaSink):
    name = "changelog"
    compacted = True
    sends_records = True

    def __init__(self, settings, **kwargs):
        super().__init__(settings, **kwargs)
        self.route = TopicRouter(settings.changelog_topic, settings.changelog_topic_map, "kafka.changelog_topic")

    def publish(self, changes: pa.Table, read_bodies: Callable[[np.ndarray], pa.Array] | None = None,
                slice_bytes: int = SLICE_BYTES) -> None:
        """Send ``changes`` (columns of ``CHANGE_ROW``; store_ts a timestamp or epoch ms), a slice of
        about ``slice_bytes`` of bodies at a time.  A row marked in a ``referenced`` column has no
        body in ``changes`` (the KV view keeps it in the tier): ``read_bodies`` gives the bodies at
        given physical offsets, in that order, and is called a slice at a time.  A ``size`` column
        (the stored size) measures a slice, else the bodies do.

        Why slices: a compaction batch may change a GiB of values (``compaction.max_batch_bytes``),
        and sent whole, its bodies were held at once as Arrow, as Python bytes and in librdkafka's
        queue, so the driver's peak memory grew with the batch (docs/benchmarks.md).  Now at most
        two slices are queued, and one more is read while one is sent."""
        order = pc.sort_indices(changes.column("phy_offset")).to_numpy()
        heads = changes.drop_columns(["body"]).take(pa.array(order))
        n = heads.num_rows
        deleted = heads["deleted"].to_numpy(zero_copy_only=False)
        if "referenced" in heads.column_names:
            wanted = heads["referenced"].to_numpy(zero_copy_only=False) & ~deleted
        else:
            wanted = np.zeros(n, dtype=bool)
        if wanted.any() and read_bodies is None:
            raise ValueError("changes marked referenced have no body, and no read_bodies was given")
        sizes = heads["size"] if "size" in heads.column_names else \
            pc.binary_length(changes.column("body")).take(pa.array(order))
        cuts = _cuts(pc.fill_null(sizes, 0).to_numpy(), slice_bytes)
        slices = list(zip(cuts[:-1], cuts[1:]))
        phy = heads["phy_offset"].to_numpy()
        stored = changes.column("body")

        def bodies_of(a: int, b: int) -> tuple[pa.ChunkedArray, np.ndarray]:
            """Rows a..b's values and where each is in them: the bodies ``changes`` holds, where
            they lie, then those read from the tier, then a null for the deletes' tombstones."""
            need = np.flatnonzero(wanted[a:b])
            read = read_bodies(phy[a:b][need]) if len(need) else pa.chunked_array([], pa.binary())
            read = [chunk.cast(stored.type) for chunk in _chunks(read)]
            values = pa.chunked_array([*stored.chunks, *read, pa.nulls(1, stored.type)], stored.type)
            rows = order[a:b].astype(np.int64)
            rows[need] = len(stored) + np.arange(len(need))
            rows[deleted[a:b]] = len(values) - 1
            return values, rows

        def send() -> None:
            # The next slice's bodies are read on a thread of their own while this one is sent: a
            # Parquet read releases the interpreter lock, and catching up 16 KiB values over a
            # million keys with Apache Kafka, reading each slice before sending it took 1.2 times
            # as long as the code before, which read the whole batch on the resolve thread.
            with ThreadPoolExecutor(1, thread_name_prefix="changelog-read", initializer=name_native) as pool:
                ahead = pool.submit(bodies_of, *slices[0])
                for k, (a, b) in enumerate(slices):
                    values, rows = ahead.result()
                    if k + 1 < len(slices):
                        ahead = pool.submit(bodies_of, *slices[k + 1])
                    self._send(heads.slice(a, b - a), values, rows)
                    del values  # the slice's bodies go before the wait
                    if b < n:  # this slice queued while the one before is delivered, no more
                        self.flush(leave=b - a)

        self.deliver(send)

    def publish_rows(self, rows: list[tuple]) -> None:
        """``publish`` for rows already in ``CHANGE_ROW`` order, sorted by physical offset."""
        self.publish(_table(rows))

    def _send(self, heads: pa.Table, values: pa.ChunkedArray, value_rows: np.ndarray, op: str | None = None,
              floor: int = -1) -> None:
        """Send the changes ``heads`` (``CHANGE_ROW`` without the body, in physical order), row i's
        value ``values[value_rows[i]]``, as one ``Records`` (``KafkaSink.send_records``).  With ``op``
        (an expiry round), each goes at its partition's position, forced, past the rows an
        interrupted round sent already (``_expired_already``)."""
        n = heads.num_rows
        if not n:
            return
        source = pc.dictionary_encode(heads["topic"].combine_chunks())
        kafka_topics = [self.route(topic) for topic in source.dictionary.to_pylist()]
        self.learn(kafka_topics)
        unique = list(dict.fromkeys(kafka_topics))
        counts = np.array([self.partitions(t) for t in unique], np.int64)
        topic = np.array([unique.index(t) for t in kafka_topics], np.int64)[
            source.indices.to_numpy(zero_copy_only=False)]
        keys = pc.cast(heads["key"], pa.binary())
        partition = np.array(key_hashes(keys.to_pylist()), np.int64) % counts[topic]
        position = heads["phy_offset"].to_numpy().astype(np.int64)
        ts = epoch_ms_array(heads["store_ts"].combine_chunks())
        deleted = heads["deleted"].to_numpy(zero_copy_only=False)
        if op is None:
            ops = pa.DictionaryArray.from_arrays(pa.array(deleted.astype(np.int32)), pa.array([b"put", b"delete"]))
        else:
            ops = constant(op.encode(), n)
            places = [(unique[t], p) for t, p in zip(topic.tolist(), partition.tolist())]
            position = np.array([max(floor, self.position(*tp)) for tp in places], np.int64)
            through = self._expired_already(places, keys.to_pylist(), floor)
            keep = np.array([i > through.get(tp, -1) for i, tp in enumerate(places)], bool)
            self.stats.skipped += int((~keep).sum())
        records = Records(
            topics=tuple(unique), topic=topic, partition=partition, key=keys, value=values,
            value_rows=value_rows, timestamp=ts.to_numpy(zero_copy_only=False).astype(np.int64),
            position=position,
            headers=((POSITION, digits(pa.array(position))), (BROKER, constant(self.settings.broker.encode(), n)),
                     (TOPIC, pa.DictionaryArray.from_arrays(source.indices, pc.cast(source.dictionary, pa.binary()))),
                     (QUEUE, digits(heads["queue_id"])), (QUEUE_OFFSET, digits(heads["queue_offset"])),
                     (STORE_TS, digits(ts)), (OP, ops)))
        if op is None:
            sent = self.send_records(records)
            for t, p in set(zip(topic[sent].tolist(), partition[sent].tolist())):
                self._last.pop((unique[t], p), None)
            return
        sent = self.send_records(records.select(np.flatnonzero(keep)), force=True)
        last: dict = {}
        for i in np.flatnonzero(keep)[sent].tolist():
            last[(unique[topic[i]], int(partition[i]))] = i
        for tp, i in last.items():
            _t, _p, key, _v, headers, pos, _ts = next(records.python_rows(np.array([i])))
            self._last[tp] = LastRecord(pos, key, tuple(headers))

    def _expired_already(self, places: list[tuple[str, int]], keys: list[bytes], floor: int) -> dict:
        """For a round of expiries sent again (the service died, or Kafka went away, between
        sending them and the view forgetting the keys): per partition, the index of the row whose
        tombstone is the partition's last record.  The round's rows come in the view's expiry
        order, and a round sent again holds the first one's rows first (more keys may have expired
        since), so the rows of a partition up to that one arrived already.  All the expiries of a
        round share one position per partition, the highest it had, so the position alone cannot
        tell them apart (the Kafka crash test found them sent twice)."""
        out = {}
        for i, (tp, key) in enumerate(zip(places, keys)):
            last = self._last.get(tp)
            if (last is not None and last.key == key and last.position >= floor
                    and dict(last.headers).get(OP) == b"expire"):
                out[tp] = i
        return out

    def expire(self, changes: list, applied_through: int | None) -> None:
        """Tombstones for keys whose time to live passed (``state.kv.Change`` deletes)."""
        heads = _table([(c.topic, c.key, c.phy_offset, c.queue_id, c.queue_offset, c.store_ts, True, None)
                        for c in changes]).drop_columns(["body"])
        floor = -1 if applied_through is None else applied_through - 1
        nothing = pa.chunked_array([pa.nulls(1, pa.binary())])
        self.deliver(lambda: self._send(heads, nothing, np.zeros(heads.num_rows, np.int64), op="expire",
                                        floor=floor))


def _chunks(array) -> list[pa.Array]:
    return list(array.chunks) if isinstance(array, pa.ChunkedArray) else [array]


def _table(rows: list[tuple]) -> pa.Table:
    """``CHANGE_ROW`` tuples (keys as text, store times as epoch ms) as a table ``publish`` takes."""
    columns = list(zip(*rows)) if rows else [[] for _ in CHANGE_ROW]
    types = (pa.string(), pa.string(), pa.int64(), pa.int32(), pa.int64(), pa.int64(), pa.bool_(), pa.binary())
    return pa.table([pa.array(list(c), t) for c, t in zip(columns, types)], names=list(CHANGE_ROW))


def _cuts(sizes: np.ndarray, slice_bytes: int) -> list[int]:
    """Row boundaries ``[0, ..., len(sizes)]`` of consecutive slices of about ``slice_bytes`` each
    (a row larger than that is a slice of its own); ``[0, 0]`` for no rows."""
    if not len(sizes):
        return [0, 0]
    ends = np.cumsum(sizes)
    cuts = [0]
    while cuts[-1] < len(sizes):
        done = ends[cuts[-1] - 1] if cuts[-1] else 0
        cuts.append(max(cuts[-1] + 1, int(np.searchsorted(ends, done + slice_bytes, side="right"))))
    return cuts
