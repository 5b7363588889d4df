"""The chaos harness: the whole service under a seeded schedule of faults, then every invariant checked.

One run:

1. starts a real S3 server (moto, a process of its own) behind a faulty proxy
   (:mod:`tests.chaos.s3proxy`), Apache Kafka behind a TCP proxy that can cut it off
   (:mod:`tests.chaos.tcpproxy`), a producer process appending at ``rate``
   messages/s, and ``tierlog run`` (tiering, compaction, both Kafka sinks) as
   a process of its own;
2. injects the faults of :func:`schedule` (the seed makes it the same every
   time), samples the metadata store meanwhile (commit offsets only move
   forward, the safepoint only grows, ``commitlog gc`` never deletes above it)
   and restarts what a fault killed;
3. heals everything, stops the producer, waits until every sink has reached
   the end of the commitlog, stops the service with SIGTERM;
4. compares the tier, the metadata, the KV view and both Kafka topics with a
   plain replay of the commitlog (hard links keep the files ``gc`` deleted).

The seed fixes the fault schedule and the messages; the exact moments the
processes reach are up to the machine, so a failure names the seed and the
fault log to replay it with.

It is longer than most modules because the fault schedule, the processes it
restarts and the checks it runs share one timeline: a check needs to know which
faults happened before it.
"""

from __future__ import annotations

import dataclasses
import heapq
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import numpy as np

from connectors.commitlog.reader import CommitLogReader, list_files
from connectors.errors import TierlogError
from connectors.kafka.embedded import free_port
from streaming import config as cfg
from tests.chaos import digests
from tests.chaos.producer import BATCHES_PER_S
from tests.chaos.s3proxy import S3FaultProxy
from tests.chaos.tcpproxy import proxied_broker
from tests.cli_runner import ROOT, cli_command, cli_env, write_config

TOPICS = ["t0", "t1", "t2"]
S3_MODES = {"s3_errors": "errors", "s3_throttle": "throttle", "s3_timeouts": "timeouts", "s3_down": "down"}
S3_FAULTS = tuple(S3_MODES)
PROCESS_FAULTS = ("kill_service", "kill_producer", "tear_producer")
OTHER_FAULTS = ("kafka_down", "clock_skew")
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
         "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class Plan:
    """What one run does.  ``faults`` is how many the schedule injects, ``gap_s`` the pause before each."""

    seed: int = 1
    tier: str = "s3"  # or "posix" (which gets disk_full instead of the S3 faults)
    faults: int = 20
    gap_s: tuple[float, float] = (6.0, 12.0)
    outage_s: float = 15.0  # how long the S3 endpoint or the broker stays down
    rate: int = 300  # messages per second the producer appends
    body_size: int = 200
    keys: int = 2000
    file_size: int = 4 << 20  # small commitlog files, so gc has something to delete
    min_duration_s: float = 0.0  # keep scheduling faults until this long (the soak), even past ``faults``
    settle_timeout_s: float = 600.0
    skip: tuple[str, ...] = ()  # fault kinds left out, e.g. kill_service to watch one service process's memory
    rocksdb_memory_mb: int | None = None  # state.rocksdb_memory_mb; None: the service's default

    def kinds(self) -> tuple[str, ...]:
        storage = S3_FAULTS if self.tier == "s3" else ("disk_full",)
        return tuple(k for k in PROCESS_FAULTS + OTHER_FAULTS + storage if k not in self.skip)


@dataclass(frozen=True, order=True)
class Fault:
    at: float  # seconds after the faults start
    kind: str
    duration: float = 0.0
    arg: float = 0.0  # error share, skew in ms, or the batch a torn producer dies in


