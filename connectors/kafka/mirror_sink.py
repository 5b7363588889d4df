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
from connectors.kafka.columns import Records, constant, digits
from connectors.kafka.records import QUEUE, QUEUE_OFFSET, STORE_TS, TOPIC, queue_partitions
from connectors.kafka.settings import TopicRouter
from connectors.kafka.sink import BROKER, POSITION, KafkaSink

# The message row's columns the mirror needs; the rest are never decoded.
MIRROR_COLUMNS = ("topic", "queue_id", "queue_offset", "phy_offset", "key", "body", "properties", "store_ts", "sysflag")
ROW = "tierlog.row"  # a row's index into its batch's bodies, where they are not in the batch (send_batch)


def slot_of(topic: str, partition: int, slots: int) -> int:
    """Which of ``slots`` parallel senders owns a Kafka partition (stable across runs and hosts)."""
    return (zlib.crc32(topic.encode()) + partition) % slots


class MirrorSink(KafkaSink):
    name = "mirror"
    sends_records = True

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

        Why columns all the way: the partition of every row and whether this sink owns it are
        worked out on whole columns, and the records go to the producer as columns
        (``Records``), which the native producer reads into librdkafka without a Python object a
        record: building a record's key, value and header tuples was most of the sending thread's
        time (docs/benchmarks.md, "The mirror's records from Arrow buffers")."""
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
        ts = epoch_ms_array(batch.column("store_ts"))
        # Each source topic's Kafka topic once: two topics mapped to one share its positions.
        kafka_topics = list(dict.fromkeys(routes))
        to_kafka = np.array([kafka_topics.index(route) for route in routes], dtype=np.int64)
        names = pa.array([t.encode() for t in topics.dictionary.to_pylist()], pa.binary())
        self.send_records(Records(
            topics=tuple(kafka_topics), topic=to_kafka[index], partition=partitions.astype(np.int64),
            key=batch.column("key"), value=batch.column("body") if bodies is None else bodies,
            value_rows=None if bodies is None else batch.column(ROW).to_numpy(zero_copy_only=False),
            timestamp=ts.to_numpy(zero_copy_only=False).astype(np.int64),
            position=batch.column("phy_offset").to_numpy(zero_copy_only=False).astype(np.int64),
            pairs=batch.column("properties"),
            headers=((POSITION, digits(batch.column("phy_offset"))),
                     (BROKER, constant(self.settings.broker.encode(), batch.num_rows)),
                     (TOPIC, pa.DictionaryArray.from_arrays(pa.array(index.astype(np.int32)), names)),
                     (QUEUE, digits(batch.column("queue_id"))), (QUEUE_OFFSET, digits(batch.column("queue_offset"))),
                     (STORE_TS, digits(ts)))))


def in_order(item) -> Iterator[tuple[pa.RecordBatch, pa.ChunkedArray | None]]:
    """``send_batch``'s arguments for one item of ``publish``'s batches: a record batch of message
    rows in physical order, or a pair ``(table, order)`` whose ``table.take(order)`` is one
    (``connectors.tier.feed.Unsorted``).  A pair's bodies stay where they were read: each batch has
    ``ROW`` in their place, each row's index into them (``Records.value_rows``).

    Why not the take of the bodies too: it copied every body into memory that mimalloc had given
    back to the kernel since the last batch, which faulted it in again page by page (1.3-7.2
    core-s per GB for a 200 MB staging object of 16 KiB bodies, ``./dev bench feed_order``)."""
    if isinstance(item, pa.RecordBatch):
        yield item, None
        return
    table, order = item
    if order is None:
        yield from ((batch, None) for batch in table.to_batches())
        return
    rest = table.drop_columns(["body"]).take(order).append_column(ROW, order).combine_chunks()
    yield from ((batch, table["body"]) for batch in rest.to_batches())
