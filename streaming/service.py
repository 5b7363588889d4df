"""``tierlog run``: the long-running service around the streaming queries.

It opens the metadata store (which also keeps a second service off the same
state) and the KV view, and starts in one Spark application the tiering
query; unless ``compaction.enabled`` is off, the compaction query (with the
Kafka changelog sink when Kafka is on); and, when ``kafka.bootstrap`` is set,
the Kafka mirror query.  It logs one structured line per batch; and stops gracefully on
SIGTERM or SIGINT: the batches in flight finish and are committed, and no new
one starts.  When one query fails, the others stop the same way and the
failure is raised.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from connectors.commitlog.reader import CommitLogReader
from connectors.kafka.settings import KafkaSettings, parse_topic_map
from connectors.errors import ConfigError, StopRequested, TierlogError
from state.kv import KVView
from state.metadata import MetadataStore
from streaming import config as cfg
from connectors.kafka.changelog import ChangelogSink
from streaming.checkpoints import check_or_record, guarded_settings
from streaming.metrics import Metrics
from streaming.compaction import CompactionReport, CompactionSettings, CompactionSink, compaction_stream
from streaming.replication import MirrorQuery, MirrorReport
from streaming.tiering import BatchReport, TieringSettings, TieringSink, refs_stream

log = logging.getLogger("tierlog.service")


def tiering_settings(conf: cfg.Config) -> TieringSettings:
    t = conf.tier
    return TieringSettings(
        location=t.location,
        broker=conf.broker.name,
        commitlog_dir=conf.commitlog.dir,
        key_property=conf.commitlog.key_property,
        check_crc=conf.commitlog.check_crc,
        on_corrupt=conf.commitlog.on_corrupt,
        segment_bytes=t.segment_bytes,
        segment_messages=t.segment_messages,
        segment_age_s=t.segment_age_s,
        retention_s=cfg.parse_retention(t.retention),
        retention_bytes=cfg.parse_topic_limits(t.retention_bytes, "tier.retention_bytes", size=True),
        retention_messages=cfg.parse_topic_limits(t.retention_messages, "tier.retention_messages"),
        compact_every=max(1, t.compact_every),
        filters=cfg.topic_filters(conf),
        delete_grace_s=t.delete_grace_s,
        driver_pid=os.getpid(),
    )


def source_options(conf: cfg.Config) -> dict:
    s = conf.source
    return {
        "path": conf.commitlog.dir,
        "broker": conf.broker.name,
        "maxRecordsPerTrigger": s.max_records_per_trigger or None,
        "maxBytesPerTrigger": s.max_bytes_per_trigger or None,
        "partitionBytes": s.partition_bytes,
        "startingOffset": s.starting_offset,
        "checkCrc": str(conf.commitlog.check_crc).lower(),
        "onCorrupt": conf.commitlog.on_corrupt,
        "keyProperty": conf.commitlog.key_property,
    }


def compaction_settings(conf: cfg.Config) -> CompactionSettings:
    c = conf.compaction
    return CompactionSettings(
        commitlog_dir=conf.commitlog.dir,
        checkpoint=checkpoint_path(conf, "compaction"),
        tier_location=conf.tier.location,
        broker=conf.broker.name,
        ttl=cfg.parse_ttl(c.ttl),
        snapshot_interval_s=c.snapshot_interval_s,
        snapshot_keep=max(1, c.snapshot_keep),
        on_corrupt=conf.commitlog.on_corrupt,
        driver_pid=os.getpid(),
        topics=cfg.topic_filters(conf)["compaction"],
    )


def kafka_settings(conf: cfg.Config) -> KafkaSettings | None:
    """The Kafka sinks' settings; None when ``kafka.bootstrap`` is empty (the sinks are off)."""
    k = conf.kafka
    if not k.bootstrap.strip():
        return None
    client = {"bootstrap_servers": cfg.bootstrap_servers(k.bootstrap),
              "client_id": k.client_id, "security_protocol": k.security_protocol}
    optional = {"sasl_mechanism": k.sasl_mechanism, "sasl_plain_username": k.sasl_username,
                "sasl_plain_password": k.sasl_password, "ssl_cafile": k.ssl_cafile, "ssl_certfile": k.ssl_certfile,
                "ssl_keyfile": k.ssl_keyfile}
    client.update({name: value for name, value in optional.items() if value})
    return KafkaSettings(
        client=client,
        broker=conf.broker.name,
        mirror_topic=k.mirror_topic,
        mirror_topic_map=parse_topic_map(k.mirror_topic_map, "kafka.mirror_topic_map"),
        changelog_topic=k.changelog_topic,
        changelog_topic_map=parse_topic_map(k.changelog_topic_map, "kafka.changelog_topic_map"),
        auto_create_topics=k.auto_create_topics,
        partitions=max(1, k.partitions),
        replication_factor=max(1, k.replication_factor),
        compression=k.compression,
        linger_ms=k.linger_ms,
        batch_bytes=k.batch_bytes,
        max_request_size=k.max_request_size,
        delivery_timeout_s=max(2.0 + k.linger_ms / 1000, k.delivery_timeout_s),
        on_too_large=k.on_too_large,
    )


