"""``tierlog run``: the runner of the streaming queries.

It opens the metadata store (which also keeps a second service off the same
state) and the KV view, builds the queries the plan names
(``streaming.plan.QUERIES``: tiering; compaction unless ``compaction.enabled``
is off; the Kafka mirror when ``kafka.bootstrap`` is set), checks every
checkpoint and the commitlog before any starts, and runs them in one Spark
application.  It knows a query only through ``streaming.queries.base.Query``.
It stops gracefully on SIGTERM or SIGINT: the batches in flight finish and
are committed, and no new one starts.  When one query fails, the others stop
the same way and the failure is raised; except that a query Spark could not start
because its Python worker was late is started again, with backoff (``streaming.runtime.late_start``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import tempfile
import threading
import time
from contextlib import contextmanager

from connectors.commitlog.reader import directory_problem
from connectors.errors import ConfigError, StopRequested, TierlogError
from connectors.faults import DRIVER_PID, late_worker_fault
from connectors.stopping import STOP_FILE, clear_stop, request_stop
from connectors.sinks import KV
from state.kv import KVView
from state.kv_writer import retained_topics, take_inline_where_retained
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming import plan
from streaming.runtime.checkpoints import Checkpoint, check_before_start, check_or_record, foreach_batch
from streaming.runtime.follower import Follower
from streaming.runtime.metrics import Metrics
from streaming.queries.base import Query, RunContext
from streaming.runtime.late_start import LateStarts
from streaming.settings import derive

log = logging.getLogger("tierlog.service")


def _recent_progress(stream, count: int) -> list:
    """The newest ``count`` of the progress reports Spark keeps for ``stream``, oldest first.

    Why not ``recentProgress``: it parses all Spark keeps (100), two py4j calls each, and at a short
    trigger it was read at every tick: most of the runner's thread, on a driver whose mirror,
    tiering and KV threads share one interpreter."""
    from pyspark.sql.streaming.listener import StreamingQueryProgress

    kept = stream._jsq.recentProgress()
    size = len(kept)
    return [StreamingQueryProgress.fromJson(json.loads(kept[i].json())) for i in range(max(0, size - count), size)]


def _state_memory(progress) -> int | None:
    """Spark's estimate of its state stores' memory in a query's last batch (``memoryUsedBytes``,
    summed over partitions), from its ``lastProgress``; None before the first batch or without state."""
    if not progress or not progress["stateOperators"]:
        return None
    return sum(op["memoryUsedBytes"] for op in progress["stateOperators"])


class Service:
    def __init__(self, conf: cfg.Config):
        self.settings = derive(conf)  # every setting parsed, and refused, before anything opens
        self.stopping = threading.Event()
        self.metrics = Metrics(self.settings.broker, [q.name for q in plan.QUERIES])
        self.queries: dict[str, Query] = {}  # name -> query, while run() runs and after
        self.batches: dict[str, int] = {}  # name -> batches processed
        self._last_batch: dict[str, int] = {}  # name -> the id of the last batch its handler processed
        self._metadata = None  # set while run() runs
        self._seen_progress: dict[str, tuple[str, int]] = {}  # query -> (timestamp, batch) of the progress last counted
        self._entered: set[str] = set()  # queries whose batch function has run, in this run
        self._ctx: RunContext | None = None  # what the queries were built with, while run() runs
        self._headroom_warned = float("-inf")  # when the last low-headroom warning was logged
        # Kept open across ticks: it remembers the frontier it reached, so each tick walks only what
        # was appended since.  A reader opened afresh walked the active file from its start every
        # second, a cost that grew with the file.
        self._log_reader = None
        self._followers: dict[str, Follower] = {}  # the queries without a Spark stream, while they run
        self.late = LateStarts(self.settings.spark.late_start_s, self._late_start)

    # ------------------------------------------------------------ running

    def run(self, until_caught_up: bool = False, spark=None) -> int:
        settings = self.settings
        paths = settings.paths
        problem = directory_problem(paths.commitlog)
        if problem is not None and problem[0] != "empty":
            raise ConfigError(problem[1])
        if problem is not None:  # a broker may not have written yet: the service waits for it
            log.warning("%s%s", problem[1], "; there is nothing to tier" if until_caught_up else
                        "; waiting for the first to appear")
        from streaming.runtime.checkpoints import location_problem

        problem = location_problem(settings.spark.jars, paths.checkpoints)
        if problem:
            raise ConfigError(problem)
        kinds = plan.queries(settings)
        for q in kinds:  # a checkpoint made with other settings is refused before anything opens
            if q.spark_stream:  # the commitlog may have moved (a replica): checked once the session runs
                check_before_start(paths.checkpoint(q.name), q.name, q.guarded_settings(settings, None),
                                   movable=("commitlog.dir",))
        metadata = self._metadata = MetadataStore(paths.metadata)
        gone = metadata.feed.keep_only(plan.tier_consumers(settings))
        if gone:
            log.info("the tier stops keeping its committed batches for %s (off in this configuration)", ", ".join(gone))
        self.metrics.serve(settings.metrics_host, settings.metrics_port)
        kv = None
        self.queries = {}
        owned = None  # the session this run built, stopped before it returns
        own_jvm = False  # and the JVM it started, ended before it returns
        try:
            if any(KV in q.sinks(settings) for q in kinds):
                kv = KVView(paths.kv, ttl=settings.ttl, tier=paths.tier, broker=settings.broker)
            elif retained_topics(metadata.journal.references(), settings.retention):
                self._release_retention_holds(metadata)
            if spark is None:
                from streaming.runtime.session import build_session, jvm_running

                # Spark's Python workers inherit it from the JVM this session starts: a crash point
                # (connectors.faults) in a task kills this process, as a real crash would.  Only
                # here, where this process owns the session: a caller's session (the tests') was
                # started without it, and a process that runs a service in-process must not hand it
                # on to the processes it starts later.
                os.environ[DRIVER_PID] = str(os.getpid())
                os.environ[STOP_FILE] = os.path.join(tempfile.gettempdir(), f"tierlog-stop-{os.getpid()}")
                clear_stop()  # one an earlier process of this pid left, before any batch can retry
                own_jvm = not jvm_running()
                spark = owned = build_session("tierlog", settings.spark.master, plan.session_conf(settings),
                                              c1_only=settings.spark.jit_c1_only,
                                              huge_pages=settings.spark.transparent_huge_pages)
            streamed = [q for q in kinds if q.spark_stream]  # the others keep no checkpoint
            committed = {q.name: Checkpoint(paths.checkpoint(q.name), spark).last_committed_end() for q in streamed}
            moved_from = self._check_commitlog(spark, {q.name: committed[q.name] for q in kinds if q.reads_commitlog})
            for q in streamed:  # every checkpoint checked before anything starts
                check_or_record(spark, paths.checkpoint(q.name), q.name, q.guarded_settings(settings, spark),
                                movable=("commitlog.dir",) if moved_from else ())
            ctx = RunContext(settings=settings, metadata=metadata, kv=kv, metrics=self.metrics,
                             should_stop=self.stopping.is_set, until_caught_up=until_caught_up,
                             compaction_nice=settings.compaction.nice if own_jvm else 0)
            self._ctx = ctx
            for kind in kinds:
                query = self.queries[kind.name] = kind(ctx)
                query.start(committed.get(kind.name))
            return self._run_queries(spark, until_caught_up)
        finally:
            for name, query in reversed(self.queries.items()):
                try:
                    query.close()
                except Exception as exc:  # noqa: BLE001 - do not hide the error already on its way out
                    log.error("closing the %s query failed: %s", name, exc)
            if kv is not None:
                kv.close()
            self._close_log_reader()
            metadata.close()
            self.metrics.close()
            if owned is not None:
                clear_stop()  # the stop file, if a stop made one
                # Stopped here, not left to the interpreter's exit: Spark closes its state stores'
                # RocksDB instances first, where an exit that tore down the JVM under a maintenance
                # thread still asking RocksDB for a property crashed it (SIGSEGV in librocksdbjni's
                # GetPropertyInfo, an hs_err_pid file left behind).
                try:
                    owned.stop()
                except Exception as exc:  # noqa: BLE001 - do not hide the error already on its way out
                    log.debug("stopping the Spark session failed: %s", exc)
                if own_jvm:
                    self._end_jvm()

    def _release_retention_holds(self, metadata: MetadataStore) -> None:
        """With compaction off, no query's start takes in the values the KV view keeps in the tier of
        a topic given a tier retention since: this start does, so that retention applies (the tier
        keeps those topics' segments until then, ``TierWriter``'s warning).  Called only when the
        journal lists such a topic: a start with nothing to take in opens no view."""
        s = self.settings
        with KVView(s.paths.kv, tier=s.paths.tier, broker=s.broker) as kv:
            take_inline_where_retained(kv, metadata.journal, self.settings.retention)

    def _check_commitlog(self, spark, committed: dict[str, int | None]) -> str | None:
        """Check ``commitlog.dir`` holds the tier's last committed record and reaches ``committed``
        (query -> where its last committed batch ends; ``streaming.runtime.failover``); the directory the
        checkpoints were made on when it is another one (a replica took over)."""
        from connectors.tier.location import open_backend
        from connectors.tier.log import TierLog
        from streaming.runtime.checkpoints import recorded_settings
        from streaming.runtime.failover import check_commitlog

        s = self.settings
        here = os.path.abspath(s.paths.commitlog)
        recorded = [recorded_settings(spark, s.paths.checkpoint(q)) for q in committed]
        before = {r.get("commitlog.dir") for r in recorded}
        moved_from = next((d for d in sorted(before - {None}) if d != here), None)
        if moved_from and any(r.get("broker.name", s.broker) != s.broker for r in recorded):
            return None  # the broker changed too: check_or_record refuses, naming broker.name
        backend = open_backend(s.paths.tier)
        try:
            last = TierLog(backend, s.broker).committed().last_record
        finally:
            backend.close()
        check_commitlog(self.settings.reader, last, committed, moved_from)
        return moved_from

    def _writer(self, spark, query: Query, until_caught_up: bool):
        checkpoint = self.settings.paths.checkpoint(query.name)

        def process(batch):
            self._ran(query)
            with self._admitted(query):
                query.process(batch)
                self.batches[query.name] = self.batches.get(query.name, 0) + 1
                self._last_batch[query.name] = batch.batch_id
            if query.reads_commitlog:
                for follower in self._followers.values():
                    follower.wake()  # the tier committed a batch: send it now, not on a clock

        writer = (
            query.stream(spark).writeStream.queryName(query.name)
            .foreachBatch(foreach_batch(checkpoint, process))
            .option("checkpointLocation", checkpoint)
            .outputMode(query.output_mode)
        )
        if until_caught_up and query.reads_commitlog:
            return writer.trigger(availableNow=True)
        return writer.trigger(processingTime=f"{int(self.settings.spark.trigger_interval_s * 1000)} milliseconds")

    def _ran(self, query: Query) -> None:
        if query.name not in self._entered:
            self._entered.add(query.name)
            self.late.ran(query.name)
        late_worker_fault(query.name)

    def _step(self, spark, query: Query) -> bool:
        """One step of a query without a Spark stream, on its follower's thread; whether it applied
        a batch (then its follower steps again at once)."""
        self._ran(query)
        with self._admitted(query):
            if query.step(spark):
                self.batches[query.name] = self.batches.get(query.name, 0) + 1
                return True
        return False

    @contextmanager
    def _admitted(self, query: Query):
        """Hold ``query.lock`` for one batch; raise ``StopRequested`` instead once the service is stopping.

        The stop path holds every query's lock while Spark stops the queries, and Spark's stop waits
        for the batch it is running.  A batch that blocked on the lock there would never return, so
        a batch waits for the lock only while no stop has begun (the lock is reentrant: the query
        takes it again inside)."""
        while not query.lock.acquire(timeout=0.1):
            if self.stopping.is_set():
                raise StopRequested("stop requested before this batch started")
        try:
            if self.stopping.is_set():
                raise StopRequested("stop requested before this batch started")
            yield
        finally:
            query.lock.release()

    @staticmethod
    def _end_jvm() -> None:
        """The JVM this run started has exited before the run returns (``streaming.runtime.session.end_jvm``)."""
        from streaming.runtime.session import end_jvm

        status = end_jvm()
        if status is None:
            log.debug("Spark's JVM had not exited within a minute of its session's stop: it ends with this process")
        elif status != 0:
            log.warning("Spark's JVM ended with %s after its session had stopped (what it printed above says "
                        "where): nothing of the run depended on it any more",
                        f"signal {-status}" if status < 0 else f"exit code {status}")

    def _run_queries(self, spark, until_caught_up: bool) -> int:
        s = self.settings
        # Under --until-caught-up, a query that consumes the tier (it cannot know where the tier will
        # end) runs on its trigger beside the others, and is stopped once they are done and it has
        # applied all the tier committed.
        followers = [n for n, q in self.queries.items() if until_caught_up and not q.reads_commitlog]
        streams = {name: self._start(spark, q, until_caught_up) for name, q in self.queries.items()}
        self._install_signals()
        log.info("%s: %s -> %s (%s)", " + ".join(streams), s.paths.commitlog, s.paths.tier,
                 "until caught up" if until_caught_up else "until stopped")
        next_tick, waiting = time.monotonic(), set()
        while not self.stopping.is_set():
            for name in self.late.due():
                streams[name] = self._restart(spark, name, until_caught_up)
            waiting = self.late.waiting()
            failed = [n for n, s in streams.items() if n not in waiting and s.exception() is not None
                      and not self.late.failed(n, str(s.exception()))]
            waiting = self.late.waiting()
            active = [s for n, s in streams.items() if s.isActive and n not in waiting]
            if followers and not failed and self._followers_done(spark, streams, followers):
                self._stop([streams[n] for n in followers])
                followers = []
                continue
            if failed or not (active or waiting):
                break
            try:
                active[0].awaitTermination(0.5) if active else time.sleep(0.5)
            except Exception:  # noqa: BLE001 - a query failed: started again if it was late, else it ends the run
                continue
            if time.monotonic() >= next_tick:
                self._tick(streams)
                next_tick = time.monotonic() + max(1.0, s.spark.trigger_interval_s)
        if any(s.exception() is not None for n, s in streams.items() if not s.isActive and n not in waiting):
            self.stopping.set()  # the other queries stop too: no new batch, Kafka waits end
        if self.stopping.is_set() and any(s.isActive for s in streams.values()):
            self._stop(list(streams.values()))
        failure = self._failure(streams)
        if failure is None:  # after a failure, close() alone releases what each query holds
            for name, query in self.queries.items():
                try:
                    query.flush()
                except TierlogError as exc:
                    failure = failure or TierlogError(f"the {name} query failed: {exc}")
        self._tick(streams, work=False)
        if failure is not None:
            raise failure
        return 0

    def _restart(self, spark, name: str, until_caught_up: bool):
        """Start query ``name`` again after its Python worker was late (``streaming.runtime.late_start``).
        One that ran batches may have failed inside one, with what it holds in memory half a batch
        on: it is closed and built afresh, and resumes from its checkpoint and its sinks' records
        as a new process would; the batch that failed runs again, as after a crash."""
        old = self.queries[name]
        if name in self._entered:
            log.info("the %s query starts again from its checkpoint and its sinks' records", name)
            old.close()
            query = self.queries[name] = type(old)(self._ctx)
            query.start(Checkpoint(self.settings.paths.checkpoint(name), spark).last_committed_end()
                        if query.spark_stream else None)
            self._entered.discard(name)  # its next batch ends the wait (LateStarts.ran)
        return self._start(spark, self.queries[name], until_caught_up)

    def _start(self, spark, query: Query, until_caught_up: bool):
        if not query.spark_stream:
            follower = Follower(query.name, lambda: self._step(spark, query), self.settings.spark.trigger_interval_s)
            self._followers[query.name] = follower
            return follower.start()
        return self._writer(spark, query, until_caught_up).start()

    def _stop(self, streams: list) -> None:
        """Stop ``streams`` once the batches in flight, if any, have finished and committed."""
        for s in streams:
            if isinstance(s, Follower):
                s.stop()  # first, and without the locks: it waits for its step, which takes one
        locks = [q.lock for q in self.queries.values()]
        for lock in locks:
            lock.acquire()
        try:
            for s in streams:
                s.stop()
        finally:
            for lock in locks:
                lock.release()

    def _followers_done(self, spark, streams: dict, followers: list[str]) -> bool:
        """Under --until-caught-up: the commitlog's readers have stopped, and each query over the
        tier has applied everything the tier committed, and Spark has committed its last batch.

        Spark writes a batch's commit after its foreachBatch returned: a stop in between leaves
        Spark's state a batch behind the KV view until the next start runs that batch again (CI met
        it: Spark's state lacked the last batch's keys right after a run that had returned 0)."""
        if any(s.isActive for n, s in streams.items() if n not in followers):
            return False
        if not all(self.queries[n].caught_up() for n in followers):
            return False
        for name in followers:
            last = self._last_batch.get(name)
            if last is not None and str(last) not in Checkpoint(self.settings.paths.checkpoint(name), spark).list("commits"):
                return False
        return True

    def _late_start(self, name: str, text: str | None) -> None:
        """A query waits to be started again (``text`` says why), or it ran a batch (None): its
        sinks' health in the metadata store (``status``), and the metric."""
        if text is not None:
            self.metrics.late_starts.labels(name).inc()
        for sink in self.queries[name].sinks(self.settings):
            self._metadata.journal.record_health(sink, None if text is None else
                                         {"state": "starting", "since": time.time(), "error": text})

    def _tick(self, streams: dict, work: bool = True) -> None:
        """Each query's ``tick`` (unless ``work`` is off) and ``poll_metrics``, then what no batch
        report carries: input rows and Spark's state memory from each query's progress, and the
        safepoint."""
        m = self.metrics
        spark_state = None
        for name, stream in streams.items():
            if work:
                self.queries[name].tick()
            self.queries[name].poll_metrics()
            last = stream.lastProgress
            for progress in self._new_progress(name, stream, last):
                # Spark's own steps of the batch (planning, its offset and commit logs, the batch
                # itself): what the batch line's seconds leave out, and what found a stall outside it.
                log.debug("%s batch %d: Spark's milliseconds per step %s", name, progress.batchId,
                          json.dumps(progress.durationMs, sort_keys=True))
                m.rows_in.labels(name).inc(progress.numInputRows)
            memory = _state_memory(last)
            if memory is not None:
                spark_state = (spark_state or 0) + memory
        if spark_state is not None:
            m.state_memory.labels("spark").set(spark_state)
        m.state_memory.labels("metadata").set(self._metadata.memory_bytes())
        sinks = self._metadata.journal.sinks()
        point = plan.safepoint(self.settings, sinks)
        m.safepoint.set(-1 if point is None else point)
        for sink, applied in sinks.items():
            if applied is not None:
                m.sink_applied.labels(sink).set(applied)
        tiering = self.queries.get("tiering")
        end = tiering.known_end() if tiering is not None else None
        if end is not None:
            m.commitlog_end.set(end)
        m.quarantined.set(len(self._metadata.quarantined()))
        self._watch_retention(point)

    def _watch_retention(self, needed: int | None) -> None:
        """The commitlog's headroom (``connectors.commitlog.headroom``) as metrics, a warning at most every
        5 minutes while it is low, and the gaps not acknowledged yet."""
        from connectors.commitlog.headroom import headroom
        from state import gaps

        s = self.settings
        self.metrics.gaps.set(len(gaps.unacknowledged(s.paths.state, self._metadata.quarantined())))
        if needed is None:
            return
        try:
            if self._log_reader is None:
                self._log_reader = self.settings.reader.open(check_crc=False, on_missing="fail")
            # The end the tiering query walked to for its last batch: a second walk of every header
            # here cost the driver a walk a message (docs/benchmarks.md, "Walked once").
            tiering = self.queries.get("tiering")
            room = headroom(self._log_reader, needed, end=tiering.known_end() if tiering is not None else None)
        except TierlogError as exc:
            log.debug("the commitlog's headroom could not be read: %s", exc)
            self._close_log_reader()  # the next tick starts afresh
            return
        if room is None:
            return
        self.metrics.headroom_bytes.set(room.bytes)
        if room.seconds is not None:
            self.metrics.headroom_seconds.set(room.seconds)
        if room.below(s.headroom_warn_fraction, s.headroom_warn_s) and time.monotonic() - self._headroom_warned > 300:
            self._headroom_warned = time.monotonic()
            log.warning(room.warning())

    def _close_log_reader(self) -> None:
        if self._log_reader is not None:
            self._log_reader.close()
            self._log_reader = None

    def _new_progress(self, name: str, stream, last) -> list:
        """The query's progress reports not counted yet, oldest first.  Usually the last one alone;
        when more than one batch ran since the last tick, the newest few of what Spark keeps (see
        ``_recent_progress``), more until the oldest read was counted already."""
        seen_ts, seen_batch = self._seen_progress.get(name, ("", -1))
        if last is None or last.timestamp <= seen_ts:  # ISO timestamps of one run sort as strings
            return []
        if last.batchId > seen_batch + 1:
            count = last.batchId - seen_batch + 2  # and a no-data trigger's report or two
            recent = _recent_progress(stream, count)
            while len(recent) == count and recent[0].timestamp > seen_ts:
                count *= 2
                recent = _recent_progress(stream, count)
            reports = [p for p in recent if p.timestamp > seen_ts] or [last]
        else:
            reports = [last]
        self._seen_progress[name] = (reports[-1].timestamp, reports[-1].batchId)
        return reports

    def _failure(self, streams: dict) -> TierlogError | None:
        """The first query's failure, as tierlog's own error; None when none failed (a stop the
        service asked for is no failure)."""
        for name, why in self.late.gave_up.items():
            return TierlogError(why)
        for name, stream in streams.items():
            exc = stream.exception()
            if exc is None or name in self.late.waiting():
                continue
            text = str(exc)
            if "StopRequested" in text and self.stopping.is_set():
                continue
            log.debug("the %s query failed: %s", name, text)  # Spark's and Python's traces, for --log-level DEBUG
            message, kind = _root_cause(text)
            failure = TierlogError(f"the {name} query failed: {message}")
            failure.exit_code, failure.retriable = kind.exit_code, kind.retriable  # the kind, for the exit code
            return failure
        return None

    def _install_signals(self) -> None:
        clear_stop()  # a stop an earlier service of this process was asked for is not this one's

        def handler(signum, _frame):
            log.info("received %s: finishing the batch in flight, then stopping", signal.Signals(signum).name)
            self.stopping.set()
            request_stop()  # a batch retrying a full disk or an away store gives up, to be redone

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)