def schedule(plan: Plan) -> list[Fault]:
    """``plan.faults`` faults, each kind at most once at a time, from ``plan.seed`` alone.

    The S3 kinds share one proxy, so one S3 fault at a time: a throttle that began 5 s into an
    outage used to end it early, and CI met an outage that no S3 call saw."""
    rng = random.Random(plan.seed)
    kinds = plan.kinds()
    busy_until: dict[str, float] = {}

    def resource(kind: str) -> str:
        return "s3" if kind in S3_MODES else kind

    out, t = [], 0.0
    while len(out) < plan.faults or t < plan.min_duration_s:
        t += rng.uniform(*plan.gap_s)
        free = [k for k in kinds if busy_until.get(resource(k), 0) <= t]
        kind = rng.choice(free)
        # Each kind turns up once before any turns up twice, so even a short run covers them all.
        unused = [k for k in free if k not in {f.kind for f in out}]
        if unused:
            kind = rng.choice(unused)
        duration, arg = 0.0, 0.0
        if kind in ("s3_down", "kafka_down"):
            duration = plan.outage_s
        elif kind in ("s3_errors", "s3_throttle", "disk_full", "clock_skew"):
            duration = rng.uniform(5, 15)
            arg = rng.uniform(0.2, 0.6)
            if kind == "clock_skew":
                arg = rng.choice([-1, 1]) * rng.uniform(3600e3, 2 * 86400e3)  # hours to days, either way
        elif kind == "s3_timeouts":
            duration, arg = rng.uniform(5, 10), 0.05
        elif kind == "tear_producer":
            arg = rng.randint(1, 20)
        busy_until[resource(kind)] = t + duration
        out.append(Fault(round(t, 2), kind, round(duration, 2), arg))
    return out


