"""The compaction query as the runner sees it: the tier's committed batches -> latest value per key
-> the KV view, compacted snapshots and, when Kafka is on, the changelog topic
(``streaming.queries.compaction.handler``)."""

from __future__ import annotations

import dataclasses
import json
import logging

from connectors.kafka.changelog import ChangelogSink
from connectors.sinks import CHANGELOG, KV
from connectors.threads import start_arrow_pool
from connectors.tier.location import open_backend
from connectors.tier.feed import FeedMessages
from streaming.runtime.checkpoints import SHUFFLE_PARTITIONS, STATE_PROVIDER, Batch
from streaming.sources.hold import hold_options
from streaming.queries.compaction.handler import CompactionReport, CompactionHandler, compaction_stream
from streaming.runtime.priority import JvmThreads
from streaming.queries.base import RunContext, StreamedQuery, open_feed
from streaming.settings import Settings

log = logging.getLogger("tierlog.service")


class CompactionQuery(StreamedQuery):
    name = "compaction"
    output_mode = "update"
    reads_commitlog = False

    @classmethod
    def enabled(cls, settings: Settings) -> bool:
        return settings.compaction.enabled

    @classmethod
    def sinks(cls, settings: Settings) -> list[str]:
        return [KV] + ([CHANGELOG] if settings.changelog else [])

    @classmethod
    def guarded_settings(cls, settings: Settings, spark) -> dict[str, str]:
        guarded = {**super().guarded_settings(settings, spark), "commitlog.key_property": settings.compaction.key_property}
        if spark is None:  # checked before the session starts: only what the settings say
            return guarded
        return {**guarded, "spark.shuffle_partitions": spark.conf.get(SHUFFLE_PARTITIONS),  # what the session uses
                "state store provider": spark.conf.get(STATE_PROVIDER, "")}

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        s, metadata = ctx.settings, ctx.metadata
        changelog = None
        if s.changelog:
            changelog = ChangelogSink(
                s.kafka, should_stop=ctx.should_stop,
                on_health=lambda h: metadata.journal.record_health(CHANGELOG, h),
                on_skip=lambda phy, why: metadata.journal.record_skip(CHANGELOG, phy, why),
            )
        self.feed = FeedMessages(open_backend(s.paths.tier, create=False, copies=s.copies),
                                 metadata.feed.batches, s.broker)
        self.handler = CompactionHandler(s.compaction.writer, ctx.kv, metadata, on_batch=self.report,
                                         changelog=changelog, messages=self.feed,
                                         on_applied=lambda start: metadata.feed.release(self.name, start),
                                         nice=ctx.compaction_nice)
        if ctx.compaction_nice:
            start_arrow_pool()  # before the KV threads could start it at their niceness
        self.jvm_threads = JvmThreads(None, 0)  # the JVM's, once the stream is made
        self.start_at = 0
        self.lock = self.handler.lock
        self._kafka_counts = {"sent": 0, "retries": 0}  # the changelog's, as last counted

    def stream(self, spark):
        s = self.ctx.settings
        copies, c = s.copies, s.compaction
        self.jvm_threads = JvmThreads.of(spark, self.ctx.compaction_nice)
        hold = hold_options(c.min_batch_bytes, c.max_batch_delay_s, self.ctx.until_caught_up)
        return compaction_stream(spark, {"metadata": self.ctx.metadata.path, "startingOffset": self.start_at,
                                         "maxBytesPerTrigger": c.max_batch_bytes,
                                         "tasks": spark.sparkContext.defaultParallelism,
                                         "location": s.paths.tier, "broker": s.broker,
                                         "localCopies": copies and json.dumps(dataclasses.asdict(copies)),
                                         "topics": s.filters["compaction"].to_json(), **hold})

    def start(self, committed_end: int | None) -> None:
        # A new checkpoint (Spark's state lost or never made) reads all the tier holds, so Spark's
        # state knows every key again; otherwise the tier's batches from what the view applied, or
        # from where Spark's last committed batch ends if that is lower: a stop between the view's
        # apply and Spark's commit runs that batch again, and after a `tier rebuild-metadata` the
        # listing holds only what this opens.
        applied = self.ctx.kv.applied_through()
        since = None if committed_end is None else applied if applied is None else min(applied, committed_end)
        self.start_at = self.feed.first = self.handler.start_at = open_feed(
            self.ctx.metadata, self.name, since, "the KV view takes")
        self.handler.catch_up(committed_end)

    def caught_up(self) -> bool:
        # Never waits: holding the lock while the batches in flight were applied kept Spark's next
        # batch out of ``process`` (it takes the lock), so a draining run applied its last batches
        # one at a time, each after its Spark job, with no overlap.
        if not self.lock.acquire(blocking=False):
            return False  # a batch is being handed over
        try:
            if not self.handler.applied_all():
                return False
            # This query's own batches, not the view's record: a new checkpoint reads the tier again.
            end = self.handler.applied_end
            return end is not None and end >= (self.ctx.metadata.source_end() or 0)
        finally:
            self.lock.release()

    def process(self, batch: Batch) -> None:
        self.handler.process(batch)
        self.jvm_threads.lower()  # the task threads this batch's Spark job started

    def tick(self) -> None:
        self.handler.tick()  # a quiet stream runs no batches, but keys still expire and snapshots fall due

    def poll_metrics(self) -> None:
        m, kv = self.ctx.metrics, self.ctx.kv
        m.state_rows.labels("kv").set(kv.estimated_keys())  # Spark's own count is off: it costs a read per write
        m.state_memory.labels("kv").set(kv.memory_bytes())
        changelog = self.handler.writer.changelog
        if changelog is not None:
            stats = changelog.stats
            m.kafka_sent.labels("changelog").inc(stats.sent - self._kafka_counts["sent"])
            m.kafka_errors.labels("changelog").inc(stats.retries - self._kafka_counts["retries"])
            self._kafka_counts = {"sent": stats.sent, "retries": stats.retries}

    def flush(self) -> None:
        self.handler.flush()  # the last batch's view update, on the apply thread
        if self.ctx.until_caught_up:  # the latest-per-key tables hold what the view holds, at the end
            self.handler.writer.snapshot_changed()

    def close(self) -> None:
        self.handler.close()

    def report(self, report: CompactionReport) -> None:
        line = {
            "query": self.name, "batch": report.batch_id, "changes": report.changes, "applied": report.applied,
            "expired": report.expired, "source_end": report.source_end, "seconds": round(report.seconds, 3),
            "phases": report.phases,
        }
        if report.snapshot_rows is not None:
            line["snapshot_rows"] = report.snapshot_rows
        log.info("batch %s", json.dumps(line))
        self.ctx.metrics.batch_seconds.labels(self.name).observe(report.seconds)
