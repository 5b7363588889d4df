"""The mirror query as the runner sees it: the tier's committed batches -> one Kafka record per
message (``streaming.mirror_handler``)."""

from __future__ import annotations

import json
import logging

from connectors.sinks import MIRROR
from streaming import config as cfg
from streaming.checkpoints import Batch
from streaming.hold import hold_options
from streaming.queries.base import Query, RunContext, open_feed
from streaming.mirror_handler import MirrorHandler, MirrorReport

log = logging.getLogger("tierlog.service")


class MirrorQuery(Query):
    name = "mirror"
    reads_commitlog = False

    @classmethod
    def enabled(cls, conf: cfg.Config) -> bool:
        return bool(conf.kafka.bootstrap.strip()) and conf.kafka.mirror

    @classmethod
    def sinks(cls, conf: cfg.Config) -> list[str]:
        return [MIRROR]

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        store = ctx.metadata
        applied = store.journal.sinks().get(MIRROR)
        at = open_feed(store, self.name, applied, "the mirror first sends")
        self.start_at = at if applied is None else applied
        self.handler = MirrorHandler(
            ctx.kafka, ctx.conf.tier.location, store, self.start_at, tasks=ctx.conf.kafka.mirror_tasks,
            should_stop=ctx.should_stop, on_batch=self.report, topics=ctx.settings.filters["mirror"], copies=ctx.settings.copies,
            driver_bytes=ctx.conf.kafka.mirror_driver_bytes,
        )
        self.lock = self.handler.lock

    def stream(self, spark):
        reader = (spark.readStream.format("tierfeed").option("metadata", self.ctx.metadata.path)
                  .option("startingOffset", str(self.start_at)))
        max_bytes = self.ctx.source_options.get("maxBytesPerTrigger")
        if max_bytes:
            reader = reader.option("maxBytesPerTrigger", str(max_bytes))
        kafka = self.ctx.conf.kafka
        # A quiet broker's mirror runs a micro-batch seconds apart.
        return reader.options(**hold_options(kafka.mirror_min_batch_bytes, kafka.mirror_max_batch_delay_s,
                                             self.ctx.until_caught_up)).load()

    def caught_up(self) -> bool:
        with self.lock:  # not in the middle of a batch
            return self.handler.start_at >= (self.ctx.metadata.source_end() or 0)

    def process(self, batch: Batch) -> None:
        self.handler.process(batch)

    def close(self) -> None:
        self.handler.close()

    def report(self, report: MirrorReport) -> None:
        line = {"query": self.name, "batch": report.batch_id, "sent": report.sent, "skipped": report.skipped,
                "mb": round(report.bytes / 1e6, 3), "source_end": report.source_end,
                "seconds": round(report.seconds, 3), "attempts": report.attempts}
        if report.attempts:
            line["sent_by"] = "driver" if report.on_driver else "spark"
        log.info("batch %s", json.dumps(line))
        m = self.ctx.metrics
        m.batch_seconds.labels(self.name).observe(report.seconds)
        m.bytes_in.labels(self.name).inc(report.bytes)
        m.kafka_sent.labels(self.name).inc(report.sent)
        m.kafka_errors.labels(self.name).inc(max(0, report.attempts - 1))  # 0 attempts: nothing to send
        if report.sent:
            m.kafka_rate.labels(self.name).set(report.sent / max(report.seconds, 1e-3))