def kafka_sinks(conf: cfg.Config) -> list[str]:
    """The Kafka sinks that run: ``mirror`` and ``changelog``, each when switched on (the changelog
    is fed by the compaction query, so it needs that too)."""
    if not conf.kafka.bootstrap.strip():
        return []
    changelog = conf.kafka.changelog and conf.compaction.enabled
    return (["mirror"] if conf.kafka.mirror else []) + (["changelog"] if changelog else [])


def enabled_sinks(conf: cfg.Config) -> list[str]:
    return ["tier"] + (["kv"] if conf.compaction.enabled else []) + kafka_sinks(conf)


# The query whose checkpoint replays what each sink was fed.
_SINK_QUERY = {"tier": "tiering", "kv": "compaction", "changelog": "compaction", "mirror": "mirror"}


def safepoint(conf: cfg.Config, sinks: dict[str, int]) -> int | None:
    """Below it, no sink needs the commitlog any more: the lowest offset every enabled sink has applied,
    and no lower than where each query's last committed batch ends.

    A sink records a batch before Spark commits it; after a crash Spark runs that batch again from
    the end of the last committed one, reading its bytes once more (the chaos harness found `gc`
    deleting them).  None until each sink has applied something and each query committed a batch,
    and for checkpoints outside the local file system, which this cannot read.
    """
    enabled = enabled_sinks(conf)
    if not all(n in sinks for n in enabled):
        return None
    points = [sinks[n] for n in enabled]
    for query in sorted({_SINK_QUERY[n] for n in enabled}):
        committed = _committed_end(checkpoint_path(conf, query))
        if committed is None:
            return None
        points.append(committed)
    return min(points)


def _committed_end(checkpoint: str) -> int | None:
    """Spark's last committed end in ``checkpoint``; None when unknown (no commit, or a checkpoint
    on a Hadoop file system and no Spark session in this process)."""
    from streaming.checkpoints import Checkpoint

    try:
        return Checkpoint(checkpoint).last_committed_end()
    except TierlogError:
        return None


def _state_memory(query) -> int | None:
    """Spark's estimate of its state stores' memory in ``query``'s last batch (``memoryUsedBytes``,
    summed over partitions); None before the first batch."""
    progress = query.lastProgress if query is not None else None
    if not progress:
        return None
    return sum(op["memoryUsedBytes"] for op in progress["stateOperators"])


def metadata_path(conf: cfg.Config) -> str:
    return os.path.join(conf.state.dir, "metadata")


def kv_path(conf: cfg.Config) -> str:
    return os.path.join(conf.state.dir, "kv")


def checkpoint_path(conf: cfg.Config, query: str) -> str:
    return os.path.join(conf.checkpoint.dir, query)


