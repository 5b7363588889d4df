"""How a commitlog message or a changed key becomes a Kafka record: routing and headers."""

from __future__ import annotations

from kafka.partitioner.default import murmur2

from connectors.kafka.sink import POSITION

# The source position travels with every record, so a reader can go back to the commitlog
# or the tier, and the sink can read its own progress back (POSITION).
TOPIC, QUEUE, QUEUE_OFFSET, STORE_TS, OP = "tierlog.topic", "tierlog.queue", "tierlog.qoff", "tierlog.ts", "tierlog.op"


def source_headers(phy: int, topic: str, queue_id: int, queue_offset: int, store_ts: int) -> list[tuple[str, bytes]]:
    return [(POSITION, b"%d" % phy), (TOPIC, topic.encode()), (QUEUE, b"%d" % queue_id),
            (QUEUE_OFFSET, b"%d" % queue_offset), (STORE_TS, b"%d" % store_ts)]


def key_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner (murmur2, as the Java client), so keyed readers agree."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
