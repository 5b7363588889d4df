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
from connectors.commitlog.arrow import epoch_ms
from connectors.kafka.records import OP, key_hashes, source_headers
from connectors.kafka.settings import TopicRouter
from connectors.kafka.sink import KafkaSink, LastRecord
from connectors.threads import name_native


# Bodies of changes held at once on their way to the producer (``publish``): at 16 KiB, 4,000
# records, a few tenths of a second of a broker beside the service.
SLICE_BYTES = 64 << 20


class ChangelogSink(KafkaSink):
    name = "changelog"
    compacted = True

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
        queue: the driver peaked at 6.6 GB for 1 GiB batches, against 2.2 GB for 256 MiB.  Now at
        most two slices are queued, and one more is read while one is sent."""
        order = pc.sort_indices(changes.column("phy_offset")).to_numpy()
        heads = changes.drop_columns(["body"]).take(pa.array(order))
        n = heads.num_rows
        if "referenced" in heads.column_names:
            wanted = heads["referenced"].to_numpy(zero_copy_only=False) & ~heads["deleted"].to_numpy(
                zero_copy_only=False)
        else:
            wanted = np.zeros(n, dtype=bool)
        if wanted.any() and read_bodies is None:
            raise ValueError("changes marked referenced have no body, and no read_bodies was given")
        sizes = heads["size"] if "size" in heads.column_names else \
            pc.binary_length(changes.column("body")).take(pa.array(order))
        cuts = _cuts(pc.fill_null(sizes, 0).to_numpy(), slice_bytes)
        slices = list(zip(cuts[:-1], cuts[1:]))
        phy = heads["phy_offset"].to_numpy()

        def bodies_of(a: int, b: int) -> list:
            bodies = _take_pylist(changes.column("body"), order[a:b])
            need = np.flatnonzero(wanted[a:b])
            if len(need):
                for i, body in zip(need.tolist(), read_bodies(phy[a:b][need]).to_pylist()):
                    bodies[i] = body
            return bodies

        def send() -> None:
            # The next slice's bodies are read on a thread of their own while this one is sent: a
            # Parquet read releases the interpreter lock, and catching up 16 KiB values over a
            # million keys with Apache Kafka, reading each slice before sending it took 1.2 times
            # as long as the code before, which read the whole batch on the resolve thread.
            with ThreadPoolExecutor(1, thread_name_prefix="changelog-read", initializer=name_native) as pool:
                ahead = pool.submit(bodies_of, *slices[0])
                for k, (a, b) in enumerate(slices):
                    bodies = ahead.result()
                    if k + 1 < len(slices):
                        ahead = pool.submit(bodies_of, *slices[k + 1])
                    part = heads.slice(a, b - a)
                    columns = [bodies if c == "body" else _as_sent(part, c) for c in CHANGE_ROW]
                    del bodies
                    self._send_columns(columns)
                    del columns  # the slice's bodies go before the wait
                    if b < n:  # this slice queued while the one before is delivered, no more
                        self.flush(leave=b - a)

        self.deliver(send)

    def publish_rows(self, rows: list[tuple]) -> None:
        """``publish`` for rows already in ``CHANGE_ROW`` order, sorted by physical offset."""
        self.deliver(lambda: self._send_columns(_columns(rows)))

    def _send_columns(self, columns: list[list], op: str | None = None, floor: int = -1) -> None:
        """Send the rows of ``columns`` (``CHANGE_ROW`` order, keys as bytes).  Columns, not a tuple
        a row: a batch's rows stay alive through the whole send, and Python's collector walks
        every tuple that does, again and again."""
        kafka_topics = {topic: self.route(topic) for topic in dict.fromkeys(columns[0])}
        self.learn(list(kafka_topics.values()))
        routes = {topic: (kafka_topic, self.partitions(kafka_topic)) for topic, kafka_topic in kafka_topics.items()}
        broker = self.settings.broker
        hashes = key_hashes(columns[1])
        expired_through = {} if op is None else self._expired_already(columns, routes, hashes, floor)
        for i, (topic, key, phy, queue_id, queue_offset, ts, deleted, body, hashed) in enumerate(zip(*columns, hashes)):
            kafka_topic, partitions = routes[topic]
            partition = hashed % partitions  # key_partition's, hashed for all rows at once
            headers = source_headers(phy, topic, queue_id, queue_offset, ts, broker)
            value = None if deleted else body
            if op is None:
                headers.append(_DELETE if deleted else _PUT)
                if self.send(kafka_topic, partition, key, value, headers, phy, ts):
                    self._last.pop((kafka_topic, partition), None)
            elif i <= expired_through.get((kafka_topic, partition), -1):
                self.stats.skipped += 1
            else:
                # An expiry has no message of its own: it takes the highest position its partition
                # has seen, or one below where the view has applied, so positions never go back.
                position = max(floor, self.position(kafka_topic, partition))
                headers[0] = (headers[0][0], b"%d" % position)
                headers.append((OP, op.encode()))
                if self.send(kafka_topic, partition, key, value, headers, position, force=True):
                    self._last[(kafka_topic, partition)] = LastRecord(position, key, tuple(headers))

    def _expired_already(self, columns: list[list], routes: dict, hashes: list[int], floor: int) -> dict:
        """For a round of expiries sent again (the service died, or Kafka went away, between
        sending them and the view forgetting the keys): per partition, the index of the row whose
        tombstone is the partition's last record.  The round's rows come in the view's expiry
        order, and a round sent again holds the first one's rows first (more keys may have expired
        since), so the rows of a partition up to that one arrived already.  All the expiries of a
        round share one position per partition, the highest it had, so the position alone cannot
        tell them apart (the Kafka crash test found them sent twice)."""
        out = {}
        for i, (topic, key, hashed) in enumerate(zip(columns[0], columns[1], hashes)):
            kafka_topic, partitions = routes[topic]
            tp = (kafka_topic, hashed % partitions)
            last = self._last.get(tp)
            if (last is not None and last.key == key and last.position >= floor
                    and dict(last.headers).get(OP) == _EXPIRE[1]):
                out[tp] = i
        return out

    def expire(self, changes: list, applied_through: int | None) -> None:
        """Tombstones for keys whose time to live passed (``state.kv.Change`` deletes)."""
        rows = [(c.topic, c.key, c.phy_offset, c.queue_id, c.queue_offset, c.store_ts, True, None) for c in changes]
        floor = -1 if applied_through is None else applied_through - 1
        self.deliver(lambda: self._send_columns(_columns(rows), op="expire", floor=floor))


_PUT, _DELETE, _EXPIRE = (OP, b"put"), (OP, b"delete"), (OP, b"expire")


def _as_sent(table: pa.Table, name: str) -> list:
    """Column ``name`` of ``table`` as ``_send_columns`` takes it: keys as bytes (as Kafka takes
    them), store times as epoch ms."""
    if name == "key":
        return pc.cast(table.column("key"), pa.binary()).to_pylist()
    if name == "store_ts":
        return epoch_ms(table.column("store_ts"))
    return table.column(name).to_pylist()


def _take_pylist(column: pa.ChunkedArray, rows: np.ndarray) -> list:
    """``column[rows]`` as Python objects, chunk by chunk.  Why not ``column.take(rows)``: Arrow
    joins a chunked binary column into one buffer first, and a batch's bodies (as the tier reader
    left them, in many chunks) are hundreds of MB, copied again for every slice."""
    out: list = [None] * len(rows)
    ends = np.cumsum([len(chunk) for chunk in column.chunks])
    which = np.searchsorted(ends, rows, side="right")
    for c in np.unique(which).tolist():
        at = np.flatnonzero(which == c)
        start = int(ends[c - 1]) if c else 0
        for i, value in zip(at.tolist(), column.chunk(c).take(pa.array(rows[at] - start)).to_pylist()):
            out[i] = value
    return out


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


def _columns(rows: list[tuple]) -> list[list]:
    """``CHANGE_ROW`` tuples (keys as text) as the columns ``_send_columns`` takes."""
    columns = [list(column) for column in zip(*rows)] if rows else [[] for _ in CHANGE_ROW]
    columns[1] = [key.encode() for key in columns[1]]
    return columns
