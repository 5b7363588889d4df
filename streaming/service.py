"""``tierlog run``: the long-running service around the streaming queries.

It opens the metadata store (which also keeps a second service off the same
state), starts the tiering query, logs one structured line per batch, and
stops gracefully on SIGTERM or SIGINT: the batch in flight finishes and is
committed, and no new one starts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from connectors.commitlog.reader import CommitLogReader
from connectors.errors import ConfigError, TierlogError
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming.tiering import BatchReport, TieringSettings, TieringSink, refs_stream

log = logging.getLogger("tierlog.service")


class StopRequested(TierlogError):
    """Raised inside a batch that starts after a stop was requested; that batch did nothing."""


def tiering_settings(conf: cfg.Config) -> TieringSettings:
    t = conf.tier
    return TieringSettings(
        location=t.location,
        commitlog_dir=conf.commitlog.dir,
        key_property=conf.commitlog.key_property,
        check_crc=conf.commitlog.check_crc,
        segment_bytes=t.segment_bytes,
        segment_messages=t.segment_messages,
        segment_age_s=t.segment_age_s,
        retention_s=cfg.parse_retention(t.retention),
        compact_every=max(1, t.compact_every),
        delete_grace_s=t.delete_grace_s,
        driver_pid=os.getpid(),
    )


def source_options(conf: cfg.Config) -> dict:
    s = conf.source
    return {
        "path": conf.commitlog.dir,
        "maxRecordsPerTrigger": s.max_records_per_trigger or None,
        "maxBytesPerTrigger": s.max_bytes_per_trigger or None,
        "partitionBytes": s.partition_bytes,
        "startingOffset": s.starting_offset,
        "checkCrc": str(conf.commitlog.check_crc).lower(),
        "keyProperty": conf.commitlog.key_property,
    }


def metadata_path(conf: cfg.Config) -> str:
    return os.path.join(conf.state.dir, "metadata")


@dataclass
class Progress:
    """What the service reports about its catch-up."""

    batches: int = 0
    rows: int = 0
    bytes: int = 0
    lag_bytes: int = 0


class Service:
    def __init__(self, conf: cfg.Config):
        self.conf = conf
        self.stopping = threading.Event()
        self.progress = Progress()
        self._log_reader: CommitLogReader | None = None  # kept open: it remembers the frontier

    # ------------------------------------------------------------ per-batch report

    def _on_batch(self, report: BatchReport) -> None:
        frontier = self._frontier(report.source_end)
        lag_bytes = max(0, frontier - (report.source_end or 0)) if report.source_end is not None else 0
        avg = report.bytes / report.rows if report.rows else 0
        p = self.progress
        p.batches += 1
        p.rows += report.rows
        p.bytes += report.bytes
        p.lag_bytes = lag_bytes
        line = {
            "query": "tiering", "batch": report.batch_id, "rows": report.rows, "bytes": report.bytes,
            "objects": report.objects, "seals": report.seals, "seconds": round(report.seconds, 3),
            "lag_bytes": lag_bytes, "lag_msgs": round(lag_bytes / avg) if avg else 0,
            "lag_s": round(max(0.0, time.time() - report.max_store_ts / 1000), 3)
            if report.max_store_ts and lag_bytes else 0.0,
            "total_rows": p.rows,
        }
        if report.phases:
            line["phases"] = report.phases
        if report.replay:
            line["replay"] = True
        log.info("batch %s", json.dumps(line))

    def _frontier(self, hint: int | None) -> int:
        """The commitlog's end, for the lag in the batch line; 0 when it cannot be read."""
        if self._log_reader is None:
            self._log_reader = CommitLogReader(self.conf.commitlog.dir)
        try:
            return self._log_reader.end_offset(hint)
        except TierlogError:
            return 0

    # ------------------------------------------------------------ running

    def run(self, until_caught_up: bool = False, spark=None) -> int:
        conf = self.conf
        if not os.path.isdir(conf.commitlog.dir):
            raise ConfigError(
                f"commitlog.dir {conf.commitlog.dir!r} does not exist: produce to it first "
                "(`tierlog produce`) or point it at a broker's store/commitlog"
            )
        settings = tiering_settings(conf)
        metadata = MetadataStore(metadata_path(conf))
        try:
            if spark is None:
                from streaming.session import build_session

                spark = build_session(
                    "tierlog", conf.spark.master, {"spark.sql.shuffle.partitions": str(conf.spark.shuffle_partitions)}
                )
            sink = TieringSink(settings, metadata, on_batch=self._on_batch)
            self.sink = sink
            return self._run_query(spark, sink, until_caught_up)
        finally:
            metadata.close()
            if self._log_reader is not None:
                self._log_reader.close()

    def _run_query(self, spark, sink: TieringSink, until_caught_up: bool) -> int:
        conf = self.conf

        def process(df, batch_id):
            if self.stopping.is_set():
                raise StopRequested("stop requested before this batch started")
            sink.process(df, batch_id)

        writer = (
            refs_stream(spark, source_options(conf))
            .writeStream.queryName("tiering")
            .foreachBatch(process)
            .option("checkpointLocation", os.path.join(conf.checkpoint.dir, "tiering"))
        )
        if until_caught_up:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{int(conf.spark.trigger_interval_s * 1000)} milliseconds")
        query = writer.start()
        self._install_signals()
        log.info("tiering %s -> %s (%s)", conf.commitlog.dir, conf.tier.location,
                 "until caught up" if until_caught_up else "until stopped")
        while query.isActive and not self.stopping.is_set():
            try:
                query.awaitTermination(0.5)
            except Exception:  # noqa: BLE001 - the query failed; _outcome says why
                break
        if self.stopping.is_set() and query.isActive:
            with sink.lock:  # the batch in flight, if any, finishes and commits first
                query.stop()
        return self._outcome(query)

    def _outcome(self, query) -> int:
        exc = query.exception()
        if exc is None:
            log.info("tiering stopped: %d batches, %d messages, %.1f MB", self.progress.batches,
                     self.progress.rows, self.progress.bytes / 1e6)
            return 0
        text = str(exc)
        if "StopRequested" in text and self.stopping.is_set():
            return 0
        raise TierlogError(f"the tiering query failed: {_root_cause(text)}")

    def _install_signals(self) -> None:
        def handler(signum, _frame):
            log.info("received %s: finishing the batch in flight, then stopping", signal.Signals(signum).name)
            self.stopping.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)


_OUR_ERRORS = ("CorruptRecordError", "SkippedMessagesError", "LogLayoutError", "OffsetOutOfRangeError",
               "BucketNotFound", "AccessDenied", "TransientTierError", "TierError", "TierlogError",
               "ConfigError", "MetadataError", "TierLogError")


def _root_cause(text: str) -> str:
    """The line of a Spark/Python traceback that carries tierlog's own error, else the first line."""
    for line in text.splitlines():
        stripped = line.strip()
        for name in _OUR_ERRORS:
            if stripped.startswith(("connectors.", "streaming.", "state.")) and f".{name}: " in stripped:
                return stripped.split(": ", 1)[1]
            if stripped.startswith(f"{name}: "):
                return stripped.split(": ", 1)[1]
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