def session_conf(conf: cfg.Config) -> dict:
    from streaming.checkpoints import s3a_settings

    out = {
        "spark.sql.shuffle.partitions": str(conf.spark.shuffle_partitions),
        "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": str(conf.state.rocksdb_memory_mb),
    }
    if conf.spark.jars:
        out["spark.jars"] = conf.spark.jars
    if conf.checkpoint.dir.startswith("s3a://"):
        out.update(s3a_settings())
    return out


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
        self.metrics = Metrics(conf.broker.name)
        self._metadata = self._kv = None  # set while run() runs
        self._seen_progress: dict[str, str] = {}  # query -> timestamp of the progress last counted
        self._kafka_counts = {"sent": 0, "retries": 0}  # the changelog sink's, as last counted

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
        m = self.metrics
        m.batch_seconds.labels("tiering").observe(report.seconds)
        m.bytes_in.labels("tiering").inc(report.bytes)
        m.behind_messages.set(line["lag_msgs"])
        m.behind_seconds.set(line["lag_s"])
        m.seals.inc(report.seals)
        for kind, seconds in report.uploads or ():
            m.upload_seconds.labels(kind).observe(seconds)
            m.objects.labels(kind).inc()
        if not report.replay:
            m.objects.labels("commit_record").inc()

    def _on_compaction_batch(self, report: CompactionReport) -> None:
        line = {
            "query": "compaction", "batch": report.batch_id, "changes": report.changes, "applied": report.applied,
            "expired": report.expired, "source_end": report.source_end, "seconds": round(report.seconds, 3),
            "phases": report.phases,
        }
        if report.snapshot_rows is not None:
            line["snapshot_rows"] = report.snapshot_rows
        log.info("batch %s", json.dumps(line))
        self.metrics.batch_seconds.labels("compaction").observe(report.seconds)

    def _on_mirror_batch(self, report: MirrorReport) -> None:
        line = {"query": "mirror", "batch": report.batch_id, "sent": report.sent, "skipped": report.skipped,
                "mb": round(report.bytes / 1e6, 3), "source_end": report.source_end,
                "seconds": round(report.seconds, 3), "attempts": report.attempts}
        log.info("batch %s", json.dumps(line))
        m = self.metrics
        m.batch_seconds.labels("mirror").observe(report.seconds)
        m.bytes_in.labels("mirror").inc(report.bytes)
        m.kafka_sent.labels("mirror").inc(report.sent)
        m.kafka_errors.labels("mirror").inc(report.attempts - 1)
        if report.sent:
            m.kafka_rate.labels("mirror").set(report.sent / max(report.seconds, 1e-3))

    def _frontier(self, hint: int | None) -> int:
        """The commitlog's end, for the lag in the batch line; 0 when it cannot be read."""
        if self._log_reader is None:
            self._log_reader = CommitLogReader(self.conf.commitlog.dir, on_corrupt=self.conf.commitlog.on_corrupt)
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
        from streaming.checkpoints import location_problem

        problem = location_problem(conf)
        if problem:
            raise ConfigError(problem)
        settings = tiering_settings(conf)
        compaction = compaction_settings(conf) if conf.compaction.enabled else None
        metadata = self._metadata = MetadataStore(metadata_path(conf))
        self.metrics.serve(conf.metrics.host, conf.metrics.port)
        kv = self._kv = None
        self.sinks: dict[str, object] = {}
        try:
            if compaction is not None:
                kv = self._kv = KVView(kv_path(conf), ttl=compaction.ttl)
            if spark is None:
                from streaming.session import build_session

                spark = build_session("tierlog", conf.spark.master, session_conf(conf))
            wanted = kafka_sinks(conf)
            queries = ["tiering"] + (["compaction"] if kv is not None else []) + (["mirror"] if "mirror" in wanted else [])
            moved_from = self._check_commitlog(spark, queries)
            for name in queries:  # every checkpoint checked before anything starts
                check_or_record(spark, checkpoint_path(conf, name), name, guarded_settings(conf, name, spark),
                                movable=("commitlog.dir",) if moved_from else ())
            self.sink = TieringSink(settings, metadata, on_batch=self._on_batch)
            self.sinks["tiering"] = self.sink
            kafka = kafka_settings(conf)
            if kv is not None:
                changelog = None
                if "changelog" in wanted:
                    changelog = ChangelogSink(
                        kafka, should_stop=self.stopping.is_set, driver_pid=os.getpid(),
                        on_health=lambda h: metadata.record_health("changelog", h),
                        on_skip=lambda phy, why: metadata.record_skip("changelog", phy, why),
                    )
                sink = CompactionSink(compaction, kv, metadata, on_batch=self._on_compaction_batch,
                                      changelog=changelog, key_property=conf.commitlog.key_property)
                self.sinks["compaction"] = sink
                sink.catch_up()
            if "mirror" in wanted:
                self.sinks["mirror"] = MirrorQuery(
                    kafka, conf.commitlog.dir, checkpoint_path(conf, "mirror"), metadata,
                    key_property=conf.commitlog.key_property, check_crc=conf.commitlog.check_crc,
                    on_corrupt=conf.commitlog.on_corrupt, tasks=conf.kafka.mirror_tasks, should_stop=self.stopping.is_set,
                    on_batch=self._on_mirror_batch, driver_pid=os.getpid(), topics=cfg.topic_filters(conf)["mirror"],
                )
            code = self._run_queries(spark, until_caught_up)
            if code == 0:
                self.sink.flush()  # a clean stop leaves a root that covers every commit
            return code
        finally:
            for name, sink in self.sinks.items():
                if hasattr(sink, "close"):
                    try:
                        sink.close()
                    except Exception as exc:  # noqa: BLE001 - do not hide the error already on its way out
                        log.error("closing the %s sink failed: %s", name, exc)
            if kv is not None:
                kv.close()
            metadata.close()
            self.metrics.close()
            if self._log_reader is not None:
                self._log_reader.close()

    def _check_commitlog(self, spark, queries: list[str]) -> str | None:
        """Check ``commitlog.dir`` holds the tier's last committed record (``streaming.failover``);
        the directory the checkpoints were made on when it is another one (a replica took over)."""
        from connectors.tier.backend import open_backend
        from connectors.tier.log import TierLog
        from streaming.checkpoints import Checkpoint, recorded_settings
        from streaming.failover import check_commitlog

        conf = self.conf
        here = os.path.abspath(conf.commitlog.dir)
        recorded = [recorded_settings(spark, checkpoint_path(conf, q)) for q in queries]
        before = {r.get("commitlog.dir") for r in recorded}
        moved_from = next((d for d in sorted(before - {None}) if d != here), None)
        if moved_from and any(r.get("broker.name", conf.broker.name) != conf.broker.name for r in recorded):
            return None  # the broker changed too: check_or_record refuses, naming broker.name
        backend = open_backend(conf.tier.location)
        try:
            last = TierLog(backend, conf.broker.name).view().last_record
        finally:
            backend.close()
        committed = {q: Checkpoint(checkpoint_path(conf, q), spark).last_committed_end() for q in queries}
        check_commitlog(conf.commitlog.dir, conf.broker.name, last, committed, moved_from, conf.commitlog.on_corrupt)
        return moved_from

    def _writer(self, spark, name: str, until_caught_up: bool):
        conf = self.conf
        sink = self.sinks[name]

        def process(df, batch_id):
            with self._admitted(sink):
                sink.process(df, batch_id)

        if name in ("tiering", "mirror"):
            stream = refs_stream(spark, source_options(conf))
        else:
            stream = compaction_stream(spark, {**source_options(conf),
                                               "topics": cfg.topic_filters(conf)["compaction"].to_json()})
        writer = (
            stream.writeStream.queryName(name)
            .foreachBatch(process)
            .option("checkpointLocation", checkpoint_path(conf, name))
        )
        if name == "compaction":
            writer = writer.outputMode("update")
        if until_caught_up:
            return writer.trigger(availableNow=True)
        return writer.trigger(processingTime=f"{int(conf.spark.trigger_interval_s * 1000)} milliseconds")

    @contextmanager
    def _admitted(self, sink):
        """Hold ``sink.lock`` for one batch; raise ``StopRequested`` instead once the service is stopping.

        The stop path holds every sink's lock while Spark stops the queries, and Spark's stop waits
        for the batch it is running.  A batch that blocked on the lock there would never return, so
        a batch waits for the lock only while no stop has begun (the lock is reentrant: the sink
        takes it again inside)."""
        while not sink.lock.acquire(timeout=0.1):
            if self.stopping.is_set():
                raise StopRequested("stop requested before this batch started")
        try:
            if self.stopping.is_set():
                raise StopRequested("stop requested before this batch started")
            yield
        finally:
            sink.lock.release()

    def _run_queries(self, spark, until_caught_up: bool) -> int:
        conf = self.conf
        queries = {name: self._writer(spark, name, until_caught_up).start() for name in self.sinks}
        self._install_signals()
        log.info("%s: %s -> %s (%s)", " + ".join(queries), conf.commitlog.dir, conf.tier.location,
                 "until caught up" if until_caught_up else "until stopped")
        compaction = self.sinks.get("compaction")
        next_sweep = time.monotonic()
        while not self.stopping.is_set():
            active = [q for q in queries.values() if q.isActive]
            if not active or any(q.exception() is not None for q in queries.values()):
                break
            try:
                active[0].awaitTermination(0.5)
            except Exception:  # noqa: BLE001 - a query failed; _outcome says why
                break
            if time.monotonic() >= next_sweep:
                if compaction is not None:
                    compaction.sweep()  # a quiet stream runs no batches, but keys still expire
                self._poll_metrics(queries)
                next_sweep = time.monotonic() + max(1.0, conf.spark.trigger_interval_s)
        failed = any(q.exception() is not None for q in queries.values() if not q.isActive)
        if failed:
            self.stopping.set()  # the other queries stop too: no new batch, Kafka waits end
        if self.stopping.is_set() and any(q.isActive for q in queries.values()):
            locks = [sink.lock for sink in self.sinks.values()]
            for lock in locks:  # the batches in flight, if any, finish and commit first
                lock.acquire()
            try:
                for q in queries.values():
                    q.stop()
            finally:
                for lock in locks:
                    lock.release()
        compaction = self.sinks.get("compaction")
        if compaction is not None:
            try:
                compaction.flush()  # the last batch's view update, on the apply thread
            except TierlogError as exc:
                raise TierlogError(f"the compaction query failed: {exc}") from None
        self._poll_metrics(queries)
        return self._outcome(queries)

    def _poll_metrics(self, queries: dict) -> None:
        """What no batch report carries: input rows and state rows from Spark's progress, the
        changelog sink's counters, and the safepoint."""
        m = self.metrics
        for name, query in queries.items():
            for progress in query.recentProgress:  # the last ~100, oldest first
                if progress.timestamp <= self._seen_progress.get(name, ""):
                    continue  # counted already (ISO timestamps of one run sort as strings)
                self._seen_progress[name] = progress.timestamp
                m.rows_in.labels(name).inc(progress.numInputRows)
        if self._kv is not None:  # Spark's own row count is off: tracking it costs a read per write
            m.state_rows.labels("kv").set(self._kv.estimated_keys())
            m.state_memory.labels("kv").set(self._kv.memory_bytes())
        m.state_memory.labels("metadata").set(self._metadata.memory_bytes())
        spark_state = _state_memory(queries.get("compaction"))
        if spark_state is not None:
            m.state_memory.labels("spark").set(spark_state)
        changelog = getattr(self.sinks.get("compaction"), "changelog", None)
        if changelog is not None:
            stats = changelog.stats
            m.kafka_sent.labels("changelog").inc(stats.sent - self._kafka_counts["sent"])
            m.kafka_errors.labels("changelog").inc(stats.retries - self._kafka_counts["retries"])
            self._kafka_counts = {"sent": stats.sent, "retries": stats.retries}
        point = safepoint(self.conf, self._metadata.sinks())
        m.safepoint.set(-1 if point is None else point)

    def _outcome(self, queries: dict) -> int:
        for name, query in queries.items():
            exc = query.exception()
            if exc is None:
                continue
            text = str(exc)
            if "StopRequested" in text and self.stopping.is_set():
                continue
            raise TierlogError(f"the {name} query failed: {_root_cause(text)}")
        log.info("stopped: %d tiering batches, %d messages, %.1f MB", self.progress.batches,
                 self.progress.rows, self.progress.bytes / 1e6)
        return 0

    def _install_signals(self) -> None:
        def handler(signum, _frame):
            log.info("received %s: finishing the batch in flight, then stopping", signal.Signals(signum).name)
            self.stopping.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)


_OUR_ERRORS = ("CorruptRecordError", "KVError", "OffsetLogError", "SkippedMessagesError", "LogLayoutError", "OffsetOutOfRangeError",
               "BucketNotFound", "AccessDenied", "TransientTierError", "TierError", "TierlogError",
               "ConfigError", "MetadataError", "TierLogError", "TierLayoutError", "TopicNameError")


_OUR_TRACEBACK_LINE = re.compile(r"^(?:connectors|streaming|state)\.[\w.]+\.\w+: (.*)$")


def _root_cause(text: str) -> str:
    """The line of a Spark/Python traceback that carries tierlog's own error, else the first line."""
    for line in text.splitlines():
        stripped = line.strip()
        ours = _OUR_TRACEBACK_LINE.match(stripped)  # any error class of tierlog's own packages
        if ours:
            return ours.group(1)
        for name in _OUR_ERRORS:
            if stripped.startswith(f"{name}: "):
                return stripped.split(": ", 1)[1]
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
