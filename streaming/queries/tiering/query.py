"""The tiering query as the runner sees it: commitlog -> the tier (``streaming.queries.tiering.handler``)."""

from __future__ import annotations

import json
import logging
import os
import time

from connectors.commitlog.reader import CommitLogReader
from connectors.sinks import TIER
from connectors.errors import TierlogError
from streaming.queries.base import Batch, RunContext, StreamedQuery
from streaming.settings import Settings
from streaming.sources.commitlog import SourceOptions, expected_batch, starting_offset
from streaming.queries.tiering.handler import BatchReport, TieringSettings, TieringHandler, refs_stream

log = logging.getLogger("tierlog.service")


class TieringQuery(StreamedQuery):
    name = "tiering"

    @classmethod
    def sinks(cls, settings: Settings) -> list[str]:
        return [TIER]

    @classmethod
    def guarded_settings(cls, settings: Settings, spark) -> dict[str, str]:
        location = settings.paths.tier
        return {**super().guarded_settings(settings, spark),
                "tier.location": location if "://" in location else os.path.abspath(location)}

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        s = ctx.settings
        self.handler = TieringHandler(TieringSettings(s.stage, s.writer, s.tables, s.driver_stage_bytes,
                                                      s.stage_processes, s.partition_bytes), ctx.metadata,
                                      on_batch=self.report, expect=self._expect, header_reader=self._reader)
        self.lock = self.handler.lock
        self.batches = self.rows = self.bytes = 0
        self._log_reader: CommitLogReader | None = None  # kept open: it remembers the frontier
        self._source_options: SourceOptions | None = None
        self._table_counts = (0, 0)  # the message tables' commits and fresh files, as last counted
        self._unreadable: dict[str, int] = {}  # per topic: bodies its format could not read, as last counted
        self._tables_logged = (0, 0)  # the same, as the last batch line gave them

    def start(self, committed_end: int | None) -> None:
        """Start staging the first batch when tiering resumes behind (``TieringHandler.start_behind``):
        from its checkpoint's end, else from ``source.starting_offset``."""
        try:
            reader = self._reader()
            begin = committed_end if committed_end is not None else starting_offset(
                reader, self.ctx.settings.starting_offset)
            end = reader.end_offset()
            begin = max(begin, reader.first_offset())
        except TierlogError as exc:  # the run's own reads meet it again, and say so
            log.debug("not staging ahead: %s", exc)
            return
        self.handler.start_behind(begin, end)

    def _expect(self, begin: int) -> tuple[int, tuple[int, ...]]:
        """The end and splits of the batch this query's stream is expected to run from ``begin``."""
        if self._source_options is None:
            self._source_options = SourceOptions.parse(
                {k: str(v) for k, v in self.ctx.settings.source.items() if v is not None})
        batch = expected_batch(self._reader(), self._source_options, begin, draining=self.ctx.until_caught_up)
        return batch.end, batch.splits

    def stream(self, spark):
        return refs_stream(spark, self.ctx.settings.source)

    def process(self, batch: Batch) -> None:
        self.handler.process(batch)

    def flush(self) -> None:
        self.handler.flush()  # a clean stop leaves a root that covers every commit
        pool = self.handler.pool
        ahead = "" if pool is None or not (pool.ahead_used or pool.ahead_dropped) else \
            f"; of the ranges staged ahead, {pool.ahead_used} were taken and {pool.ahead_dropped} dropped"
        log.info("stopped: %d tiering batches, %d messages, %.1f MB%s", self.batches, self.rows, self.bytes / 1e6, ahead)

    def close(self) -> None:
        self.handler.close()
        if self._log_reader is not None:
            self._log_reader.close()

    def tick(self) -> None:
        self.handler.tick()

    def poll_metrics(self) -> None:
        tables = self.handler.writer.tables
        if tables is None:
            return
        m = self.ctx.metrics
        for topic, (messages, seconds) in tables.lag().items():
            m.table_lag_messages.labels(topic).set(messages)
            m.table_lag_seconds.labels(topic).set(seconds)
        for topic, count in tables.unreadable.items():
            m.table_unreadable.labels(topic).inc(count - self._unreadable.get(topic, 0))
        self._unreadable = dict(tables.unreadable)
        m.table_commits.inc(tables.commits - self._table_counts[0])
        m.table_files.inc(tables.files_written - self._table_counts[1])
        self._table_counts = (tables.commits, tables.files_written)

    def report(self, report: BatchReport) -> None:
        frontier = self._frontier(report.source_end)
        lag_bytes = max(0, frontier - (report.source_end or 0)) if report.source_end is not None else 0
        avg = report.bytes / report.rows if report.rows else 0
        self.batches += 1
        self.rows += report.rows
        self.bytes += report.bytes
        line = {
            "query": self.name, "batch": report.batch_id, "rows": report.rows, "bytes": report.bytes,
            "objects": report.objects, "seals": report.seals, "seconds": round(report.seconds, 3),
            "lag_bytes": lag_bytes, "lag_msgs": round(lag_bytes / avg) if avg else 0,
            "lag_s": round(max(0.0, time.time() - report.max_store_ts / 1000), 3)
            if report.max_store_ts and lag_bytes else 0.0,
            "total_rows": self.rows,
        }
        if report.phases:
            line["phases"] = report.phases
            line["staged_by"] = report.staged_by
        if report.replay:
            line["replay"] = True
        tables = self.handler.writer.tables
        if tables is not None:  # since the last line: the message tables' commits and fresh files
            done = (tables.commits, tables.files_written)
            line["tables"] = {"commits": done[0] - self._tables_logged[0], "files": done[1] - self._tables_logged[1]}
            self._tables_logged = done
        log.info("batch %s", json.dumps(line))
        m = self.ctx.metrics
        m.batch_seconds.labels(self.name).observe(report.seconds)
        m.rows_in.labels(self.name).inc(report.read_on_driver)  # Spark counts the rest from its progress
        m.bytes_in.labels(self.name).inc(report.bytes)
        m.behind_messages.set(line["lag_msgs"])
        m.behind_seconds.set(line["lag_s"])
        m.seals.inc(report.seals)
        for kind, seconds in report.uploads or ():
            m.upload_seconds.labels(kind).observe(seconds)
            m.objects.labels(kind).inc()
        if not report.replay:
            m.objects.labels("commit_record").inc()

    def _reader(self) -> CommitLogReader:
        """The query's own header reader, kept open: it remembers the frontier between walks."""
        if self._log_reader is None:
            self._log_reader = self.ctx.settings.reader.open(check_crc=False)
        return self._log_reader

    def known_end(self) -> int | None:
        """The commitlog's end as this query last walked to it (for its last batch's line), without a
        walk; None before its first batch."""
        reader = self._log_reader
        return None if reader is None else reader.frontier

    def _frontier(self, hint: int | None) -> int:
        """The commitlog's end, for the lag in the batch line; 0 when it cannot be read."""
        reader = self._reader()
        try:
            return reader.end_offset(hint)
        except TierlogError:
            return 0
