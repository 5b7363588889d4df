"""The mirror sink: one Kafka record per commitlog message.

* Topic: ``kafka.mirror_topic_map`` for the RocketMQ topic, else the
  ``kafka.mirror_topic`` template.
* Partition: ``records.queue_partitions``: the broker's queue, so a queue's order is kept.
* Key: the message key; value: the body; timestamp: the store time.
* Headers: the message's properties, then its source position
  (``tierlog.phy``, ``tierlog.broker``, ``tierlog.topic``, ``tierlog.queue``,
  ``tierlog.qoff``, ``tierlog.ts``).

Contract: ``publish`` returns once every dispatched message in the batches is
in Kafka exactly once; a message at or below its partition's read-back
position is not sent again (see ``connectors.kafka.sink``).  Several sinks
can share the work, each sending only the partitions it ``owns``
(``slot_of``), in parallel Spark tasks.
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.commitlog.arrow import dispatched_only, epoch_ms_array
from connectors.commitlog.topics import TopicFilter
from connectors.kafka.records import QUEUE, QUEUE_OFFSET, STORE_TS, TOPIC, queue_partitions
from connectors.kafka.settings import TopicRouter
from connectors.kafka.sink import BROKER, POSITION, KafkaSink

# The message row's columns the mirror needs; the rest are never decoded.
MIRROR_COLUMNS = ("topic", "queue_id", "queue_offset", "phy_offset", "key", "body", "properties", "store_ts", "sysflag")
ROW = "tierlog.row"  # a row's index into its batch's bodies, where they are not in the batch (send_batch)

# The properties as Kafka headers want them: values as bytes (a cast of the same buffers).
HEADERS_TYPE = pa.map_(pa.string(), pa.binary())


def slot_of(topic: str, partition: int, slots: int) -> int:
    """Which of ``slots`` parallel senders owns a Kafka partition (stable across runs and hosts)."""
    return (zlib.crc32(topic.encode()) + partition) % slots


class MirrorSink(KafkaSink):
    name = "mirror"

    def __init__(self, settings, *, topics: TopicFilter | None = None, **kwargs):
        super().__init__(settings, **kwargs)
        self.topics = topics  # None sends every topic
        self.route = TopicRouter(settings.mirror_topic, settings.mirror_topic_map, "kafka.mirror_topic")

    def publish(self, batches: Callable[[], Iterable], *, once: bool = False) -> None:
        """Send the messages of ``batches()`` (called again from the start after a retry), each item
        as ``in_order`` takes it; ``once``: a single attempt, whose failure is raised."""
        (self.deliver_once if once else self.deliver)(lambda: self._send_batches(batches()))

    def _send_batches(self, batches: Iterable) -> None:
        for item in batches:
            for batch, bodies in in_order(item):
                self.send_batch(batch, bodies)

    def send_batch(self, batch: pa.RecordBatch, bodies: pa.ChunkedArray | None = None) -> None:
        """Send a batch of message rows (``MIRROR_COLUMNS``) in their order.  With ``bodies``, the
        batch has no body column but ``ROW``: each row's index into ``bodies``.

        Why vectorized up to the send: the partition of every row and whether this sink owns it
        are worked out on whole columns, and only owned rows become Python objects.  Each of the
        query's sender tasks reads the whole batch and owns about 1/slots of it; turning every
        row into Python first cost about 4 µs a row (twice that per record sent with 2 slots),
        most of the sink's time beside librdkafka's own (docs/benchmarks.md, Kafka mirror)."""
        batch = dispatched_only(batch)
        if self.topics is not None and batch.num_rows:
            batch = batch.filter(self.topics.mask(batch.column("topic")))
        if not batch.num_rows:
            return
        topics = pc.dictionary_encode(batch.column("topic"))
        routes = [self.route(topic) for topic in topics.dictionary.to_pylist()]
        self.learn(routes)  # every topic routed before anything is sent: a name collision sends nothing
        counts = np.array([self.partitions(route) for route in routes], dtype=np.int64)
        index = topics.indices.to_numpy(zero_copy_only=False)
        partitions = queue_partitions(self.settings.broker, batch.column("queue_id").to_numpy(zero_copy_only=False),
                                      counts[index])
        if self.owns is not None:
            owned = np.zeros((len(routes), int(counts.max())), dtype=bool)
            for i, route in enumerate(routes):
                owned[i, : counts[i]] = [self.owns(route, p) for p in range(counts[i])]
            keep = owned[index, partitions]
            if not keep.all():
                batch, index, partitions = batch.filter(pa.array(keep)), index[keep], partitions[keep]
        phy = batch.column("phy_offset")
        ts = epoch_ms_array(batch.column("store_ts"))
        pairs, starts, ends = property_pairs(batch.column("properties"))
        # The source headers' values as bytes, a column at a time: Arrow's casts make the digits for
        # every row at once, where ``b"%d" % n`` a row was four calls of Python's own.
        topics_b = [t.encode() for t in topics.dictionary.to_pylist()]
        heads = zip(_digits(phy), [topics_b[i] for i in index.tolist()], _digits(batch.column("queue_id")),
                    _digits(batch.column("queue_offset")), _digits(ts))
        broker = (BROKER, self.settings.broker.encode())
        # Built as they are sent: a list of a batch's headers, all alive at once, made Python's
        # garbage collector walk them over and over (4.5 against 2.6 µs a record of the sink's own time).
        headers = ([*pairs[s:e], (POSITION, p), broker, (TOPIC, t), (QUEUE, q), (QUEUE_OFFSET, o), (STORE_TS, m)]
                   for s, e, (p, t, q, o, m) in zip(starts, ends, heads))
        self.send_rows(zip([routes[i] for i in index.tolist()], partitions.tolist(),
                           pc.cast(batch.column("key"), pa.binary()).to_pylist(),
                           batch.column("body").to_pylist() if bodies is None else _taken(bodies, batch.column(ROW)),
                           headers, phy.to_pylist(), ts.to_pylist()))


def in_order(item) -> Iterator[tuple[pa.RecordBatch, pa.ChunkedArray | None]]:
    """``send_batch``'s arguments for one item of ``publish``'s batches: a record batch of message
    rows in physical order, or a pair ``(table, order)`` whose ``table.take(order)`` is one
    (``connectors.tier.feed.Unsorted``).  A pair's bodies stay where they were read: each batch has
    ``ROW`` in their place, and ``send_batch`` puts them in order as Python objects (``_taken``)."""
    if isinstance(item, pa.RecordBatch):
        yield item, None
        return
    table, order = item
    if order is None:
        yield from ((batch, None) for batch in table.to_batches())
        return
    rest = table.drop_columns(["body"]).take(order).append_column(ROW, order).combine_chunks()
    yield from ((batch, table["body"]) for batch in rest.to_batches())


def _taken(bodies: pa.ChunkedArray, rows: pa.Array) -> list[bytes]:
    """``bodies.take(rows).to_pylist()``.

    Why not that: the take copies every body into memory that mimalloc has given back to the
    kernel since the last batch (it keeps freed memory 1 s), and faults it in again page by page.
    When most of them are taken, turning them all into Python objects and reordering the list
    cost 0.37 of it for a 200 MB staging object of 16 KiB bodies (``./dev bench feed_order``,
    medians of 4 rounds; the take's varied with what the kernel had taken back: 1.3-7.2 core-s per GB)."""
    index = rows.to_numpy(zero_copy_only=False)
    if 2 * len(index) < len(bodies):
        return bodies.take(rows).to_pylist()
    flat = bodies.to_pylist()
    return [flat[i] for i in index.tolist()]


def _digits(column) -> list[bytes]:
    """Each integer of ``column`` as its decimal digits, bytes (``b"%d" % n``)."""
    return pc.cast(pc.cast(column, pa.string()), pa.binary()).to_pylist()


def property_pairs(properties: pa.MapArray) -> tuple[list, list[int], list[int]]:
    """Every row's properties as header pairs (name, bytes value): row i's are
    ``pairs[starts[i]:ends[i]]``; a null map has none.

    Why not ``to_pylist``: it builds a list of tuples per row, about 1.6 µs a row here, against
    0.15 µs for the flat keys and values (a cast of the same buffers makes the values bytes)."""
    properties = pc.cast(properties, HEADERS_TYPE)
    pairs = list(zip(properties.keys.to_pylist(), properties.items.to_pylist()))
    offsets = properties.offsets.to_pylist()  # into the flat keys and values, slices included
    starts, ends = offsets[:-1], offsets[1:]
    if properties.null_count:
        valid = properties.is_valid().to_pylist()
        starts = [s if v else 0 for s, v in zip(starts, valid)]
        ends = [e if v else 0 for e, v in zip(ends, valid)]
    return pairs, starts, ends
