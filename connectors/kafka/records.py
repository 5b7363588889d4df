"""How a commitlog message or a changed key becomes a Kafka record: routing and headers."""

from __future__ import annotations

import zlib

from kafka.partitioner.default import murmur2

from connectors.kafka.sink import BROKER, POSITION

# The source position travels with every record, so a reader can go back to the commitlog
# or the tier, and the sink can read its own progress back (POSITION, of its BROKER).
TOPIC, QUEUE, QUEUE_OFFSET, STORE_TS, OP = "tierlog.topic", "tierlog.queue", "tierlog.qoff", "tierlog.ts", "tierlog.op"


def source_headers(phy: int, topic: str, queue_id: int, queue_offset: int, store_ts: int,
                   broker: str) -> list[tuple[str, bytes]]:
    return [(POSITION, b"%d" % phy), (BROKER, broker.encode()), (TOPIC, topic.encode()), (QUEUE, b"%d" % queue_id),
            (QUEUE_OFFSET, b"%d" % queue_offset), (STORE_TS, b"%d" % store_ts)]


def queue_partition(broker: str, queue_id: int, partitions: int) -> int:
    """The mirror's partition of a broker's queue: one partition per queue, so its order is kept.
    Every broker numbers its queues from 0, so the broker's name shifts where its queues start:
    with ``queue_id`` alone, every broker's queue 0 would share partition 0 and the low partitions
    would take the load of every broker.  Brokers may still share a partition; each one's
    records keep their order, and the read-back finds each broker's own last one."""
    return (zlib.crc32(broker.encode()) + queue_id) % partitions


def key_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner (murmur2, as the Java client), so keyed readers agree."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