_OUR_TRACEBACK_LINE = re.compile(r"^(?:connectors|streaming|state)\.[\w.]+\.(\w+): (.*)$")


def _our_errors() -> dict[str, type[TierlogError]]:
    """tierlog's error classes by name: ``TierlogError`` and everything under it (loaded)."""
    found, todo = {}, [TierlogError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def _root_cause(text: str) -> tuple[str, type[TierlogError]]:
    """The line of a Spark/Python traceback that carries tierlog's own error, and that error's class
    (``TierlogError`` when it is not one of ours); else the first line."""
    ours = _our_errors()
    for line in text.splitlines():
        stripped = line.strip()
        qualified = _OUR_TRACEBACK_LINE.match(stripped)  # any error class of tierlog's own packages
        if qualified:
            return qualified.group(2), ours.get(qualified.group(1), TierlogError)
        name, sep, message = stripped.partition(": ")
        if sep and name in ours:  # a bare class name, as some of Spark's wrappers print it
            return message, ours[name]
    lines = text.strip().splitlines()
    if not lines:
        return "unknown error", TierlogError
    head, trace, _ = lines[0].partition("Traceback (most recent call last):")
    if trace:  # Spark's line ends where Python's trace starts: name the exception it ends with instead
        raised = next((ln.strip() for ln in lines[1:] if _PYTHON_EXCEPTION_LINE.match(ln)), None)
        if raised:
            return f"{head}{raised}", TierlogError
    return lines[0], TierlogError


_PYTHON_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt|Warning)(: .*)?$")