@dataclass
class Report:
    seed: int
    tier: str
    faults: dict[str, int] = field(default_factory=dict)
    produced: int = 0
    tiered: int = 0
    replicated: int = 0
    lost: int = 0
    duplicates: int = 0
    max_dispatch_behind_messages: float = 0.0
    max_dispatch_behind_bytes: int = 0
    service_starts: int = 0
    producer_starts: int = 0
    ledgered: int = 0  # messages in the producers' own ledger
    unledgered: int = 0  # messages in the log that a kill kept out of the ledger (at most a batch a kill)
    gc_files_deleted: int = 0
    gc_waited: int = 0  # gc runs that found no safepoint yet (before every sink had applied something)
    s3_injected: dict[str, int] = field(default_factory=dict)
    # What shows each fault kind had its effect (``ChaosRun.EFFECTS``): counted after the run.
    effects: dict[str, int] = field(default_factory=dict)
    rss_mb_start: float | None = None
    rss_mb_end: float | None = None
    # Per service process: [seconds it lived, MiB a minute after its start, MiB at its last sample,
    # the same two per role: private memory of the driver, jvm and workers, and mapped files].
    rss_by_service_process: list[list] = field(default_factory=list)
    # Every minute while faults run: {"t": seconds, role: MiB}, whichever service process is up.
    rss_series: list[dict] = field(default_factory=list)
    # Every minute: {"t": seconds, store: MiB}, what the service's RocksDB stores hold in memory
    # (``tierlog_state_memory_bytes``: kv and metadata in the driver, spark in the JVM).
    state_memory_series: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)  # invariant violations seen while running

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class ChaosRun:
    """One run of ``plan`` under ``workdir``; ``run()`` returns the :class:`Report`, ``check()`` asserts on it."""

    def __init__(self, plan: Plan, workdir: Path, *, log=print):
        self.plan, self.dir, self.log = plan, Path(workdir), log
        self.report = Report(plan.seed, plan.tier)
        self.archive = self.dir / "archive"  # hard links to every commitlog file: the oracle's copy
        self.skew_file = self.dir / "skew_ms"
        self.disk_full_flag = self.dir / "disk-full"
        self.metrics_port = free_port()
        self.service: subprocess.Popen | None = None
        self.producer: subprocess.Popen | None = None
        self._expect_service_exit = False
        self._last_commits: dict[tuple[str, int], int] = {}
        self._last_sinks: dict[str, int] = {}
        self._sinks_at_start: dict[str, int] = {}
        self._started_at = 0.0

    # ------------------------------------------------------------ the run

    def run(self) -> Report:
        started = time.monotonic()
        with self._infrastructure():
            self._start_producer()
            self._start_service()
            self._wait(lambda: self._sinks().get("mirror") is not None, 180, "the service's first mirror batch")
            self._inject_all()
            self._heal_and_drain()
            self._verify()
            self.report.s3_injected = dict(self.proxy.injected)
            self._count_effects()
        self.report.wall_s = round(time.monotonic() - started, 1)
        return self.report

    @contextmanager
    def _infrastructure(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        self.archive.mkdir(exist_ok=True)
        moto_port = free_port()
        moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.moto_endpoint = f"http://127.0.0.1:{moto_port}"
        self.proxy = S3FaultProxy(self.moto_endpoint, seed=self.plan.seed).start()
        broker = None
        try:
            self._wait(lambda: self._try(lambda: self._s3().create_bucket(Bucket="tier")), 30, "moto to start")
            # The broker stays up; an outage cuts it off at a TCP proxy its clients go through.
            broker, self.kafka_proxy = proxied_broker(self.dir / "kafka")
            self.config_path = self._write_config()
            self.conf = cfg.load(str(self.config_path), env={})
            yield
        finally:
            for proc in (self.producer, self.service):
                if proc is not None and proc.poll() is None:
                    _kill_group(proc)
            if broker is not None:
                self.kafka_proxy.down()
                broker.stop(kill=True)
            self.proxy.stop()
            moto.kill()
            moto.wait()

    def _write_config(self) -> Path:
        tier = "s3://tier/chaos" if self.plan.tier == "s3" else str(self.dir / "tier")
        return write_config(
            self.dir,
            commitlog={"local_retention": "0s"},
            source={"max_bytes_per_trigger": 4 << 20},
            tier={"location": tier, "segment_messages": 20000, "segment_age_s": 20, "delete_grace_s": 5,
                  "fold_every": 50},
            compaction={"snapshot_interval_s": 30},
            **({"state": {"rocksdb_memory_mb": self.plan.rocksdb_memory_mb}} if self.plan.rocksdb_memory_mb else {}),
            kafka={"bootstrap": f"127.0.0.1:{self.kafka_proxy.port}", "partitions": 4, "linger_ms": 5, "delivery_timeout_s": 10},
            spark={"trigger_interval_s": 0.5},
            metrics={"port": self.metrics_port},
        )

    def _inject_all(self) -> None:
        events: list[tuple[float, int, str, Fault]] = []
        for i, fault in enumerate(schedule(self.plan)):
            heapq.heappush(events, (fault.at, i, "inject", fault))
        t0 = time.monotonic()
        next_sample = next_gc = 0.0
        next_progress = 60.0
        while events:
            now = time.monotonic() - t0
            if events[0][0] <= now:
                _at, i, action, fault = heapq.heappop(events)
                if action == "inject" and not self._ready_for(fault.kind) and now < fault.at + 120:
                    # A fault that lands while a killed service is still starting would have no effect
                    # (it met the first Kafka outage of a run twice under load): it waits for the service.
                    heapq.heappush(events, (now + 1, i, action, fault))
                    continue
                kind = "s3" if fault.kind in S3_MODES else fault.kind
                getattr(self, f"_{action}_{kind}")(fault)
                if action == "inject" and fault.duration:
                    heapq.heappush(events, (now + fault.duration, i, "heal", fault))
                if action == "inject":
                    self.report.faults[fault.kind] = self.report.faults.get(fault.kind, 0) + 1
                    self.log(f"[chaos seed={self.plan.seed} t={now:.1f}s] {fault.kind} {fault.duration or ''} "
                             f"{fault.arg or ''}".rstrip())
                continue
            self._supervise()
            if now >= next_sample:
                self._sample()
                next_sample = now + 2
            if now >= next_gc:
                self._gc()
                next_gc = now + 10
            if now >= next_progress:
                roles = self._rss_by_role()
                if roles is not None:
                    self.report.rss_series.append({"t": round(now), **roles})
                stores = self._state_memory_mb()
                if stores:
                    self.report.state_memory_series.append({"t": round(now), **stores})
                self.log(f"[chaos seed={self.plan.seed} t={now:.0f}s] {sum(self.report.faults.values())} faults, "
                         f"commitlog at {self._frontier() / 2**20:.0f} MiB, max dispatch-behind "
                         f"{self.report.max_dispatch_behind_messages:.0f} messages, service RSS MiB {roles}")
                next_progress = now + 60
            time.sleep(min(0.2, max(0.0, events[0][0] - now)))

    def _ready_for(self, kind: str) -> bool:
        """Can a fault of ``kind`` meet the service now?  A Kafka outage needs the service's
        connections through the proxy: a restarted service can move tiering well before the
        mirror connects (CI met an outage that cut nothing, twice in one run)."""
        if kind in PROCESS_FAULTS:
            return True
        if kind == "kafka_down":
            return self._service_working() and self.kafka_proxy.connections > 0
        return self._service_working()

    def _service_working(self) -> bool:
        """Has the service process started last moved any sink since it started (sampled every 2 s)?"""
        return any(phy > self._sinks_at_start.get(name, -1) for name, phy in self._last_sinks.items())

    def _heal_and_drain(self) -> None:
        self.proxy.set_mode("ok")
        self.disk_full_flag.unlink(missing_ok=True)
        self.skew_file.write_text("0")
        if not self.kafka_proxy.is_up:
            self.kafka_proxy.up()
        self.producer.send_signal(signal.SIGTERM)
        self.producer.wait(timeout=60)
        self._supervise()
        end = self._frontier()
        deadline = time.monotonic() + self.plan.settle_timeout_s
        while True:
            self._supervise()
            self._sample()
            sinks = self._sinks()
            if sinks and all(sinks.get(s) == end for s in ("tier", "kv", "mirror", "changelog")):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"seed {self.plan.seed}: the sinks did not reach the end of the commitlog "
                                     f"({end}) in {self.plan.settle_timeout_s:.0f} s: {sinks}; see {self.dir}")
            time.sleep(2)
        self._gc()  # once more with every sink at the end, as a cron would run it after the faults
        self._link_archive()
        self.report.rss_mb_end = self._rss_mb()
        self._expect_service_exit = True
        self.service.send_signal(signal.SIGTERM)
        code = self.service.wait(timeout=180)
        if code != 0:
            self.report.problems.append(f"the service exited {code} on SIGTERM; see {self.dir / 'service.log'}")

    # Per fault kind (and for gc and the S3 retries), what shows it took effect, as the failure names it.
    # clock_skew has none: a skewed producer's timestamps change nothing tierlog orders by.
    EFFECTS = {
        "kill_service": "service starts after the first",
        "kill_producer": "producer starts after the first",
        "tear_producer": "producer.log: torn appends a restarted producer discarded",
        "kafka_down": "Kafka connections of the service the outage cut, or deliveries it logged as failed",
        "s3_down": "service.log: S3 calls that found the endpoint unreachable and were retried",
        "s3_errors": "S3 proxy: 500 and 503 answers it injected",
        "s3_throttle": "S3 proxy: SlowDown answers it injected",
        "s3_timeouts": "S3 proxy: requests it held past the client's timeout",
        "disk_full": "writes that met the full disk (TIERLOG_FAULT_DISK_FULL's .hits file)",
        "s3_retried": "S3 proxy: requests it failed that came again and went through",
        "gc": "commitlog files gc deleted",
    }

    def _count_effects(self) -> None:
        """Fill ``report.effects``; a fault kind that ran without its effect is a problem: the run
        would otherwise pass without having tested what it claims."""
        r = self.report
        service_log = (self.dir / "service.log").read_text(errors="replace")
        producer_log = (self.dir / "producer.log").read_text(errors="replace")
        hits = Path(str(self.disk_full_flag) + ".hits")
        injected = r.s3_injected
        found = {
            "kill_service": r.service_starts - 1,
            "kill_producer": r.producer_starts - 1,
            "tear_producer": producer_log.count("discarding"),
            # The clients reconnect without a word after a short outage: the cut connections are the evidence.
            "kafka_down": self.kafka_proxy.cut + service_log.count("no Kafka broker reachable")
            + service_log.count("Kafka did not take"),
            "s3_down": service_log.count("endpoint unreachable"),
            "s3_errors": injected.get("InternalError", 0) + injected.get("ServiceUnavailable", 0),
            "s3_throttle": injected.get("SlowDown", 0),
            "s3_timeouts": injected.get("timeout", 0),
            "disk_full": hits.stat().st_size if hits.exists() else 0,
            "s3_retried": injected.get("retried", 0),
            "gc": r.gc_files_deleted,
        }
        ran = set(r.faults) | {"gc"}
        if any(k in S3_MODES and k != "s3_down" for k in r.faults):
            ran.add("s3_retried")
        r.effects = {k: found[k] for k in self.EFFECTS if k in ran}
        for kind, n in r.effects.items():
            if n <= 0:
                r.problems.append(f"{kind} ran without its effect: no {self.EFFECTS[kind]}")

    def check(self) -> None:
        """Fail with the report, the seed and the work directory when anything was lost, doubled or broken."""
        r = self.report
        if r.problems or r.lost or r.duplicates or r.produced == 0:
            raise AssertionError(f"chaos run failed (replay with seed {r.seed}, files in {self.dir}):\n"
                                 + "\n".join(r.problems) + f"\nreport: {r.as_json()}")

    # ------------------------------------------------------------ the oracle

    def _verify(self) -> None:
        """Tier, metadata, KV view and both Kafka topics against a plain replay of every byte produced,
        compared as positions and CRCs of whole rows (:mod:`tests.chaos.digests`) to stay small at soak scale."""
        from state.kv import KVView
        from streaming.settings import derive

        r = self.report
        want = digests.expected(str(self.archive), self.conf.kafka)
        r.produced = len(want.log)
        self._check_ledger(want)
        with self.direct_s3():
            got = digests.tier(self.conf.tier.location)
        r.tiered = len(got)
        self._compare("tier", got, want.log)
        self._verify_metadata(want)
        with KVView(derive(self.conf).paths.kv, read_only=True) as kv:
            differing = digests.kv_differences(kv.entries(), want)
        if differing:
            r.problems.append(f"the KV view differs from the latest value per key of the commitlog at {differing} keys")
        mirror = digests.mirror(self.conf, TOPICS, self._read_timeout_s())
        for _attempt in range(3):  # a read that comes up short is read again before anything is called lost
            if self._same(mirror, want.mirror):
                break
            self.log(f"[chaos seed={self.plan.seed}] the mirror read back differs from the replay; "
                     f"Kafka offset gaps {self._offset_gaps()}; reading it again")
            time.sleep(5)
            mirror = digests.mirror(self.conf, TOPICS, self._read_timeout_s())
        r.replicated = sum(len(v) for v in mirror.values())
        for part in sorted(set(mirror) | set(want.mirror)):
            self._compare(f"mirror {part}", mirror.get(part, digests.Positions()),
                          want.mirror.get(part, digests.Positions()))
        changes = digests.changelog(self.conf, TOPICS, self._read_timeout_s())
        differing = digests.changelog_differences(changes, want)
        for _attempt in range(2):  # as the mirror's: a short read is read again before it counts
            if not differing:
                break
            self.log(f"[chaos seed={self.plan.seed}] the changelog read back differs from the replay "
                     f"({differing}); reading it again")
            time.sleep(5)
            changes = digests.changelog(self.conf, TOPICS, self._read_timeout_s())
            differing = digests.changelog_differences(changes, want)
        if changes.resent:
            r.problems.append(f"{changes.resent} changelog records were sent twice")
        if changes.misplaced:
            r.problems.append(f"{changes.misplaced} changelog records are in a partition their key does not map to")
        if differing:
            r.problems.append(f"the compacted changelog differs from the latest value per key: {differing}")

    def _check_ledger(self, want: digests.Expected) -> None:
        """The replay that every sink is compared with, against the producers' own ledger: each message
        a producer saw appended is in it, at its position; and it holds at most one batch per producer
        kill that no ledger has (appended, then killed before the ledger write)."""
        r = self.report
        ledger = np.fromfile(self.dir / "ledger.bin", dtype=np.dtype([("phy", "<i8"), ("uniq", "<u4")]))
        r.ledgered = len(ledger)
        phy, uniq = want.uniq.arrays()
        at = np.searchsorted(phy, ledger["phy"])
        found = at < len(phy)
        found[found] = phy[at[found]] == ledger["phy"][found]
        if not found.all():
            r.problems.append(f"the replay of the commitlog lacks {int((~found).sum())} messages the producers' "
                              f"ledger holds (first at {ledger['phy'][~found][:5].tolist()})")
        elif not np.array_equal(uniq[at], ledger["uniq"]):
            r.problems.append("the replay holds other messages than the producers' ledger at some positions")
        r.unledgered = len(phy) - int(found.sum())
        allowed = (r.producer_starts - 1) * max(1, self.plan.rate // BATCHES_PER_S)
        if r.unledgered > allowed:
            r.problems.append(f"the replay holds {r.unledgered} messages no producer's ledger has; kills explain "
                              f"at most {allowed}")

    def _read_timeout_s(self) -> float:
        """How long reading a Kafka topic back may take: allow 5,000 records a second, and a minute."""
        return 60 + self.report.produced / 5000

    @staticmethod
    def _same(have: dict, want: dict) -> bool:
        return set(have) == set(want) and all(have[k].phy == want[k].phy and have[k].digest == want[k].digest
                                              for k in want)

    def _offset_gaps(self) -> dict:
        """Per mirror partition, Kafka offsets missing between its first and last record: a broker that
        lost records it acknowledged leaves a gap; records never sent leave none."""
        from tests.kafka_helpers import iter_topic

        gaps = {}
        for source in TOPICS:
            topic = self.conf.kafka.mirror_topic.replace("{topic}", source)
            offsets: dict[int, array] = {}
            for p, rec in iter_topic(self.conf.kafka.bootstrap, topic, self._read_timeout_s()):
                offsets.setdefault(p, array("q")).append(rec.offset)
            for p, have in offsets.items():
                have = np.frombuffer(have, dtype=np.int64)
                missing = np.setdiff1d(np.arange(have.min(), have.max() + 1), have)
                if missing.size:
                    gaps[f"{topic}/{p}"] = missing[:10].tolist()
        return gaps

    def _compare(self, what: str, have: digests.Positions, want: digests.Positions) -> None:
        """Positions in ``have`` must be ``want``'s, in order, once each (count what is missing as lost, what
        is repeated as duplicates), and each with the same digest."""
        have_phy, have_digest = have.arrays()
        want_phy, want_digest = want.arrays()
        distinct, counts = np.unique(have_phy, return_counts=True)
        missing = np.setdiff1d(want_phy, have_phy)
        extra = np.setdiff1d(have_phy, want_phy)
        twice = distinct[counts > 1]
        doubled = len(have_phy) - len(distinct)
        self.report.lost += int(missing.size)
        self.report.duplicates += int(doubled)
        if missing.size or doubled or extra.size or not np.array_equal(have_phy, want_phy):
            self.report.problems.append(f"{what}: {len(have_phy)} messages, {len(want_phy)} expected; missing "
                                        f"{missing[:5].tolist()}, {doubled} twice (positions {twice[:3].tolist()}), "
                                        f"extra {extra[:5].tolist()}")
        elif not np.array_equal(have_digest, want_digest):
            at = np.flatnonzero(have_digest != want_digest)
            self.report.problems.append(f"{what}: every position once, but {at.size} messages differ from the "
                                        f"commitlog (first at position {int(have_phy[at[0]])})")

    def _verify_metadata(self, want: digests.Expected) -> None:
        """Every queue's commit and dispatch offsets end at the queue's next offset; every sink at the end."""
        store = self._metadata()
        try:
            have = {(q.topic, q.queue_id): (q.dispatch, q.commit) for q in store.queues()}
            sinks = store.journal.sinks()
        finally:
            store.close()
        for key, n in want.queue_ends.items():
            if have.get(key) != (n, n):
                self.report.problems.append(f"metadata: queue {key} dispatch/commit {have.get(key)}, expected {n}")
        for name, phy in sinks.items():
            if phy < want.end:
                self.report.problems.append(f"metadata: sink {name} applied through {phy}, the log ends at {want.end}")

    # ------------------------------------------------------------ processes

    def _start_service(self) -> None:
        env = {**CREDS, "AWS_ENDPOINT_URL_S3": self.proxy.endpoint,
               "TIERLOG_FAULT_DISK_FULL": str(self.disk_full_flag)}
        with open(self.dir / "service.log", "ab") as out:
            out.write(f"\n===== start {self.report.service_starts + 1} =====\n".encode())
            out.flush()
            self.service = subprocess.Popen(cli_command("run", "--config", str(self.config_path)),
                                            env=cli_env(env), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.report.service_starts += 1
        self._started_at = time.monotonic()
        self._sinks_at_start = dict(self._last_sinks)

    def _start_producer(self, torn_at: int = 0) -> None:
        starts = self.report.producer_starts
        env = cli_env()
        if torn_at:
            fault_dir = self.dir / f"producer-fault-{starts}"
            fault_dir.mkdir()
            env.update(TIERLOG_FAULT=f"torn_append:{torn_at}", TIERLOG_FAULT_DIR=str(fault_dir))
        argv = [sys.executable, "-m", "tests.chaos.producer", "--dir", self.conf.commitlog.dir,
                "--rate", str(self.plan.rate), "--seed", str(self.plan.seed * 1000 + starts),
                "--keys", str(self.plan.keys), "--body-size", str(self.plan.body_size),
                "--file-size", str(self.plan.file_size), "--skew-file", str(self.skew_file),
                "--ledger", str(self.dir / "ledger.bin")]
        with open(self.dir / "producer.log", "ab") as out:
            self.producer = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        self.report.producer_starts += 1

    def _supervise(self) -> None:
        """Restart a producer a fault killed; a service that exits by itself is a finding."""
        if self.producer.poll() is not None and self.producer.returncode == -signal.SIGKILL:
            self._start_producer()
        if self.service.poll() is not None and not self._expect_service_exit:
            tail = (self.dir / "service.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"seed {self.plan.seed}: the service exited {self.service.returncode} by itself:\n{tail}")

    # ------------------------------------------------------------ faults (inject, heal)

    def _inject_kill_service(self, _f: Fault) -> None:
        self._expect_service_exit = True
        _kill_group(self.service)
        self._expect_service_exit = False
        self._start_service()

    def _inject_kill_producer(self, _f: Fault) -> None:
        _kill_group(self.producer)
        self._start_producer()

    def _inject_tear_producer(self, f: Fault) -> None:
        _kill_group(self.producer)
        self._start_producer(torn_at=int(f.arg))  # it SIGKILLs itself half-way through that batch

    def _inject_s3(self, f: Fault) -> None:
        self.proxy.set_mode(S3_MODES[f.kind], f.arg)

    def _heal_s3(self, f: Fault) -> None:
        if self.proxy.mode == S3_MODES[f.kind]:  # a later S3 fault may have taken over
            self.proxy.set_mode("ok")

    def _inject_kafka_down(self, _f: Fault) -> None:
        self.kafka_proxy.down()

    def _heal_kafka_down(self, _f: Fault) -> None:
        self.kafka_proxy.up()

    def _inject_disk_full(self, _f: Fault) -> None:
        self.disk_full_flag.touch()

    def _heal_disk_full(self, _f: Fault) -> None:
        self.disk_full_flag.unlink(missing_ok=True)

    def _inject_clock_skew(self, f: Fault) -> None:
        self.skew_file.write_text(str(int(f.arg)))

    def _heal_clock_skew(self, _f: Fault) -> None:
        self.skew_file.write_text("0")

    # ------------------------------------------------------------ watching

    def _sample(self) -> None:
        """Commit offsets and sink positions only move forward; dispatch-behind; memory."""
        store = self._metadata()
        if store is None:
            return
        try:
            queues, sinks, source_end = store.queues(), store.journal.sinks(), store.source_end()
        except Exception:  # noqa: BLE001 - a read-only RocksDB can lose a file to the writer's compaction
            return
        finally:
            store.close()
        for q in queues:
            key = (q.topic, q.queue_id)
            if q.commit is None:  # dispatched, its first batch not committed yet (a new queue)
                continue
            if q.commit < self._last_commits.get(key, 0):
                self.report.problems.append(f"commit offset of {key} went back: {self._last_commits[key]} -> {q.commit}")
            if q.commit > q.dispatch:
                self.report.problems.append(f"commit offset of {key} passed its dispatch offset: {q.commit} > {q.dispatch}")
            self._last_commits[key] = q.commit
        for name, phy in sinks.items():
            if phy < self._last_sinks.get(name, -1):
                self.report.problems.append(f"sink {name} went back: {self._last_sinks[name]} -> {phy}")
            self._last_sinks[name] = phy
        if source_end is not None:
            try:
                behind = self._frontier() - source_end
            except TierlogError:  # a producer being killed mid-append right now
                behind = 0
            self.report.max_dispatch_behind_bytes = max(self.report.max_dispatch_behind_bytes, behind)
        behind = self._scrape("tierlog_dispatch_behind_messages")
        if behind is not None:
            self.report.max_dispatch_behind_messages = max(self.report.max_dispatch_behind_messages, behind)
        age = time.monotonic() - self._started_at
        if age > 60:
            roles = self._rss_by_role()
            rss = _total_mb(roles)
            if self.report.rss_mb_start is None:
                self.report.rss_mb_start = rss
            if rss is not None:
                procs = self.report.rss_by_service_process
                if len(procs) < self.report.service_starts:
                    procs.append([0, rss, rss, roles, roles])
                procs[-1][0], procs[-1][2], procs[-1][4] = round(age), rss, roles

    def _gc(self) -> None:
        """``tierlog commitlog gc``, as an operator's cron would run it: never at or above the safepoint."""
        self._link_archive()
        before = {f.base for f in list_files(self.conf.commitlog.dir)}
        result = subprocess.run(cli_command("commitlog", "gc", "--config", str(self.config_path)),
                                env=cli_env(), capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            if "no safepoint yet" in result.stderr:  # before every sink has applied something
                self.report.gc_waited += 1
            else:
                self.report.problems.append(f"commitlog gc exited {result.returncode}: {result.stderr.strip()[-500:]}")
            return
        after = list_files(self.conf.commitlog.dir)
        deleted = before - {f.base for f in after}
        self.report.gc_files_deleted += len(deleted)
        # What a restart would read again from the commitlog: the tier sink's position, and the
        # tiering query's last committed batch end (Spark replays an uncommitted batch from there),
        # read straight from the checkpoint.  Not compaction's or the mirror's: they read the tier,
        # which keeps what they have not applied (their completeness is checked at the end, against
        # the ledger).
        from streaming.runtime.checkpoints import Checkpoint
        from streaming.settings import derive

        needed = [self._sinks().get("tier", -1)]
        try:
            needed += [Checkpoint(derive(self.conf).paths.checkpoint("tiering")).last_committed_end() or -1]
        except TierlogError:
            return  # Spark is writing that checkpoint right now: check at the next gc
        if deleted and after and after[0].base > min(needed):
            self.report.problems.append(f"gc deleted up to {after[0].base}, which a sink or a query replay still "
                                        f"needs (from {min(needed)})")

    def _link_archive(self) -> None:
        for f in list_files(self.conf.commitlog.dir):
            target = self.archive / os.path.basename(f.path)
            if not target.exists():
                os.link(f.path, target)

    def _metadata(self):
        from state.metadata import MetadataStore
        from streaming.settings import derive

        if not os.path.exists(derive(self.conf).paths.metadata):
            return None
        try:
            return MetadataStore(derive(self.conf).paths.metadata, read_only=True)
        except Exception:  # noqa: BLE001 - the service is creating it right now
            return None

    def _sinks(self) -> dict[str, int]:
        store = self._metadata()
        if store is None:
            return {}
        try:
            return store.journal.sinks()
        except Exception:  # noqa: BLE001 - as in _sample
            return {}
        finally:
            store.close()

    def _frontier(self) -> int:
        with CommitLogReader(self.conf.commitlog.dir) as reader:
            return reader.end_offset()

    def _metrics(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
                return resp.read().decode()
        except (OSError, http.client.HTTPException):  # down, or killed mid-answer
            return ""

    def _scrape(self, metric: str) -> float | None:
        values = [float(line.split()[-1]) for line in self._metrics().splitlines() if line.startswith(metric)]
        return max(values) if values else None

    def _state_memory_mb(self) -> dict[str, float]:
        """``tierlog_state_memory_bytes`` per store, in MiB."""
        prefix = 'tierlog_state_memory_bytes{store="'
        return {line[len(prefix):].split('"')[0]: round(float(line.split()[-1]) / 2**20, 1)
                for line in self._metrics().splitlines() if line.startswith(prefix)}

    def _rss_mb(self) -> float | None:
        """Resident memory of the service's process group (driver, JVM, Python workers), private and mapped."""
        return _total_mb(self._rss_by_role())

    def _rss_by_role(self) -> dict[str, float] | None:
        """The service's resident memory in MiB: private (anonymous) memory per role, ``driver`` (the
        Python process holding the sinks and rocksdict stores), ``jvm`` (Spark, its RocksDB state stores)
        and ``workers`` (Python data source and UDF workers), and ``mapped_files``: file pages mapped
        (commitlog files, libraries; counted once per process that maps them).  Growth in one of them
        says where to look; mapped pages of live files are page cache, those of deleted files a leak."""
        if self.service is None or self.service.poll() is not None:
            return None
        out = {"driver": 0.0, "jvm": 0.0, "workers": 0.0, "mapped_files": 0.0}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.getpgid(int(pid)) != self.service.pid:
                    continue
                with open(f"/proc/{pid}/status") as fh:
                    kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in fh)
                           if k in ("RssAnon", "RssFile", "RssShmem")}
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    argv = fh.read().split(b"\0")
            except (OSError, ValueError):
                continue
            role = ("driver" if int(pid) == self.service.pid else
                    "jvm" if os.path.basename(argv[0]) == b"java" else "workers")
            out[role] += kib.get("RssAnon", 0) / 1024
            out["mapped_files"] += (kib.get("RssFile", 0) + kib.get("RssShmem", 0)) / 1024
        return {k: round(v, 1) for k, v in out.items()}

    # ------------------------------------------------------------ helpers

    def _s3(self):
        return boto3.client("s3", endpoint_url=self.moto_endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    @staticmethod
    def _try(fn) -> bool:
        try:
            fn()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def _wait(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.service is not None:
                self._supervise()
            if time.monotonic() > deadline:
                raise AssertionError(f"seed {self.plan.seed}: timed out waiting for {what}; see {self.dir}")
            time.sleep(0.5)

    @contextmanager
    def direct_s3(self):
        """The harness's own reads go straight to the S3 server, past the faulty proxy."""
        saved = {k: os.environ.get(k) for k in (*CREDS, "AWS_ENDPOINT_URL_S3")}
        os.environ.update(CREDS, AWS_ENDPOINT_URL_S3=self.moto_endpoint)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _total_mb(roles: dict[str, float] | None) -> float | None:
    return None if roles is None else round(sum(roles.values()), 1)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process and everything it started (the service's JVM and Python workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
