"""The mirror query as the runner sees it: the tier's committed batches -> one Kafka record per
message (``streaming.queries.mirror.handler``), sent as soon as the tier commits them, without a Spark
stream (``streaming.runtime.follower``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from connectors.sinks import MIRROR
from state.tier_feed import next_end
from streaming.sources.hold import BatchHold
from streaming.queries.base import RunContext, SteppedQuery, open_feed
from streaming.queries.mirror.handler import MirrorHandler, MirrorReport, driver_sized_end
from streaming.settings import Settings

log = logging.getLogger("tierlog.service")


@dataclass(frozen=True)
class FeedRange:
    """One mirror batch: ``[start, end)`` of the tier's committed batches."""

    batch_id: int
    start: int
    end: int


def step_end(feed, start: int, max_bytes: int, driver_bytes: int, held=lambda end: False) -> int:
    """Where a mirror step from ``start`` ends: the tier's committed batches past it up to
    ``max_bytes`` of commitlog (0: no bound), cut to what the driver sends unless it is a backfill
    (``driver_sized_end``); ``start`` when nothing is there or ``held(end)`` holds it back (the
    hold weighs the whole range, not the cut one)."""
    end = next_end(feed.batch_ends(start), start, max_bytes)
    if end <= start or held(end):
        return start
    return driver_sized_end(feed.batches(start, end), start, end, driver_bytes)


class MirrorQuery(SteppedQuery):  # woken by the tier's commits (streaming.runtime.follower)
    name = "mirror"

    @classmethod
    def enabled(cls, settings: Settings) -> bool:
        return settings.mirror.enabled

    @classmethod
    def sinks(cls, settings: Settings) -> list[str]:
        return [MIRROR]

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        store = ctx.metadata
        applied = store.journal.sinks().get(MIRROR)
        at = open_feed(store, self.name, applied, "the mirror first sends")
        s, mirror = ctx.settings, ctx.settings.mirror
        self.handler = MirrorHandler(
            s.kafka, s.paths.tier, store, at if applied is None else applied, tasks=mirror.tasks,
            should_stop=ctx.should_stop, on_batch=self.report, topics=s.filters["mirror"], copies=s.copies,
            driver_bytes=mirror.driver_bytes, process=mirror.process,
        )
        self.lock = self.handler.lock
        # A quiet broker's mirror sends seconds apart: fewer, larger produce requests.
        self.hold = BatchHold(mirror.min_batch_bytes, mirror.max_batch_delay_s)
        self.batch_id = 0  # this run's batches, for the log

    def step(self, spark) -> bool:
        """The tier's committed batches past what was sent, up to ``maxBytesPerTrigger`` of commitlog,
        held back while under ``kafka.mirror_min_batch_bytes`` (for up to ``mirror_max_batch_delay_s``),
        and cut to what the driver sends unless it is a backfill (``driver_sized_end``)."""
        start = self.handler.start_at
        end = step_end(self.ctx.metadata.feed, start, int(self.ctx.settings.source.get("maxBytesPerTrigger") or 0),
                       self.ctx.settings.mirror.driver_bytes,
                       lambda end: self.hold.held_back(start, end, draining=self.ctx.until_caught_up))
        if end <= start:
            return False
        self.handler.process(FeedRange(self.batch_id, start, end), spark)
        self.batch_id += 1
        return True

    def caught_up(self) -> bool:
        with self.lock:  # not in the middle of a batch
            return self.handler.start_at >= (self.ctx.metadata.source_end() or 0)

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
