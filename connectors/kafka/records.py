"""How a commitlog message or a changed key becomes a Kafka record: routing and headers."""

from __future__ import annotations

import zlib

import numpy as np
from kafka.partitioner.default import murmur2

from connectors.kafka.sink import BROKER, POSITION

# The source position travels with every record, so a reader can go back to the commitlog
# or the tier, and the sink can read its own progress back (POSITION, of its BROKER).
TOPIC, QUEUE, QUEUE_OFFSET, STORE_TS, OP = "tierlog.topic", "tierlog.queue", "tierlog.qoff", "tierlog.ts", "tierlog.op"


def source_headers(phy: int, topic: str, queue_id: int, queue_offset: int, store_ts: int,
                   broker: str) -> list[tuple[str, bytes]]:
    return [(POSITION, b"%d" % phy), (BROKER, broker.encode()), (TOPIC, topic.encode()), (QUEUE, b"%d" % queue_id),
            (QUEUE_OFFSET, b"%d" % queue_offset), (STORE_TS, b"%d" % store_ts)]


def queue_partitions(broker: str, queue_ids: np.ndarray, partitions: np.ndarray) -> np.ndarray:
    """The mirror's partition of each of a broker's queues: one partition per queue, so its order
    is kept.  Every broker numbers its queues from 0, so the broker's name shifts where its queues
    start: with ``queue_id`` alone, every broker's queue 0 would share partition 0 and the low
    partitions would take the load of every broker.  Brokers may still share a partition; each
    one's records keep their order, and the read-back finds each broker's own last one."""
    return (zlib.crc32(broker.encode()) + queue_ids.astype(np.int64)) % partitions


def key_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner (murmur2, as the Java client), so keyed readers agree."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


_M = np.uint32(0x5BD1E995)


def key_hashes(keys: list[bytes]) -> list[int]:
    """``murmur2(key) & 0x7FFFFFFF`` of each key, as ``key_partition`` hashes them, computed with
    numpy over the keys of each length at once.

    Why: kafka-python's murmur2 is pure Python, a call a key; with the producer in librdkafka it
    was a visible part of the compaction apply thread (the changelog partitions every changed key).  Kafka's own algorithm (``Utils.murmur2``), word by word."""
    out = np.empty(len(keys), dtype=np.uint32)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    for length, rows in by_length.items():
        data = np.frombuffer(b"".join([keys[i] for i in rows]), dtype=np.uint8).reshape(len(rows), length)
        h = np.full(len(rows), (0x9747B28C ^ length) & 0xFFFFFFFF, dtype=np.uint32)
        words = np.ascontiguousarray(data[:, : length // 4 * 4]).view("<u4")
        for j in range(length // 4):
            k = words[:, j] * _M
            k ^= k >> np.uint32(24)
            k *= _M
            h *= _M
            h ^= k
        tail, extra = length & ~3, length % 4
        if extra >= 3:
            h ^= data[:, tail + 2].astype(np.uint32) << np.uint32(16)
        if extra >= 2:
            h ^= data[:, tail + 1].astype(np.uint32) << np.uint32(8)
        if extra >= 1:
            h ^= data[:, tail].astype(np.uint32)
            h *= _M
        h ^= h >> np.uint32(13)
        h *= _M
        h ^= h >> np.uint32(15)
        out[rows] = h
    return (out & np.uint32(0x7FFFFFFF)).tolist()
