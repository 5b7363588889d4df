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
from streaming import config as cfg
from streaming.runtime.checkpoints import SHUFFLE_PARTITIONS, STATE_PROVIDER, Batch
from streaming.sources.hold import hold_options
from streaming.queries.compaction.handler import CompactionReport, CompactionHandler, compaction_stream
from streaming.runtime.priority import JvmThreads
from streaming.queries.base import Query, RunContext, open_feed
from streaming.settings import compaction_settings

log = logging.getLogger("tierlog.service")


def changelog_enabled(conf: cfg.Config) -> bool:
    return bool(conf.kafka.bootstrap.strip()) and conf.kafka.changelog and conf.compaction.enabled


# How many times the commitlog source's cap a compaction batch takes while it is behind, when
# compaction.max_batch_bytes is not set.  Its rows are keys and offsets, and the view references
# values of 1 KiB and more; with 900-byte values copied into the view, a 1 GiB batch raised the
# driver's peak by 170 MB.  Over many keys a larger batch holds more repeats of each.  Catching up
# 621 MB of 2 KB values over 100,000 keys, one batch wrote 211,000 changes against three batches'
# 260,000 (docs/benchmarks.md, "Compaction's batches four times the source's cap").  The changelog
# sends a batch's bodies a slice at a time (connectors.kafka.changelog), so with it on, catching
# up 16 KiB values over a million keys at 1 GiB, the driver peaked at 2.0 GB against 2.2 GB for
# the source's cap before (6.6 GB at 1 GiB before the slices).
SOURCE_CAP_FACTOR = 4


def batch_cap(conf: cfg.Config, source_options: dict) -> int | None:
    """The ``tierfeed`` source's ``maxBytesPerTrigger``: ``compaction.max_batch_bytes`` when set;
    else the commitlog source's own cap (``source.max_bytes_per_trigger``; None: none) times
    ``SOURCE_CAP_FACTOR``."""
    if conf.compaction.max_batch_bytes:
        return conf.compaction.max_batch_bytes
    source = source_options.get("maxBytesPerTrigger")
    return None if source is None else int(source) * SOURCE_CAP_FACTOR


class CompactionQuery(Query):
    name = "compaction"
    output_mode = "update"
    reads_commitlog = False

    @classmethod
    def enabled(cls, conf: cfg.Config) -> bool:
        return conf.compaction.enabled

    @classmethod
    def sinks(cls, conf: cfg.Config) -> list[str]:
        return [KV] + ([CHANGELOG] if changelog_enabled(conf) else [])

    @classmethod
    def guarded_settings(cls, conf: cfg.Config, spark) -> dict[str, str]:
        return {**super().guarded_settings(conf, spark),
                "commitlog.key_property": conf.commitlog.key_property,
                "spark.shuffle_partitions": spark.conf.get(SHUFFLE_PARTITIONS),  # what the session uses
                "state store provider": spark.conf.get(STATE_PROVIDER, "")}

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        conf, metadata = ctx.conf, ctx.metadata
        changelog = None
        if changelog_enabled(conf):
            changelog = ChangelogSink(
                ctx.kafka, should_stop=ctx.should_stop,
                on_health=lambda h: metadata.journal.record_health(CHANGELOG, h),
                on_skip=lambda phy, why: metadata.journal.record_skip(CHANGELOG, phy, why),
            )
        self.feed = FeedMessages(open_backend(conf.tier.location, create=False, copies=ctx.settings.copies),
                                 metadata.feed.batches, conf.broker.name)
        self.handler = CompactionHandler(compaction_settings(ctx.settings), ctx.kv, metadata, on_batch=self.report,
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
        conf, copies = self.ctx.conf, self.ctx.settings.copies
        self.jvm_threads = JvmThreads.of(spark, self.ctx.compaction_nice)
        hold = hold_options(conf.compaction.min_batch_bytes, conf.compaction.max_batch_delay_s,
                            self.ctx.until_caught_up)
        return compaction_stream(spark, {"metadata": self.ctx.metadata.path, "startingOffset": self.start_at,
                                         "maxBytesPerTrigger": batch_cap(conf, self.ctx.source_options),
                                         "tasks": spark.sparkContext.defaultParallelism,
                                         "location": conf.tier.location, "broker": conf.broker.name,
                                         "localCopies": copies and json.dumps(dataclasses.asdict(copies)),
                                         "topics": self.ctx.settings.filters["compaction"].to_json(), **hold})

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
        self.handler.sweep()  # a quiet stream runs no batches, but keys still expire

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
