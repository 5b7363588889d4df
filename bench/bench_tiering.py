"""Tiering benchmarks (issue 3), each printing JSON with its baseline measured in the same run.

    python -m bench.bench_tiering catchup   [--mb 1024] [--queues 1024] [--on-corrupt fail|quarantine|both]
    python -m bench.bench_tiering freshness [--rate 10000] [--seconds 60] [--kafka] [--broker tansu|apache-kafka]
                                            [--no-compaction] [--big-tier 60000]
    python -m bench.bench_tiering objects   [--queues 10000]
    python -m bench.bench_tiering restart   [--rounds 3] [--messages 50000]

catchup    Tier a commitlog of 1 KB messages with availableNow.  Marginal
           throughput: messages and bytes after the first batch, over the time
           from the end of the first batch to the end of the last, so Spark's
           start-up and first-batch warm-up are excluded.  Baseline: a plain
           copy of the same commitlog bytes into the same tier directory.
           Target: >= 25% of the copy's MB/s on posix.  --on-corrupt both
           tiers the same commitlog twice, under fail and under quarantine
           (whose driver decodes each batch's range once more to find corrupt
           ranges), and gives the ratio of their msgs/s.
freshness  bench/loadgen.py (pre-encoded records, a process of its own;
           --generator tierlog: `tierlog produce`) appends R msgs/s while
           `tierlog run` tiers; per message, the time from its store
           timestamp to the commit record that made it visible.  p50/p99
           of the steady run, after a warm-up batch (Spark's first
           batches start workers and compile plans).
           Every message stored after the warm-up counts: the run waits until
           the tier has committed the whole log (--drain), then kills the
           service (a clean stop folds the commit records away); messages still
           not committed are reported.  Compaction runs beside tiering (not
           with --no-compaction); with --kafka the mirror and the changelog
           too, on an embedded tansu (--broker apache-kafka: a real Apache
           Kafka, the tests' KRaft node).
           The consumers of the tier are timed the same way, per message:
           append -> in the KV view (the compaction batch that applied it,
           changelog sent first) and append -> in Kafka (the mirror batch
           whose sends were acknowledged), each from the time of the
           service's own log line for that batch; the run then also waits
           for them to apply the whole log.  With --kafka, also append ->
           consumed from the mirror topic, by a consumer process of its own
           (bench/topic_times.py), every record by its tierlog.phy header.
           --big-tier N first seals about N one-message segments over
           --big-queues idle queues (the service itself, tiering them), so the
           steady run's batches commit, fold and maintain on a tier with that
           history.  Target: p99 <= 1 s (<= 1.5 s on a 50k-segment tier).
objects    Objects written per batch (staging objects + the commit record) with
           N active queues, against 10 queues in the same run.  Target: O(1).
restart    kill -9 a running `tierlog run` (the whole service: tiering and
           compaction), append --messages while it is down, start it again:
           seconds from the new process's start to its first batch committed
           to the tier (a new commit record), start-up and recovery included.
           Baseline in the same run: the first start of a new service on a new
           tier, with the same messages to tier, measured the same way.
           --rounds rounds in alternating order; medians.  Target: <= 30 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import loadgen
from bench.common import BROKERS, chosen_broker, kafka_broker, report
from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.workload import Workload, append_in_chunks
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.reader import TierReader
from streaming import config as cfg


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_conf(root: str, **overrides) -> cfg.Config:
    tier = {"location": os.path.join(root, "tier"), "segment_bytes": 1 << 40, "segment_messages": 1 << 40,
            "segment_age_s": 1e9, "fold_every": 1 << 30, **overrides.pop("tier", {})}
    return cfg.Config(
        commitlog=cfg.CommitlogConfig(**{"dir": os.path.join(root, "commitlog"), "file_size": 256 << 20,
                                         "check_crc": True, **overrides.pop("commitlog", {})}),
        source=cfg.SourceConfig(**overrides.pop("source", {})),
        tier=cfg.TierConfig(**tier),
        state=cfg.StateConfig(dir=os.path.join(root, "state")),
        checkpoint=cfg.CheckpointConfig(dir=os.path.join(root, "checkpoints")),
        spark=cfg.SparkConfig(**overrides.pop("spark", {})),
        kafka=cfg.KafkaConfig(**overrides.pop("kafka", {})),
        compaction=cfg.CompactionConfig(**overrides.pop("compaction", {})),
    )


def produce(conf: cfg.Config, messages: int, queues: int, body: int = 1024, topics: int = 1, keys: int = 100_000,
            seed: int = 3) -> None:
    w = Workload(messages=messages, topics=topics, queues=queues, keys=keys, body_size=body, seed=seed)
    with CommitLogWriter(conf.commitlog.dir, file_size=conf.commitlog.file_size, fsync="never") as writer:
        append_in_chunks(writer, w.generate())


def run_service(conf: cfg.Config):
    from streaming.service import Service

    from streaming.queries.tiering.query import TieringQuery

    reports = []
    original = TieringQuery.report

    def capture(query, r):
        reports.append((time.monotonic(), r))
        original(query, r)

    TieringQuery.report = capture
    try:
        Service(conf).run(until_caught_up=True)
    finally:
        TieringQuery.report = original
    return reports


def copy_baseline(conf: cfg.Config) -> dict:
    """A plain copy of the commitlog's message bytes into the tier's directory."""
    target = os.path.join(conf.tier.location, "_copy")
    os.makedirs(target, exist_ok=True)
    with CommitLogReader(conf.commitlog.dir) as reader:
        files = reader.files()
        end = reader.end_offset()
    t = time.perf_counter()
    copied = 0
    for f in files:
        length = max(0, min(f.length, end - f.base))
        with open(f.path, "rb") as src, open(os.path.join(target, os.path.basename(f.path)), "wb") as dst:
            left = length
            while left:
                chunk = src.read(min(8 << 20, left))
                dst.write(chunk)
                left -= len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        copied += length
    seconds = time.perf_counter() - t
    shutil.rmtree(target)
    return {"bytes": copied, "seconds": round(seconds, 3), "MBps": round(copied / seconds / 1e6, 1)}


def catchup(args) -> dict:
    root = tempfile.mkdtemp(prefix="tierlog-catchup-")
    source = {"max_bytes_per_trigger": args.batch_mb << 20, "partition_bytes": args.part_mb << 20}
    conf = make_conf(root, source=source)
    messages = args.mb * (1 << 20) // (1024 + 150)
    produce(conf, messages, args.queues)
    out = {"benchmark": "tiering-catchup", "messages": messages, "queues": args.queues,
           "copy_baseline": copy_baseline(conf)}
    modes = ["fail", "quarantine"] if args.on_corrupt == "both" else [args.on_corrupt]
    for mode in modes:
        # The same commitlog each time; tier, state and checkpoints afresh.
        run_root = os.path.join(root, mode)
        run_conf = make_conf(run_root, source=source, commitlog={"dir": conf.commitlog.dir, "on_corrupt": mode})
        out[f"on_corrupt_{mode}"] = _catchup_once(run_conf, out["copy_baseline"])
    if len(modes) == 2:
        # The quarantine pass decodes each batch's range once more in the driver: its cost, as a ratio.
        out["quarantine_over_fail_msgs_per_s"] = round(out["on_corrupt_quarantine"]["marginal"]["msgs_per_s"]
                                                       / out["on_corrupt_fail"]["marginal"]["msgs_per_s"], 3)
    out["target_ratio"] = 0.25
    shutil.rmtree(root, ignore_errors=True)
    return out


def _catchup_once(conf: cfg.Config, baseline: dict) -> dict:
    reports = run_service(conf)
    (t0, first), rest = reports[0], reports[1:]
    rows = sum(r.rows for _, r in rest)
    nbytes = sum(r.bytes for _, r in rest)
    seconds = reports[-1][0] - t0
    out = {"batches": len(reports), "first_batch": {"rows": first.rows, "seconds": round(first.seconds, 2)},
           "marginal": {"rows": rows, "seconds": round(seconds, 2), "msgs_per_s": round(rows / seconds),
                        "MBps": round(nbytes / seconds / 1e6, 1)}}
    out["ratio_vs_copy"] = round(out["marginal"]["MBps"] / baseline["MBps"], 3)
    return out


class ServiceProcess:
    """One ``tierlog run`` process over its own root (commitlog, tier, state, checkpoints), and the
    CLI commands run against its config."""

    def __init__(self, root: str, trigger_s: float = 0.5, conf: cfg.Config | None = None):
        self.root, self.proc = root, None
        self.generator_pid: int | None = None  # a load generator appending beside it (bench_quiet)
        # Compaction on, as by default; segments that never seal unless ``conf`` says otherwise.
        self.conf = conf or make_conf(root, spark={"trigger_interval_s": trigger_s})
        os.makedirs(self.conf.commitlog.dir, exist_ok=True)
        self.config = os.path.join(root, "tierlog.toml")
        with open(self.config, "w") as fh:
            fh.write(cfg.to_toml(self.conf))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLOG_")}
        self.log = os.path.join(root, "service.log")

    def command(self, *args: str) -> list[str]:
        """The argv of ``tierlog ARGS`` against this root's config."""
        return [sys.executable, "-m", "streaming.cli", *args, "--config", self.config]

    def cli(self, *args: str, text: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), env=self.env, capture_output=True, text=text, check=True)

    def produce(self, messages: int, seed: int) -> None:
        self.cli("produce", "--messages", str(messages), "--queues", "64", "--body-size", "1024", "--seed", str(seed))

    def start(self) -> None:
        with open(self.log, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.command("run"), env=self.env, stdout=subprocess.DEVNULL, stderr=log)

    def seq(self) -> int:
        return TierReader(self.conf.tier.location).committed().seq

    def start_until_first_commit(self, timeout_s: float = 600) -> float:
        """Start the service; seconds until the tier has a commit record it did not have before."""
        before = self.seq()
        started = time.monotonic()
        self.start()
        while self.seq() == before:
            if self.proc.poll() is not None or time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the service in {self.root} committed no batch (exit {self.proc.poll()}); "
                                   "see its service.log")
            time.sleep(0.1)
        return time.monotonic() - started

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: no clean stop, the next start recovers
            self.proc.wait(120)


