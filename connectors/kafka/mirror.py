"""The mirror sink: one Kafka record per commitlog message.

* Topic: ``kafka.mirror_topic_map`` for the RocketMQ topic, else the
  ``kafka.mirror_topic`` template.
* Partition: ``records.queue_partition``: the broker's queue, so a queue's order is kept.
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
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from connectors.commitlog.arrow import dispatched_only, epoch_ms
from connectors.commitlog.topics import TopicFilter
from connectors.kafka.records import queue_partition, source_headers
from connectors.kafka.settings import TopicRouter
from connectors.kafka.sink import KafkaSink

# The message row's columns the mirror needs; the rest are never decoded.
MIRROR_COLUMNS = ("topic", "queue_id", "queue_offset", "phy_offset", "key", "body", "properties", "store_ts", "sysflag")


def slot_of(topic: str, partition: int, slots: int) -> int:
    """Which of ``slots`` parallel senders owns a Kafka partition (stable across runs and hosts)."""
    return (zlib.crc32(topic.encode()) + partition) % slots


class MirrorSink(KafkaSink):
    name = "mirror"

    def __init__(self, settings, *, topics: TopicFilter | None = None, **kwargs):
        super().__init__(settings, **kwargs)
        self.topics = topics  # None sends every topic
        self.route = TopicRouter(settings.mirror_topic, settings.mirror_topic_map, "kafka.mirror_topic")

    def publish(self, batches: Callable[[], Iterable[pa.RecordBatch]], *, once: bool = False) -> None:
        """Send the messages of ``batches()`` (called again from the start after a retry);
        ``once``: a single attempt, whose failure is raised."""
        (self.deliver_once if once else self.deliver)(lambda: self._send_batches(batches()))

    def _send_batches(self, batches: Iterable[pa.RecordBatch]) -> None:
        for batch in batches:
            self.send_batch(batch)

    def send_batch(self, batch: pa.RecordBatch) -> None:
        batch = dispatched_only(batch)
        if self.topics is not None and batch.num_rows:
            batch = batch.filter(self.topics.mask(batch.column("topic")))
        # Every topic routed before anything is sent: a name collision sends nothing.
        self.learn([self.route(topic) for topic in pc.unique(batch.column("topic")).to_pylist()])
        columns = [batch.column(c).to_pylist() for c in ("topic", "queue_id", "queue_offset", "phy_offset", "key",
                                                           "body", "properties")]
        columns.append(epoch_ms(batch.column("store_ts")))
        partitions: dict[str, tuple[str, int]] = {}
        broker = self.settings.broker
        for topic, queue_id, queue_offset, phy, key, body, props, ts in zip(*columns):
            route = partitions.get(topic)
            if route is None:
                kafka_topic = self.route(topic)
                route = partitions[topic] = (kafka_topic, self.partitions(kafka_topic))
            partition = queue_partition(broker, queue_id, route[1])
            if self.owns is not None and not self.owns(route[0], partition):
                continue
            headers = [(k, v.encode()) for k, v in props or ()]
            headers += source_headers(phy, topic, queue_id, queue_offset, ts, broker)
            self.send(route[0], partition, None if key is None else key.encode(), body, headers, phy, ts)
