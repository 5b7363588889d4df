"""The mirror query as the runner sees it: commitlog -> one Kafka record per message
(``streaming.mirror_handler``)."""

from __future__ import annotations

import json
import logging

from connectors.sinks import MIRROR
from streaming import config as cfg
from streaming.checkpoints import Batch
from streaming.queries.base import Query, RunContext
from streaming.mirror_handler import MirrorHandler, MirrorReport
from streaming.tier_handler import refs_stream

log = logging.getLogger("tierlog.service")


class MirrorQuery(Query):
    name = "mirror"

    @classmethod
    def enabled(cls, conf: cfg.Config) -> bool:
        return bool(conf.kafka.bootstrap.strip()) and conf.kafka.mirror

    @classmethod
    def sinks(cls, conf: cfg.Config) -> list[str]:
        return [MIRROR]

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.handler = MirrorHandler(
            ctx.kafka, ctx.settings.reader, ctx.metadata, tasks=ctx.conf.kafka.mirror_tasks,
            should_stop=ctx.should_stop, on_batch=self.report, topics=ctx.settings.filters["mirror"],
        )
        self.lock = self.handler.lock

    def stream(self, spark):
        return refs_stream(spark, self.ctx.source_options)

    def process(self, batch: Batch) -> None:
        self.handler.process(batch)

    def report(self, report: MirrorReport) -> None:
        line = {"query": self.name, "batch": report.batch_id, "sent": report.sent, "skipped": report.skipped,
                "mb": round(report.bytes / 1e6, 3), "source_end": report.source_end,
                "seconds": round(report.seconds, 3), "attempts": report.attempts}
        log.info("batch %s", json.dumps(line))
        m = self.ctx.metrics
        m.batch_seconds.labels(self.name).observe(report.seconds)
        m.bytes_in.labels(self.name).inc(report.bytes)
        m.kafka_sent.labels(self.name).inc(report.sent)
        m.kafka_errors.labels(self.name).inc(report.attempts - 1)
        if report.sent:
            m.kafka_rate.labels(self.name).set(report.sent / max(report.seconds, 1e-3))