def freshness(args) -> dict:
    root = tempfile.mkdtemp(prefix="tierlog-fresh-")
    # With --kafka the mirror and the changelog run beside tiering, as the whole service does.
    args.broker = chosen_broker(args.kafka, args.broker)
    with kafka_broker(args.broker) as (bootstrap, _pid):
        return _freshness(args, root, bootstrap)


def _freshness(args, root: str, bootstrap: str | None) -> dict:
    kafka = {"bootstrap": bootstrap, "partitions": 4} if bootstrap else {}
    compaction = {"enabled": False} if args.no_compaction else {}
    if args.compaction_nice is not None:
        compaction["nice"] = args.compaction_nice
    if args.no_hold:  # compaction and the mirror at every trigger (the defaults before issue 53)
        kafka, compaction = {**kafka, "mirror_min_batch_bytes": 0}, {**compaction, "min_batch_bytes": 0}
    if bootstrap and args.mirror_driver_bytes is not None:
        kafka["mirror_driver_bytes"] = args.mirror_driver_bytes
    if bootstrap and args.mirror_process:
        kafka["mirror_process"] = True
    if bootstrap and args.linger_ms is not None:
        kafka["linger_ms"] = args.linger_ms
    source = {"max_bytes_per_trigger": args.max_batch_bytes} if args.max_batch_bytes is not None else {}
    conf = make_conf(root, spark={"trigger_interval_s": args.trigger}, kafka=kafka, compaction=compaction,
                     source=source)
    big = _build_big_tier(root, conf, args.big_tier, args.big_queues) if args.big_tier else None
    service = ServiceProcess(root, conf=conf)
    service.start()

    def append(messages: int, seed: int) -> dict:
        if args.generator == "tierlog":
            done = service.cli("produce", "--messages", str(messages), "--rate", str(args.rate), "--queues", "64",
                               "--seed", str(seed), "--body-size", str(args.body), "--keys", str(args.keys),
                               "--format", "json", text=True)
        else:  # a process of its own, pre-encoded, under a tenth of a core (bench/loadgen.py)
            done = subprocess.run(loadgen.command(conf.commitlog, args.rate, messages, args.body, args.keys, seed),
                                  capture_output=True, text=True, check=True, cwd=REPO)
        return json.loads(done.stdout)

    # Warm up: the first batches of a new Spark application start Python workers and compile plans.
    append(20_000, 99)
    # The warm-up counts from the first batches' commit, not from the start: on a loaded host Spark's
    # start alone took 18 s, and a fixed sleep let the measured part begin on a cold service.
    _wait_for_tier(service, conf, args.drain)
    time.sleep(args.warmup)
    steady_from_ms = int(time.time() * 1000)
    consumer = None
    if bootstrap:  # append -> consumed from the mirror topic, by a consumer of its own (bench/topic_times.py)
        topics = "topic-0" if args.generator == "pre-encoded" else "topic-0,topic-1"
        consumer = subprocess.Popen([sys.executable, "-m", "bench.topic_times", bootstrap, topics,
                                     os.path.join(root, "consumed.txt")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    produced = append(int(args.rate * args.seconds), 0)
    # Every message counts: wait until the tier has committed the whole log (or give up after
    # --drain seconds, and count what it had not), then kill the service, so no clean stop folds the
    # commit records this reads (a fold deletes them).
    _wait_for_tier(service, conf, args.drain)
    consumers = ([] if args.no_compaction else ["compaction"]) + (["mirror"] if bootstrap else [])
    _wait_for_consumers(service, consumers, args.drain)
    service.kill()
    consumed = _consumed(consumer, os.path.join(root, "consumed.txt"), args.drain) if consumer else None
    lines = [json.loads(line.split("batch ", 1)[1]) for line in open(service.log) if "tierlog.service: batch {" in line]
    batch_seconds = sorted(line["seconds"] for line in lines)
    # The new process's first tiering batches: on a big tier, the ones a previous process's
    # leftover maintenance would hold up.
    first_tiering = [line["seconds"] for line in lines if line["query"] == "tiering" and line.get("rows")][:5]
    # The writer's own part of a batch: its commit, and the maintenance (seals, retention, the
    # tables' sync, deletes, folds) of the batch before, which the next batch's commit waits for.
    commit_maintain = [round(sum(line.get("phases", {}).get(k, 0) for k in ("dispatch", "commit", "maintain")), 3)
                       for line in lines if line["query"] == "tiering" and line.get("rows")]
    backend = open_backend(conf.tier.location)
    latencies, steady_phys = [], []
    for obj in backend.list(layout.LOG_PREFIX):
        record = json.loads(backend.read(obj.name))
        if record.get("type") != "batch":
            continue
        for staging in record["staging"]:
            table = layout.from_parquet(backend.read(staging["name"]))
            for t, phy in zip(table.column("store_ts").to_pylist(), table.column("phy_offset").to_pylist()):
                stored_ms = int(t.timestamp() * 1000)
                latencies.append((record["time_ms"] - stored_ms, stored_ms))
                if stored_ms >= steady_from_ms:
                    steady_phys.append((phy, stored_ms))
    values = sorted(lat for lat, stored in latencies if stored >= steady_from_ms)
    applied = {name: _applied_times(service.log, name, steady_phys) for name in consumers}
    if consumed is not None:
        arrived = consumed["arrived"]
        timed = [arrived[phy] - stored for phy, stored in steady_phys if phy in arrived]
        consumed = {**_summary(timed, not_consumed=len(steady_phys) - len(timed)), "consumer_cpu_s": consumed["cpu_s"]}
    # The generator's own count is the oracle where it has one: it shares no code with the service.
    steady = (produced["messages"] if args.generator == "pre-encoded"
              else sum(1 for t in _store_times(conf.commitlog.dir) if t >= steady_from_ms))
    uncommitted = steady - len(values)
    q = statistics.quantiles(values, n=100)
    if os.environ.get("BENCH_KEEP"):
        print(f"kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "tiering-freshness", "target_rate": args.rate, "body": args.body, "achieved_rate": produced["msgs_per_s"],
        "generator": args.generator, "generator_cores": produced.get("cores"), "keys": args.keys,
        "messages": len(latencies), "measured": len(values), "steady_messages": steady,
        "not_committed_within_drain": uncommitted, "trigger_interval_s": args.trigger,
        "kafka": (f"the mirror{'' if args.no_compaction else ' and the changelog'} on {args.broker}"
                  if bootstrap else "off"),
        "mirror_driver_bytes": conf.kafka.mirror_driver_bytes if bootstrap else None,
        "mirror_process": conf.kafka.mirror_process if bootstrap else None,
        "linger_ms": conf.kafka.linger_ms if bootstrap else None,
        "max_bytes_per_trigger": conf.source.max_bytes_per_trigger,
        "tier_before": big or "new",
        "append_to_committed_ms": {"p50": round(q[49]), "p99": round(q[98]), "max": max(values)},
        # The tier's consumers: the KV view (compaction) and, with --kafka, the mirror's acknowledged sends.
        **{f"append_to_{'kv_view' if n == 'compaction' else 'kafka'}_ms": applied[n] for n in consumers},
        **({"append_to_consumed_from_mirror_topic_ms": consumed} if consumed is not None else {}),
        "batch_seconds": {"count": len(batch_seconds), "p50": batch_seconds[len(batch_seconds) // 2],
                          "max": batch_seconds[-1]},
        "first_tiering_batches_s": first_tiering,
        "commit_maintain_s": {"p50": statistics.median(commit_maintain), "mean": round(statistics.mean(commit_maintain), 3),
                              "max": max(commit_maintain), "first_10": commit_maintain[:10]},
        "compaction_nice": conf.compaction.nice,
        "tables": conf.tables.enabled,  # the service's environment has no TIERLOG_* (ServiceProcess): its config says
        "target_p99_ms": 1000,
    }


def _build_big_tier(root: str, conf: cfg.Config, segments: int, queues: int) -> dict:
    """Seal about ``segments`` one-message segments over ``queues`` idle queues (topics ``big-N``)
    with ``tierlog run --until-caught-up`` in ``conf``'s tier, as a long-running tier has them; the
    freshness run then appends to other queues.  Returns what was built and how long it took."""
    started = time.monotonic()
    os.makedirs(conf.commitlog.dir, exist_ok=True)
    rounds = max(1, -(-segments // queues))
    with CommitLogWriter(conf.commitlog.dir, file_size=conf.commitlog.file_size, fsync="never") as writer:
        for _ in range(rounds):
            writer.append_many([Message(topic=f"big-{i // 1000}", queue_id=i % 1000, body=b"b" * 100,
                                        properties={"KEYS": f"k{i}"}) for i in range(queues)])
    builder = ServiceProcess(root, conf=dataclasses.replace(
        conf, tier=dataclasses.replace(conf.tier, segment_messages=1, delete_grace_s=0.0),
        source=dataclasses.replace(conf.source, max_records_per_trigger=queues)))  # a queue's message a batch
    builder.cli("run", "--until-caught-up")
    sealed = sum(q.segments for q in TierReader(conf.tier.location).committed().queue_states().values())
    return {"sealed_segments": sealed, "queues": queues + 64, "build_s": round(time.monotonic() - started, 1)}


def _wait_for_tier(service: ServiceProcess, conf: cfg.Config, timeout_s: float) -> None:
    """Until the tier has committed the whole commitlog as it is now, or ``timeout_s`` passed."""
    with CommitLogReader(conf.commitlog.dir) as reader:
        log_end = reader.end_offset()
    tier = TierReader(conf.tier.location)
    deadline = time.monotonic() + timeout_s
    while (tier.committed().source_end or 0) < log_end and time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"the service stopped (exit {service.proc.poll()}); see {service.log}")
        time.sleep(0.2)


def _consumed(consumer: subprocess.Popen, path: str, timeout_s: float) -> dict:
    """Stop the topic's consumer once what the mirror sent has had time to arrive: the first
    arrival of each commitlog position, and the consumer's CPU seconds."""
    time.sleep(3)
    consumer.terminate()
    cpu_s = float(consumer.communicate(timeout=timeout_s)[0].strip() or 0)
    arrived: dict[int, int] = {}
    with open(path) as fh:
        for line in fh:
            phy, at = map(int, line.split())
            arrived.setdefault(phy, at)
    return {"arrived": arrived, "cpu_s": cpu_s}


def _wait_for_consumers(service: ServiceProcess, queries: list[str], timeout_s: float) -> None:
    """Until each of ``queries`` has logged a batch ending at the tier's end, or ``timeout_s`` passed."""
    tier_end = TierReader(service.conf.tier.location).committed().source_end or 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ends = {name: max((end for end, _ in _batch_lines(service.log, name)), default=-1) for name in queries}
        if all(end >= tier_end for end in ends.values()):
            return
        time.sleep(0.5)


def batch_lines(log_path: str) -> list[tuple[int, dict]]:
    """(wall-clock ms of the line, the batch's report) of each batch line the service logged, in order."""
    out = []
    for line in open(log_path):
        if "tierlog.service: batch {" not in line:
            continue
        stamp = line[:23]  # logging's asctime, local time: "2026-11-27 23:45:48,123"
        at_ms = int(time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) * 1000) + int(stamp[20:23])
        out.append((at_ms, json.loads(line.split("batch ", 1)[1])))
    return out


def _batch_lines(log_path: str, query: str) -> list[tuple[int, int]]:
    """(source_end, wall-clock ms of the line) of each batch line ``query`` logged, in order."""
    return [(batch["source_end"], at_ms) for at_ms, batch in batch_lines(log_path) if batch["query"] == query]


def _applied_times(log_path: str, query: str, messages: list[tuple[int, int]]) -> dict:
    """p50/p99/max of append -> the first batch line of ``query`` whose end is past the message
    (``messages``: (physical offset, store ms)); messages no batch reached are counted, not timed."""
    import bisect

    lines = _batch_lines(log_path, query)
    ends, reached = [], []
    for end, at_ms in lines:  # a batch that ends no further (a replay) does not make anything visible
        if not ends or end > ends[-1]:
            ends.append(end)
            reached.append(at_ms)
    values, missed = [], 0
    for phy, stored_ms in messages:
        i = bisect.bisect_right(ends, phy)
        if i == len(ends):
            missed += 1
        else:
            values.append(reached[i] - stored_ms)
    return _summary(values, not_applied=missed)


def _summary(values: list[int], **missed: int) -> dict:
    """p50/p99/max of latencies ``values`` (ms), how many, and ``missed``: what no time was found for."""
    if len(values) < 2:
        return {"measured": len(values), **missed}
    values = sorted(values)
    q = statistics.quantiles(values, n=100)
    return {"p50": round(q[49]), "p99": round(q[98]), "max": values[-1], "measured": len(values), **missed}


def _store_times(directory: str) -> list[int]:
    """Every message's store time (ms) in the log: the messages the run should have made visible."""
    with CommitLogReader(directory) as reader:
        return [m.store_ts for m in reader.messages()]


def objects(args) -> dict:
    out = {"benchmark": "tiering-objects", "runs": []}
    for queues in (10, args.queues):
        root = tempfile.mkdtemp(prefix="tierlog-objects-")
        conf = make_conf(root, source={"max_bytes_per_trigger": 64 << 20})
        produce(conf, args.messages, queues, body=256)
        reports = run_service(conf)
        batches = [r for _, r in reports if r.rows]
        per_batch = [r.objects + 1 for r in batches]  # staging objects + the commit record
        active = []
        backend = open_backend(conf.tier.location)
        for obj in backend.list(layout.LOG_PREFIX):
            record = json.loads(backend.read(obj.name))
            active.append(len({(t, q) for s in record.get("staging", []) for t, q, _ in s["queues"]}))
        out["runs"].append({"queues": queues, "batches": len(batches), "objects_per_batch_max": max(per_batch),
                            "objects_per_batch_mean": round(statistics.mean(per_batch), 2),
                            "active_queues_per_batch_max": max(active)})
        shutil.rmtree(root, ignore_errors=True)
    out["target"] = "objects per batch independent of active queues"
    return out


def restart(args) -> dict:
    root = tempfile.mkdtemp(prefix="tierlog-restart-")
    restarted = ServiceProcess(os.path.join(root, "restarted"))
    restarted.produce(args.messages, seed=1)
    restarted.start_until_first_commit()  # its first life; killed at its first restart below
    times: dict[str, list[float]] = {"restart": [], "first_start": []}
    fresh: list[ServiceProcess] = []
    try:
        for i in range(args.rounds):
            for which in (("first_start", "restart") if i % 2 else ("restart", "first_start")):
                if which == "restart":
                    time.sleep(args.settle)  # the killed service has run a while: batches, maybe a fold
                    restarted.kill()
                    restarted.produce(args.messages, seed=10 + i)
                    times["restart"].append(restarted.start_until_first_commit())
                else:
                    fresh.append(ServiceProcess(os.path.join(root, f"fresh-{i}")))
                    fresh[-1].produce(args.messages, seed=10 + i)
                    times["first_start"].append(fresh[-1].start_until_first_commit())
                    fresh[-1].kill()
    finally:
        restarted.kill()
        for service in fresh:
            service.kill()
    shutil.rmtree(root, ignore_errors=True)
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"benchmark": "tiering-restart", "rounds": args.rounds, "messages_appended_while_down": args.messages,
            "seconds_to_first_commit": {k: [round(x, 2) for x in v] for k, v in times.items()},
            "median_s": med, "restart_over_first_start": round(med["restart"] / med["first_start"], 2),
            "target_restart_s": 30,
            "method": "kill -9 of tierlog run (tiering and compaction), messages appended while down, start again: "
                      "seconds from the process's start to a new commit record in the tier; baseline: a new "
                      "service on a new tier, same messages; rounds in alternating order"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="which", required=True)
    p = sub.add_parser("catchup")
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--queues", type=int, default=1024)
    p.add_argument("--batch-mb", type=int, default=128, help="source.max_bytes_per_trigger in MiB")
    p.add_argument("--part-mb", type=int, default=32, help="source.partition_bytes in MiB")
    p.add_argument("--on-corrupt", choices=["fail", "quarantine", "both"], default="fail",
                   help="commitlog.on_corrupt; both: run twice on the same commitlog and give the ratio")
    p = sub.add_parser("freshness")
    p.add_argument("--rate", type=float, default=10000)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--warmup", type=float, default=30, help="seconds for the service to start and warm up")
    p.add_argument("--trigger", type=float, default=0.5, help="trigger interval in seconds")
    p.add_argument("--drain", type=float, default=120, help="seconds to wait for the tier to commit the whole log")
    p.add_argument("--kafka", action="store_true", help="the Kafka mirror and changelog too (an embedded tansu)")
    p.add_argument("--broker", choices=BROKERS,
                   help="the Kafka broker: tansu (--kafka's) or a real Apache Kafka (the tests' KRaft node); "
                        "implies --kafka")
    p.add_argument("--no-compaction", action="store_true", help="compaction off (with --kafka: no changelog either)")
    p.add_argument("--compaction-nice", type=int, default=None, metavar="N",
                   help="compaction.nice (default: the product's, 10; 0 runs compaction as every other thread)")
    p.add_argument("--body", type=int, default=1024, help="body size in bytes of the messages appended")
    p.add_argument("--keys", type=int, default=1000, help="distinct keys of the messages appended")
    p.add_argument("--generator", choices=["pre-encoded", "tierlog"], default="pre-encoded",
                   help="what appends: bench/loadgen.py (records encoded beforehand, a process under a tenth "
                        "of a core) or `tierlog produce --rate` (encodes each message; about 17,000 msgs/s of "
                        "1 KiB beside the service)")
    p.add_argument("--mirror-driver-bytes", type=int, default=None, metavar="BYTES",
                   help="kafka.mirror_driver_bytes: mirror batches up to this size are sent by the driver")
    p.add_argument("--linger-ms", type=int, default=None, metavar="MS",
                   help="kafka.linger_ms: how long the producers wait to fill a batch")
    p.add_argument("--mirror-process", action="store_true",
                   help="kafka.mirror_process = true: the driver's mirror steps sent from a process of their own")
    p.add_argument("--max-batch-bytes", type=int, default=None, metavar="BYTES",
                   help="source.max_bytes_per_trigger: a tiering batch past source.partition_bytes is staged "
                        "by Spark's tasks, one within it by the driver")
    p.add_argument("--no-hold", action="store_true",
                   help="compaction and the mirror run at every trigger (min_batch_bytes 0), the defaults before")
    p.add_argument("--big-tier", type=int, default=0, metavar="SEGMENTS",
                   help="first seal about this many one-message segments over --big-queues idle queues, as a "
                        "long-running tier has; 0: a new tier")
    p.add_argument("--big-queues", type=int, default=20_000)
    p = sub.add_parser("objects")
    p.add_argument("--queues", type=int, default=10000)
    p.add_argument("--messages", type=int, default=200_000)
    p = sub.add_parser("restart")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--messages", type=int, default=50_000, help="messages appended before each start")
    p.add_argument("--settle", type=float, default=10, help="seconds the service runs before each kill")
    args = ap.parse_args()
    report({"catchup": catchup, "freshness": freshness, "objects": objects, "restart": restart}[args.which](args))


if __name__ == "__main__":
    main()
