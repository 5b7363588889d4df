"""Whole-service catch-up against the essential work on the same bytes, in the same run.

    ./dev bench catchup [--shape small|wide|both] [--rounds 3] [--tiering-only] [--messages SMALL,LARGE]
                        [--spark-tasks-baseline] [--ledger] [--set SECTION.KEY=VALUE ...]

Each round runs, in alternating order, for a small and a large commitlog of the same shape:

service  ``tierlog run --until-caught-up`` as a new process (tiering and compaction, Kafka off, a
         posix tier; start-up included);
floor    the essential work as a plain pipeline with no tierlog code, in a process of its own on
         one thread: read the log's bytes in 4 MiB chunks, CRC-32 every byte, compress each chunk
         with zstd at level 3, write it, and fsync each file (``FLOOR``);
copy     ``cp -r`` of the log's files followed by ``sync`` (after a ``sync`` outside the clock):
         memory speed, printed for reference;
spark    with ``--spark-tasks-baseline``: the service again with ``tier.stage_in_processes`` off, so
         Spark's tasks stage the batches past ``source.partition_bytes``, as before that setting.

Each figure is the marginal throughput, (bytes of the large log - bytes of the small) / (time of
the large run - time of the small), so what every run pays once (Spark's start, the first batch's
warm-up, the last fold, an interpreter's start) cancels out and nothing the service does per byte
is left out.  Shapes (the issue's and the README's):

small   64 queues, 100,000 keys, bodies of ~2,000 bytes; 60,000 and 300,000 messages
wide    1,024 queues, 100,000 keys, 1 KiB bodies; 100,000 and 500,000 messages

The service's figure is also given over its own clock (``*_in_run_*``): from its log line that the
queries started to its last, ``stopped``.  What lies outside, the JVM's and Spark's start and the
exit, is the same for both logs, but it swung the wall-clock figure by ±2 s of a 4 s difference (a
round's marginal 133 to 469 MB/s).  Not everything per byte lies inside: the staging processes
begin on the first batch when the tiering query starts, before that line (``--ledger`` showed about
3 core-seconds of staging before it, all of a 124 MB log's).  The same early seconds drop out of
both logs' runs, so the marginal figure is still fair while the line comes as late in both.

With ``--ledger`` the service's runs are also sampled from ``/proc`` over the whole life of their
process tree, the total taken from the kernel's account of every process once reaped, and their CPU
split into the cost ledger's parts (``bench/bench_ledger.py``): each log's core-seconds, and the
marginal core-seconds per GB of each part, which is what bounds the catch-up.

``--messages`` takes other sizes for the two logs: a larger pair leaves less of the JVM's warm-up
(its JIT compiler is still busy 40 s into a run, compiling less and less) in the marginal figure.

Targets, against the one-thread floor: the whole service >= 0.6; ``--tiering-only`` (compaction
off) >= 1.5 (the service has two cores).  The log files are in the page cache for all three (they
were just written), as a broker's tail is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import report
from connectors.commitlog.workload import Workload, append_in_chunks
from connectors.commitlog.writer import CommitLogWriter
from connectors.errors import ConfigError
from streaming import config as cfg

SHAPES = {
    "small": {"queues": 64, "keys": 100_000, "body": 2000, "messages": (60_000, 300_000)},
    "wide": {"queues": 1024, "keys": 100_000, "body": 1024, "messages": (100_000, 500_000)},
}


def write_log(directory: str, messages: int, shape: dict) -> int:
    w = Workload(messages=messages, topics=4, queues=shape["queues"] // 4, keys=shape["keys"],
                 body_size=shape["body"], delete_ratio=0.05, seed=7)
    with CommitLogWriter(directory, file_size=256 << 20, fsync="never") as writer:
        append_in_chunks(writer, w.generate())
    return sum(e.stat().st_size for e in os.scandir(directory) if e.name.isdigit())


def commitlog_bytes(directory: str) -> int:
    """The bytes the service reads: up to the end of the last record (a file's zero tail is not data)."""
    from connectors.commitlog.reader import CommitLogReader

    with CommitLogReader(directory) as reader:
        return reader.end_offset() - reader.first_offset()


def write_config(work: str, log_dir: str, settings: dict[str, str] | None = None, **sections) -> str:
    """The path of a new config file in ``work`` for a service over ``log_dir``: its state,
    checkpoints and tier (unless ``sections`` give one) in ``work``, no metrics port, ``sections``
    (``cfg.Config`` fields), then ``settings`` (``{"spark.jit_c1_only": "false"}``) applied as
    ``tierlog``'s own flags are (``streaming.config.load``'s overrides, which check them)."""
    conf = cfg.Config(**{
        "commitlog": cfg.CommitlogConfig(dir=log_dir),
        "state": cfg.StateConfig(dir=os.path.join(work, "state")),
        "checkpoint": cfg.CheckpointConfig(dir=os.path.join(work, "checkpoints")),
        "tier": cfg.TierConfig(location=os.path.join(work, "tier")),
        "metrics": cfg.MetricsConfig(port=0),
        **sections})
    path = os.path.join(work, "tierlog.toml")
    with open(path, "w") as fh:
        fh.write(cfg.to_toml(conf, with_docs=False))
    if settings:
        try:
            conf = cfg.load(path, env={}, overrides=settings)
        except ConfigError as exc:
            raise SystemExit(f"--set: {exc}") from None
        with open(path, "w") as fh:
            fh.write(cfg.to_toml(conf, with_docs=False))
    return path


def run_service(root: str, log_dir: str, tiering_only: bool, max_batch_bytes: int | None = None,
                in_processes: bool = True, ledger: bool = False,
                settings: dict[str, str] | None = None) -> tuple[float, float | None, dict | None]:
    """Seconds of one ``tierlog run --until-caught-up`` on a fresh tier, state and checkpoints, and
    of the part between its log lines ``(until caught up)`` and ``stopped`` (None without them);
    ``max_batch_bytes``: ``source.max_bytes_per_trigger`` (None: the product's default); with
    ``ledger``, also the CPU of its process tree by part (``run_ledger``);
    ``settings``: more settings, ``{"spark.jit_c1_only": "false"}``, put in its config file as
    ``tierlog``'s own flags are applied (``streaming.config.load``'s overrides, which check them)."""
    work = tempfile.mkdtemp(dir=root, prefix="run-")
    path = write_config(work, log_dir, settings, compaction=cfg.CompactionConfig(enabled=not tiering_only),
                        tier=cfg.TierConfig(location=os.path.join(work, "tier"), stage_in_processes=in_processes),
                        source=cfg.SourceConfig(**({} if max_batch_bytes is None
                                                   else {"max_bytes_per_trigger": max_batch_bytes})))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLOG_")}
    command = [sys.executable, "-m", "streaming.cli", "run", "--until-caught-up", "--config", path]
    log_path = os.path.join(work, "service.log")
    if ledger:
        from bench.bench_ledger import become_subreaper

        become_subreaper()
    children_before = children_cpu_s()
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        parts, exited = run_ledger(proc, log_path, children_before) if ledger else (None, None)
        code = proc.wait()
    seconds = (exited or time.perf_counter()) - started
    with open(log_path) as fh:
        stderr = fh.read()
    if code != 0:
        raise SystemExit(f"tierlog run failed:\n{stderr[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    return seconds, in_run_seconds(stderr), parts


LEDGER_SAMPLE_S = 0.25  # a catch-up's Spark tasks and Python workers live for a second or two
LEDGER_REAP_S = 60.0  # how long what the driver left may take to exit before the ledger gives up on it


def run_ledger(proc: subprocess.Popen, log_path: str, children_before: float) -> tuple[dict | None, float]:
    """When ``proc`` exited (``time.perf_counter``), and the core-seconds of its process tree by part
    (``bench.bench_ledger``'s parts) over the tree's whole life, with those that came before its log
    line ``(until caught up)``; None if it exited before that line.  The caller made this process
    the tree's subreaper (``bench_ledger.become_subreaper``) before starting ``proc``, and passes
    its children's CPU seconds then (``children_cpu_s``).

    The total is the kernel's account of every process of the tree once reaped: ``proc`` by its
    wait, what its driver leaves as it exits (the JVM, its Python workers) by ``sample_and_reap``;
    and, to their last sample, the task workers PySpark's daemon forks, which the kernel reaps with
    no account (``Sampler.unreported_s``).  A window that ended at the line ``stopped`` left parts
    summing to up to 16% more than its total: the streaming queries had stopped by then, and their
    processes, counted to their last sample, had exited unreaped.  What is left unattributed is
    threads' time after their last sample (0.25 s at most) and processes shorter than a sample.
    Whole runs, not from ``(until caught up)``: the staging processes begin before that line.  What
    every run pays once (the JVM's start and exit) cancels out in the marginal cost."""
    from bench import bench_ledger as bl

    sampler = bl.Sampler(proc.pid)
    t0, line, snap = time.monotonic(), None, sampler.sample()
    while True:
        try:
            proc.wait(LEDGER_SAMPLE_S)  # returns as the driver exits: the run's clock stops there
            break
        except subprocess.TimeoutExpired:
            pass
        snap = sampler.sample()
        if line is None:
            with open(log_path) as fh:
                if "(until caught up)" in fh.read():
                    line = snap
    exited = time.perf_counter()
    last, left = bl.sample_and_reap(sampler, LEDGER_SAMPLE_S, LEDGER_REAP_S)
    # The driver's counters from its last sample; and the JVM's, which the driver stops and reaps
    # itself before it exits: without them its threads shorter than a sample and its short Python
    # workers (``JVM_SHORT``, ``JVM_CHILDREN``) were left unattributed, 8-14% of a run's total.
    jvms = {pid: seen for pid, seen in sampler.procs.items() if seen[0] == "jvm"}
    last["procs"] = {**jvms, **snap["procs"], **last["procs"]}
    window = time.monotonic() - t0
    if line is None:
        return None, exited
    empty = {"procs": {}, "threads": {}}
    got = bl.ledger(empty, last, window, 0, 0, total_s=children_cpu_s() - children_before + sampler.unreported_s())
    early = bl.ledger(empty, line, window, 0, 0)  # the parts' cores over the same window
    return {"window_s": round(window, 2), "total_core_s": round(got["total_cores"] * window, 2),
            "unattributed_share": got["unattributed"]["share"], "still_running_after_reap": left,
            "parts": {row["part"]: round(row["cores"] * window, 2) for row in got["parts"]},
            "before_queries_started": {row["part"]: round(row["cores"] * window, 2) for row in early["parts"]
                                       if row["cores"] * window >= 0.05}}, exited


def children_cpu_s() -> float:
    """User and system CPU seconds of every child this process has reaped, and of what they reaped."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def in_run_seconds(log: str) -> float | None:
    """Seconds from the service's line that its queries started to its ``stopped`` line."""
    import datetime as dt

    def at(line: str) -> float:
        return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

    lines = [line for line in log.splitlines() if line[:2] == "20" and line[23:24] == " "]
    start = next((at(line) for line in lines if line.endswith("(until caught up)")), None)
    stop = next((at(line) for line in reversed(lines) if "tierlog.service: stopped:" in line), None)
    return None if start is None or stop is None else stop - start


def copy(root: str, log_dir: str) -> float:
    """Seconds of ``cp -r`` of the log's directory and ``sync``.  A ``sync`` first, outside the
    clock: otherwise the timed one also writes back what the run before left dirty (a service
    run's tier, state and checkpoints), and the copy's figure swung 0.15-0.73 s for the same files."""
    target = os.path.join(root, "copy")
    subprocess.run(["sync"], check=True)
    started = time.perf_counter()
    subprocess.run(["cp", "-r", log_dir, target], check=True)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - started
    shutil.rmtree(target)
    return seconds


# The floor pipeline, run by a new interpreter: it imports nothing of tierlog.  argv: the log's
# directory, the bytes to read (its files in name order, up to the end of the last record), and
# the directory to write to.
FLOOR = """
import os, sys, time, zlib
import zstandard
source, total, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
compressor = zstandard.ZstdCompressor(level=3)
os.makedirs(target)
started, left, crc = time.perf_counter(), total, 0
for name in sorted(n for n in os.listdir(source) if n.isdigit()):
    if left <= 0:
        break
    with open(os.path.join(source, name), "rb") as src, open(os.path.join(target, name + ".zst"), "wb") as dst:
        while left > 0:
            chunk = src.read(min(4 << 20, left))
            if not chunk:
                break
            left -= len(chunk)
            crc = zlib.crc32(chunk, crc)
            dst.write(compressor.compress(chunk))
        dst.flush()
        os.fsync(dst.fileno())
print(time.perf_counter() - started, crc)
"""


def floor(root: str, log_dir: str, size: int) -> float:
    """Seconds of the floor pipeline (``FLOOR``) over the log's ``size`` bytes, timed inside its
    process (the interpreter's start is not the pipeline's), after a ``sync`` outside the clock."""
    target = os.path.join(root, "floor")
    subprocess.run(["sync"], check=True)
    result = subprocess.run([sys.executable, "-c", FLOOR, log_dir, str(size), target],
                            check=True, capture_output=True, text=True)
    shutil.rmtree(target)
    return float(result.stdout.split()[0])


def measure(shape_name: str, rounds: int, tiering_only: bool, messages: tuple[int, int] | None = None,
            max_batch_bytes: int | None = None, spark_baseline: bool = False, with_ledger: bool = False,
            settings: dict[str, str] | None = None) -> dict:
    shape = dict(SHAPES[shape_name], **({"messages": messages} if messages else {}))
    root = tempfile.mkdtemp(prefix=f"tierlog-catchup-{shape_name}-")
    logs = {}
    for n in shape["messages"]:
        logs[n] = os.path.join(root, f"log-{n}")
        write_log(logs[n], n, shape)
    sizes = {n: commitlog_bytes(d) for n, d in logs.items()}
    small, large = shape["messages"]
    kinds = ("service", "floor", "copy", *(("spark",) if spark_baseline else ()))
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kinds for n in (small, large)}
    in_run: dict[tuple[str, int], list[float | None]] = {("service", n): [] for n in (small, large)}  # its own clock
    ledgers: dict[int, list[dict | None]] = {small: [], large: []}  # the service's, with_ledger
    steps = {"service": lambda n: run_service(root, logs[n], tiering_only, max_batch_bytes, ledger=with_ledger,
                                              settings=settings),
             "floor": lambda n: floor(root, logs[n], sizes[n]), "copy": lambda n: copy(root, logs[n]),
             "spark": lambda n: run_service(root, logs[n], tiering_only, max_batch_bytes, in_processes=False,
                                            settings=settings)}
    for r in range(rounds):
        order = [(kind, n) for n in (small, large) for kind in kinds]
        for kind, n in (order if r % 2 == 0 else order[::-1]):
            took = steps[kind](n)
            if kind in ("service", "spark"):
                took, inside, parts = took
                if kind == "service":
                    in_run[(kind, n)].append(inside)
                    ledgers[n].append(parts)
            times[(kind, n)].append(took)
            print(f"catchup {shape_name} round {r + 1}/{rounds}: {kind} {n} messages "
                  f"{times[(kind, n)][-1]:.1f} s", file=sys.stderr, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    extra = sizes[large] - sizes[small]

    def marginal(kind: str, clock: dict = times) -> list[float]:
        return [extra / (tl - ts) / 1e6 for ts, tl in zip(clock[(kind, small)], clock[(kind, large)])]

    service, essential, baseline = marginal("service"), marginal("floor"), marginal("copy")
    ratios = [s / f for s, f in zip(service, essential)]
    inside = {}
    if all(None not in in_run[("service", n)] for n in (small, large)):
        own = marginal("service", in_run)
        own_ratios = [s / f for s, f in zip(own, essential)]
        inside = {"service_in_run_seconds": {n: [round(t, 2) for t in in_run[("service", n)]] for n in (small, large)},
                  "service_in_run_marginal_MBps": [round(x, 1) for x in own],
                  "ratio_in_run_per_round": [round(x, 3) for x in own_ratios],
                  "ratio_in_run_median": round(statistics.median(own_ratios), 3)}
    spark = {}
    if spark_baseline:
        tasks = marginal("spark")
        spark = {"spark_tasks_marginal_MBps": [round(x, 1) for x in tasks],
                 "ratio_to_spark_tasks_per_round": [round(s / t, 3) for s, t in zip(service, tasks)],
                 "spark_tasks_ratio_to_floor_per_round": [round(t / f, 3) for t, f in zip(tasks, essential)]}
    return {
        "shape": shape_name, **{k: v for k, v in shape.items() if k != "messages"}, "messages": shape["messages"],
        "log_bytes": [sizes[small], sizes[large]], "rounds": rounds,
        "what": "tiering only" if tiering_only else "tiering + compaction",
        "seconds": {f"{k}_{n}": [round(t, 2) for t in v] for (k, n), v in times.items()},
        "service_marginal_MBps": [round(x, 1) for x in service],
        "floor_marginal_MBps": [round(x, 1) for x in essential],
        "ratio_per_round": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "target_ratio": 1.5 if tiering_only else 0.6,
        "copy_marginal_MBps": [round(x, 1) for x in baseline],
        "copy_ratio_median": round(statistics.median(s / c for s, c in zip(service, baseline)), 3),
        **inside,
        **spark,
        **({"ledger": catchup_ledger(ledgers, small, large, extra)} if with_ledger else {}),
    }


def catchup_ledger(ledgers: dict[int, list[dict | None]], small: int, large: int, extra: int) -> dict:
    """The service's CPU by part (``run_ledger``): each log's core-seconds (the mean of the rounds,
    so the parts and the unattributed rest add up to the total), and the marginal cost, (large -
    small) / the extra bytes, in core-seconds per GB, so what every run pays once cancels out as in
    the throughput figure; and each log's parts before its queries had all started (the means)."""
    if any(x is None for n in (small, large) for x in ledgers[n]):
        return {"error": "a run exited before its log line (until caught up)"}
    early = {n: {p: round(statistics.fmean(x["before_queries_started"].get(p, 0.0) for x in ledgers[n]), 2)
                 for p in {p for x in ledgers[n] for p in x["before_queries_started"]}} for n in (small, large)}
    names = sorted({p for n in (small, large) for x in ledgers[n] for p in x["parts"]})

    def mean(n: int, part: str | None = None) -> float:
        if part is None:
            return statistics.fmean(x["total_core_s"] for x in ledgers[n])
        if part == UNATTRIBUTED:
            return statistics.fmean(x["total_core_s"] - sum(x["parts"].values()) for x in ledgers[n])
        return statistics.fmean(x["parts"].get(part, 0.0) for x in ledgers[n])

    gb = extra / 1e9
    rows = sorted(({"part": p, f"core_s_{small}": round(mean(small, p), 2), f"core_s_{large}": round(mean(large, p), 2),
                    "marginal_core_s_per_gb": round((mean(large, p) - mean(small, p)) / gb, 1)}
                   for p in [*names, UNATTRIBUTED]), key=lambda row: -row["marginal_core_s_per_gb"])
    return {"total_core_s": {n: [x["total_core_s"] for x in ledgers[n]] for n in (small, large)},
            "total_marginal_core_s_per_gb": round((mean(large) - mean(small)) / gb, 1),
            "unattributed_share": {n: [x["unattributed_share"] for x in ledgers[n]] for n in (small, large)},
            "still_running_after_reap": {n: [x["still_running_after_reap"] for x in ledgers[n]]
                                         for n in (small, large)},
            "parts": rows, "before_queries_started": early}


UNATTRIBUTED = "unattributed (the total less every part)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[*SHAPES, "both"], default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiering-only", action="store_true", help="compaction off: the tiering query alone")
    ap.add_argument("--messages", help="SMALL,LARGE: the two logs' sizes in messages (default: the shape's)")
    ap.add_argument("--max-batch-mb", type=int, default=None,
                    help="source.max_bytes_per_trigger in MiB (default: the product's); a batch within "
                         "source.partition_bytes is staged by the driver, a larger one by Spark's tasks")
    ap.add_argument("--spark-tasks-baseline", action="store_true",
                    help="also run the service with tier.stage_in_processes off (Spark's tasks stage catch-up "
                         "batches), in the same rounds")
    ap.add_argument("--ledger", action="store_true",
                    help="also sample the service's CPU by part over its process tree's whole life (the cost "
                         "ledger's parts): each log's core-seconds and the marginal core-seconds per GB")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a setting for the service's runs (repeatable), say spark.jit_c1_only=false")
    args = ap.parse_args()
    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or "." not in name:
            ap.error(f"--set {item!r}: give SECTION.KEY=VALUE, say spark.jit_c1_only=false")
        settings[name] = value
    messages = None
    if args.messages:
        try:
            small, large = (int(x) for x in args.messages.split(","))
        except ValueError:
            ap.error(f"--messages {args.messages!r}: give two sizes, SMALL,LARGE (say 300000,900000)")
        if not 0 < small < large:
            ap.error(f"--messages {args.messages!r}: SMALL must be above 0 and below LARGE")
        messages = (small, large)
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    report({"benchmark": "catchup",
            "max_batch_mb": args.max_batch_mb, "settings": settings,
            "results": [measure(s, args.rounds, args.tiering_only, messages,
                                None if args.max_batch_mb is None else args.max_batch_mb << 20,
                                args.spark_tasks_baseline, args.ledger, settings) for s in shapes]})


if __name__ == "__main__":
    main()
