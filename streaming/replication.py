"""The mirror query: commitlog -> Kafka, one record per message.

    spark.readStream.format("commitlog")  (references only: physical offset and size)
      -> foreachBatch(MirrorQuery.process)

Spark gives the query its micro-batches, admission control and checkpoint;
the batch's messages are read and sent by one producer on the driver,
because a partition's records must arrive in order and its position is read
back from its last record (``connectors.kafka.sink``).  Per batch:

1. find the batch's byte range from its references (a small Spark job);
2. read the range from the commitlog with the Arrow fast path and send it
   (what Kafka already holds is skipped), waiting out a broker that is away;
3. record the batch's end as the ``mirror`` sink's applied offset, which
   bounds the safepoint.

The changelog sink rides on the compaction query instead (see
``streaming.compaction``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from connectors.commitlog.reader import CommitLogReader
from connectors.kafka.mirror import MIRROR_COLUMNS, MirrorSink
from connectors.kafka.settings import KafkaSettings
from streaming.compaction import CHANGELOG_SINK, batch_end_offset
from streaming.faults import crash_point

log = logging.getLogger("tierlog.replication")

MIRROR_SINK = "mirror"
__all__ = ["CHANGELOG_SINK", "MIRROR_SINK", "MirrorQuery", "MirrorReport"]


@dataclass
class MirrorReport:
    batch_id: int
    sent: int
    skipped: int
    bytes: int
    source_end: int
    seconds: float


class MirrorQuery:
    """The foreachBatch of the mirror query.  One instance per running query, on the driver."""

    def __init__(self, kafka: KafkaSettings, commitlog_dir: str, checkpoint: str, metadata=None, *,
                 key_property: str = "KEYS", check_crc: bool = True, should_stop: Callable[[], bool] = lambda: False,
                 on_batch: Callable[[MirrorReport], None] | None = None, driver_pid: int = 0):
        self.checkpoint = checkpoint
        self.metadata = metadata
        self.key_property = key_property
        self.on_batch = on_batch
        self.driver_pid = driver_pid
        self.lock = threading.Lock()  # held while a batch is sent; a graceful stop waits on it
        self.reader = CommitLogReader(commitlog_dir, check_crc=check_crc)
        self.sink = MirrorSink(
            kafka, should_stop=should_stop,
            on_health=None if metadata is None else lambda h: metadata.record_health(MIRROR_SINK, h),
            on_skip=None if metadata is None else lambda phy, why: metadata.record_skip(MIRROR_SINK, phy, why),
        )

    def process(self, df, batch_id: int) -> None:
        from pyspark.sql import functions as F

        with self.lock:
            started = time.monotonic()
            before = (self.sink.stats.sent, self.sink.stats.skipped, self.sink.stats.bytes)
            end = batch_end_offset(self.checkpoint, batch_id)
            lo = df.agg(F.min("phy_offset")).first()[0]
            if lo is not None:
                self.sink.publish(lambda: self.reader.record_batches(
                    lo, end, key_property=self.key_property, columns=MIRROR_COLUMNS))
            crash_point("mirrored", self.driver_pid)
            if self.metadata is not None:
                self.metadata.record_sink(MIRROR_SINK, end)
            s = self.sink.stats
            report = MirrorReport(batch_id, s.sent - before[0], s.skipped - before[1], s.bytes - before[2], end,
                                  time.monotonic() - started)
            if self.on_batch:
                self.on_batch(report)

    def close(self) -> None:
        try:
            self.sink.close()
        finally:
            self.reader.close()
