"""The cost ledger: where the whole service's CPU goes, by part, at a fixed append rate.

    ./dev bench ledger [--rates 100,10000] [--body 1024] [--keys 1000] [--seconds 60] [--warmup 30]
                       [--kafka] [--broker tansu|apache-kafka] [--variant V] [--slices N] [--bodies random|json]

For each rate: a new root; ``tierlog run`` as a process (tiering and compaction; with ``--kafka``
the mirror and the changelog into an embedded tansu, which is not counted); a separate process
appending records encoded beforehand (``bench/loadgen.py``, not counted either), their keys drawn
from ``--keys`` (1,000: a batch's changed keys are few; ``./dev bench sustained``'s 100,000: nearly
every message changes a key, so the KV view and the changelog carry nearly every body); after
``--warmup`` seconds, the CPU of every thread of the service's process tree over ``--seconds``, read
from ``/proc/<pid>/task/<tid>/stat`` before and after, user and system time apart.  A thread is put
in a part by its process (the Python driver, the JVM, Spark's Python workers by the module they run:
tasks, streaming sources, planning) and its name (the JVM names its threads; RocksDB and librdkafka
name theirs).  A driver thread that has a part's name but was not named by tierlog
(``TIERLOG_NAMED_THREADS`` lists those it named) was started natively by one that was: Arrow's
thread pools, shared by every driver thread, are their own part.  The workers' tasks are split by
kind (commitlog read, stage, tierfeed read, mirror send) with the CPU each task wrote down for its
own code (``connectors.task_cpu``, on through ``TIERLOG_TASK_CPU``); the rest of the tasks'
processes is PySpark's work around them.  Every thread is sampled each second (``Sampler``), so one
that ends inside the window counts in its part up to its last sample.  The total counts a process
that exited through its parent's children's time: its whole life, if the parent reaped it in the
window; one whose parent ignores SIGCHLD (PySpark's worker daemon, for the task workers it forks)
reaches no parent's time, so it is counted to its last sample, as its threads are.  The JVM's time
that no sampled thread accounts for is its own part (``JVM_SHORT``: threads that began and ended
between two samples), and so is its reaped children's time that none of their sampled threads
accounts for (``JVM_CHILDREN``: Spark's short Python workers).  What is not put in a part is printed
as ``unattributed``, with the process kinds it is in: a thread's time after its last sample, and the
other processes' threads that lived under a second.

With ``--broker apache-kafka`` the broker is a real Apache Kafka (the KRaft node the tests run, from
the jars ``./dev`` fetched) instead of tansu.  Either way the broker's own cores in the window are
printed beside the service's (not in its total), and every sink's lag: the commitlog's end minus
what the sink has applied (the metadata store, read-only, as ``tierlog status`` reads it), at the
window's start and end, and its growth per second.  So is the whole machine (``machine``, from
``/proc/stat``): its busy cores, split into the service, the broker, the load generator and the
rest, which is mostly the kernel's own threads (writing dirty pages back, the network's soft
interrupts) and counts in no process.  A lag that grows while the cores are not full names a sink
that something other than the CPU bounds; one that grows while they are full names the machine.

It prints, per rate, each part's cores, core-seconds per GB of commitlog appended in the window
and µs per message appended (both counted in the commitlog itself), the total measured from the
processes' own counters, the unattributed share, and the micro-batches each query ran in the
window with the CPU they cost on average.  With ``--slices N`` it also prints the window cut in N
equal slices, each with its total, the driver's and the JVM's resident memory, and the cores of
every part over 0.005: how the cost moves as the JVM warms up and the tier's unsealed objects
pile up, and a seal wave (every ``tier.segment_age_s``, 600 s) where one falls in.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict

from bench.common import BROKERS, chosen_broker, descendants, kafka_broker, machine_cpu_s, report, tree_cpu_s
from bench.bench_quiet import service_under_load, variant_conf
from bench.bench_sustained import sink_lags
from bench.bench_tiering import batch_lines
from connectors.task_cpu import TASK_CPU
from connectors.threads import ARROW_POOL, NAMED_THREADS, named_threads

TICK = os.sysconf("SC_CLK_TCK")

# The JVM's thread names (``/proc``'s comm: the first 15 bytes), by part.  Checked in order.
JVM_PARTS = (
    ("Executor task", "JVM: executor tasks (Spark's operators, the state store, Arrow to Python)"),
    ("C1 CompilerThre", "JVM: JIT compilers"), ("C2 CompilerThre", "JVM: JIT compilers"),
    ("GC Thread", "JVM: GC"), ("G1 ", "JVM: GC"), ("VM Thread", "JVM: GC"),
    ("stream executio", "JVM: micro-batch planning and commits (stream threads)"),
    ("rocksdb:", "RocksDB (Spark's state store: background and maintenance threads)"),
    ("state-store-mai", "RocksDB (Spark's state store: background and maintenance threads)"),
)
# The JVM's time that no sampled thread accounts for: threads that began and ended between two
# samples.  Sampled every 50 ms at 2,000 msgs/s, the JVM started one of each of these a second.
JVM_SHORT = ("JVM: threads shorter than a sample (serve-Arrow: results to the driver's Python; Worker Monitor: "
             "one per Python task)")
# The JVM's reaped children's time that none of their sampled threads accounts for: the Python workers
# Spark starts to look up, create and plan a data source read, most of them shorter than a sample.
JVM_CHILDREN = "Spark's Python workers shorter than a sample (the JVM's reaped children: planning, sources)"
SCHEDULING = ("dag-scheduler", "dispatcher-", "spark-listener", "task-result", "executor-", "driver-heart",
              "rpc-", "shuffle-", "netty", "block-manager", "Spark Context", "map-output", "heartbeat",
              "context-clean", "element-track", "RemoteBlock", "task-reaper", "streaming-shuff", "async-log",
              "stdout reader", "stderr reader", "stdin writer", "process reaper", "Idle Worker", "Worker Monitor")

# The driver's threads, named by connectors.threads.name_native.
DRIVER_PARTS = (
    ("kv-apply", "driver: KV view apply thread (changelog, KV view writes)"),
    ("kv-resolve", "driver: KV view resolve thread (the changed keys' messages, read from the tier)"),
    ("changelog-read", "driver: the changelog's reads of the values the KV view keeps in the tier"),
    ("compaction", "driver: compaction's handler (collecting the changed keys)"),
    ("tiering", "driver: tiering's handler (driver staging, the tier's commit)"),
    ("tier-maintain", "driver: tier maintenance (seals, folds, retention, tables)"),
    ("mirror", "driver: the mirror's handler"),
    ("tier-meta", "driver: tier metadata I/O pool"), ("tier-read", "driver: tier metadata I/O pool"),
    (ARROW_POOL, "driver: Arrow's thread pools and other native threads (Parquet reads and writes, compute: "
                 "shared by every driver thread, named after the one that started them)"),
)


_NAMED_PARTS = {part for _prefix, part in DRIVER_PARTS}

# A driver thread with the name of a part above that ``name_native`` did not name: one that thread
# started natively (``connectors.threads``), Arrow's pools for the most part.
DRIVER_NATIVE = DRIVER_PARTS[-1][1]  # connectors.threads.start_arrow_pool names its starter ARROW_POOL


def _part(role: str, comm: str) -> str:
    if comm.startswith("rdk:"):
        return "librdkafka threads (the mirror's and changelog's producers)"
    if role == "jvm":
        for prefix, part in JVM_PARTS:
            if comm.startswith(prefix):
                return part
        if comm.startswith(SCHEDULING):
            return "JVM: Spark's scheduling, RPC and Python-worker plumbing"
        return "JVM: other threads"
    if comm.startswith("rocksdb:"):
        return "RocksDB background threads (metadata store, KV view)"
    if role == "driver":
        for prefix, part in DRIVER_PARTS:
            if comm.startswith(prefix):
                return part
        return "driver: other Python threads (the runner's loop, py4j, metrics)"
    return PYTHON_PARTS.get(role, PYTHON_PARTS["python-worker"])


# Spark's Python processes, by the module their command line runs.
TASKS = "Spark's Python workers: tasks"
PYTHON_PARTS = {
    "python-worker": TASKS,  # pyspark.worker: tasks (reads of the data sources, mapInArrow)
    "python-source": "Spark's Python workers: streaming sources (offsets, the hold; one process each)",
    "python-planner": "Spark's Python workers: planning (data source lookup, creation, read plans)",
    "mirror-sender": "the mirror's sender process (reads the staging objects back, builds and sends the records)",
    "stage-pool": "tiering's staging processes (batches past source.partition_bytes: catching up)",
}


def _fields(path: str) -> list[str] | None:
    """A ``/proc`` stat file's fields after the command's name: the state first, then the parent's pid."""
    try:
        with open(path) as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _stat(path: str) -> tuple[int, int, int, int] | None:
    """utime, stime, cutime, cstime in ticks."""
    fields = _fields(path)
    return None if fields is None else (int(fields[11]), int(fields[12]), int(fields[13]), int(fields[14]))


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "java" in cmd.split(" ", 1)[0]:
        return "jvm"
    if "streaming.queries.mirror.sender_process" in cmd:
        return "mirror-sender"
    if "from multiprocessing." in cmd:  # spawn_main and resource_tracker: only the stage pool spawns
        return "stage-pool"
    if "python_streaming_source_runner" in cmd:
        return "python-source"
    if "pyspark.sql.worker." in cmd:  # lookup_data_sources, create_data_source, plan_data_source_read
        return "python-planner"
    return "python-worker"


def task_cpu(path: str) -> dict[str, float]:
    """CPU seconds by task kind so far in the service's ``TIERLOG_TASK_CPU`` file
    (``connectors.task_cpu``)."""
    kinds: dict[str, float] = defaultdict(float)
    try:
        with open(path) as fh:
            for line in fh:
                kind, _, seconds = line.rpartition(" ")[0].rpartition(" ")  # kind cpu_seconds pid
                kinds[kind] += float(seconds)
    except OSError:
        pass
    return dict(kinds)


SAMPLE_S = 1.0


class Sampler:
    """Snapshots every ``SAMPLE_S`` through a window, so a thread or process that ends inside it
    is counted in its part up to its last sample, not left unattributed (Spark's executor threads
    and Python workers come and go; at 2,000 msgs/s that was 12-14% of the total)."""

    def __init__(self, root: int, named: str | None = None):
        self.root = root
        self.named = named  # the service's TIERLOG_NAMED_THREADS file, if it has one
        self.threads: dict = {}  # every thread seen, at its latest sample
        self.procs: dict = {}  # every process seen, at its latest sample
        self.unreported: set[int] = set()  # of them, those no parent's children's time will hold
        self.parents: dict[int, int] = {}  # every process seen: its parent's pid

    def sample(self, pids: list[int] | None = None) -> dict:
        """A snapshot: the processes alive now (``pids``: these instead of ``root``'s tree); every
        thread seen so far, at its latest counters."""
        snap = snapshot(self.root, pids, None if self.named is None else named_threads(self.named))
        self.threads.update(snap["threads"])
        self.unreported.update(pid for pid in snap["procs"]  # checked once, when first seen
                               if pid not in self.procs and _ignores_sigchld(snap["parents"][pid]))
        self.procs.update(snap["procs"])
        self.parents.update(snap["parents"])
        gone = {pid: self.procs[pid] for pid in self.unreported if pid not in snap["procs"]}
        return {"procs": snap["procs"], "threads": dict(self.threads), "unreported_gone": gone,
                "parents": dict(self.parents), "roles": {pid: role for pid, (role, _c) in self.procs.items()}}

    def unreported_s(self) -> float:
        """CPU seconds, to their last sample, of the processes whose parent ignores ``SIGCHLD``:
        the kernel reaps them itself and adds their time to no one's children's time (PySpark's
        worker daemon does so for the task workers it forks)."""
        return sum(sum(self.procs[pid][1]) for pid in self.unreported) / TICK

    def sleep_until(self, deadline: float) -> dict:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(SAMPLE_S, left))
            self.sample()
        return self.sample()


def snapshot(root: int, pids: list[int] | None = None, named: set[tuple[int, int]] | None = None) -> dict:
    """Per process of ``root``'s tree (or of ``pids``): its role and own counters; per thread: its
    part and (user, system) ticks.  ``named``: the driver threads ``name_native`` named
    (``connectors.threads.named_threads``); a driver thread of a part's name that is not among
    them is ``DRIVER_NATIVE``.  None: every thread by its name alone."""
    procs, threads, parents = {}, {}, {}
    for pid in [root, *descendants(root)] if pids is None else pids:
        fields = _fields(f"/proc/{pid}/stat")
        if fields is None:
            continue
        role = _role(pid, root)
        procs[pid] = (role, (int(fields[11]), int(fields[12]), int(fields[13]), int(fields[14])))
        parents[pid] = int(fields[1])
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            st = _stat(f"/proc/{pid}/task/{tid}/stat")
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                    comm = fh.read().strip()
            except OSError:
                continue
            if st is not None:
                part = _part(role, comm)
                if named is not None and part in _NAMED_PARTS and (pid, int(tid)) not in named:
                    part = DRIVER_NATIVE
                threads[(pid, int(tid))] = (part, st[0], st[1])
    return {"procs": procs, "threads": threads, "parents": parents}


SIGCHLD_BIT = 1 << 16  # SIGCHLD (17) in /proc's signal masks


def _ignores_sigchld(pid: int) -> bool:
    """Whether ``pid`` ignores SIGCHLD, so its children's CPU reaches no rusage once they exit."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            ignored = next(line for line in fh if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(ignored.split()[1], 16) & SIGCHLD_BIT)


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process the reaper of its descendants' orphans (Linux's ``prctl``), so the JVM and
    the Python workers a service's driver leaves behind as it exits are reaped here, and their CPU
    reaches this process's children's time (``resource.RUSAGE_CHILDREN``) instead of init's."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def sample_and_reap(sampler: Sampler, every: float, timeout: float) -> tuple[dict, int]:
    """Once a service's driver has exited: sample what it left (now this process's children, with
    ``become_subreaper``) every ``every`` seconds and reap each as it exits, until none is left or
    ``timeout``; the last snapshot, and how many were still running then."""
    me, deadline = os.getpid(), time.monotonic() + timeout
    snap = sampler.sample([])
    while True:
        left = []
        for pid in descendants(me):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # a grandchild: its own parent reaps it
                done = 0
            if not done:
                left.append(pid)
        if left:
            snap = sampler.sample(left)
        if not left or time.monotonic() >= deadline:
            return snap, len(left)
        time.sleep(every)


def rss_mb(snap: dict, root: int) -> dict[str, int]:
    """Resident memory of the driver and of the JVM, in MB (the workers come and go), and of it the
    mapped files' pages (``ROLE_file``: the commitlog's, which the page cache could reclaim)."""
    out = {}
    for pid, (role, _own) in snap["procs"].items():
        if role in ("driver", "jvm"):
            try:
                with open(f"/proc/{pid}/status") as fh:
                    kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in fh)
                          if k in ("VmRSS", "RssFile")}
            except (OSError, ValueError):
                continue
            out[role] = out.get(role, 0) + kb.get("VmRSS", 0) // 1024
            out[f"{role}_file"] = out.get(f"{role}_file", 0) + kb.get("RssFile", 0) // 1024
    return out


def appended(directory: str, start: int | None = None) -> tuple[int, int]:
    """The commitlog's end now, and how many records lie between ``start`` and it."""
    from connectors.commitlog.reader import CommitLogReader

    with CommitLogReader(directory) as reader:
        end = reader.end_offset()
        records = 0 if start is None else sum(len(span.starts) for span in reader.spans(start, end))
    return end, records


def ledger(before: dict, after: dict, seconds: float, messages: int, nbytes: int,
           kinds: dict[str, float] | None = None, total_s: float | None = None) -> dict:
    """The parts' CPU between two snapshots, and what is left unattributed; ``kinds``: the CPU seconds
    the workers' tasks spent in tierlog's code in the window, by kind, which the tasks' part is split
    into (the rest of it is PySpark's work around them); ``total_s``: the total, measured otherwise
    (by default the processes' own counters in the snapshots, with their reaped children's)."""
    total = 0
    for pid, (_role_, (u, s, cu, cs)) in after["procs"].items():
        u0, s0, cu0, cs0 = before["procs"].get(pid, (None, (0, 0, 0, 0)))[1]
        total += (u + s + cu + cs) - (u0 + s0 + cu0 + cs0)
    for pid, (_role_, (u, s, cu, cs)) in after.get("unreported_gone", {}).items():  # in no rusage: to its last sample
        if pid not in before.get("unreported_gone", {}):
            u0, s0, cu0, cs0 = before["procs"].get(pid, (None, (0, 0, 0, 0)))[1]
            total += (u + s + cu + cs) - (u0 + s0 + cu0 + cs0)
    if total_s is not None:
        total = total_s * TICK
    parts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_pid: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # the same, per process
    for key, (part, u, s) in after["threads"].items():
        _p, u0, s0 = before["threads"].get(key, (part, 0, 0))
        parts[part][0] += u - u0
        parts[part][1] += s - s0
        by_pid[key[0]][0] += u - u0
        by_pid[key[0]][1] += s - s0
    unthreaded = _unthreaded(before, after, by_pid)
    jvm_u, jvm_s = unthreaded.pop("jvm", [0, 0])
    if jvm_u + jvm_s > 0:
        parts[JVM_SHORT] = [max(0, jvm_u), max(0, jvm_s)]
    kids_u, kids_s = unthreaded.pop(f"jvm {CHILDREN}", [0, 0])
    if kids_u + kids_s > 0:
        parts[JVM_CHILDREN] = [max(0, kids_u), max(0, kids_s)]
    attributed = sum(u + s for u, s in parts.values())
    if kinds and TASKS in parts:
        _split_tasks(parts, kinds)
    gb = nbytes / 1e9
    rows = []
    for part, (u, s) in sorted(parts.items(), key=lambda kv: -sum(kv[1])):
        cpu_s = (u + s) / TICK
        rows.append({"part": part, "cores": round(cpu_s / seconds, 3), "system_share": round(s / max(1, u + s), 2),
                     "core_s_per_gb": round(cpu_s / gb, 1) if gb else None,
                     "us_per_message": round(cpu_s / messages * 1e6, 1) if messages else None})
    unattributed = (total - attributed) / TICK
    return {"total_cores": round(total / TICK / seconds, 3), "parts": rows,
            "unattributed": {"cores": round(unattributed / seconds, 3),
                             "share": round(unattributed / max(1e-9, total / TICK), 3),
                             "by_process": {role: round((u + s) / TICK / seconds, 3) for role, (u, s) in
                                            unthreaded.items() if abs(u + s) / TICK / seconds >= 0.001}},
            "system_share": round(sum(s for _, s in parts.values()) / max(1, attributed), 3)}


def _unthreaded(before: dict, after: dict, threads: dict[int, list[int]]) -> dict[str, list[int]]:
    """(user, system) ticks of each kind of process that none of its sampled threads account for:
    its own counters' growth less its threads' (``threads``, per pid); and apart, by the parent's
    kind, its reaped children's time less the sampled threads of the children that exited in the
    window: their time after their last sample, and children shorter than a sample.  The JVM reaps
    the short Python workers Spark starts to plan a read, and its streaming sources' processes when
    a run stops; counting their time in the JVM's own rest as well as in their threads' parts once
    left a catch-up's parts summing to more than its total."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for pid, (role, (u, s, cu, cs)) in after["procs"].items():
        u0, s0, cu0, cs0 = before["procs"].get(pid, (role, (0, 0, 0, 0)))[1]
        out[role][0] += u - u0 - threads[pid][0]
        out[role][1] += s - s0 - threads[pid][1]
        out[f"{role} {CHILDREN}"][0] += cu - cu0
        out[f"{role} {CHILDREN}"][1] += cs - cs0
    roles, parents = after.get("roles", {}), after.get("parents", {})
    for pid, (u, s) in threads.items():
        if pid in after["procs"] or pid in after.get("unreported_gone", {}):
            continue  # alive, or in no parent's time: counted in the total as its threads are
        parent = roles.get(parents.get(pid), "other")
        out[f"{parent} {CHILDREN}"][0] -= u
        out[f"{parent} {CHILDREN}"][1] -= s
    return {k: v for k, v in out.items() if v != [0, 0]}


CHILDREN = "(its exited children)"


def _split_tasks(parts: dict, kinds: dict[str, float]) -> None:
    """Split the workers' tasks part into each kind's own code and PySpark's rest, in proportion of
    user and system time (a kind's lines count the process's CPU, both together)."""
    u, s = parts.pop(TASKS)
    whole = u + s
    mine = min(whole, sum(kinds.values()) * TICK)  # a task that began before the window counts whole
    scale = mine / max(1e-9, sum(kinds.values()) * TICK)
    for kind, cpu_s in sorted(kinds.items()):
        ticks = cpu_s * TICK * scale
        share = ticks / max(1e-9, whole)
        parts[f"{TASKS}: {kind} (tierlog's code)"] = [u * share, s * share]
    rest = (whole - mine) / max(1e-9, whole)
    parts[f"{TASKS}: PySpark around them (taking the task, Arrow in and out, the worker's loop)"] = [u * rest, s * rest]


def _batches(log_path: str, since: float, until: float) -> dict[str, int]:
    """Micro-batches each query logged between two wall-clock times."""
    counts: dict[str, int] = defaultdict(int)
    for at_ms, batch in batch_lines(log_path):
        if since <= at_ms / 1000 <= until:
            counts[batch["query"]] += 1
    return dict(counts)


def machine(out: dict, busy: float, kernel: float, generator: float) -> dict:
    """The whole machine's busy cores in the window, split into the service (its total), the broker,
    the load generator, and the rest: the kernel's own threads (writing dirty pages back, the
    network's soft interrupts) and any other process.  When ``busy`` is near ``cores``, what bounds
    a sink that falls behind is the machine, and this says who holds it."""
    broker = out.get("broker_cores", 0.0)
    return {"cores": os.cpu_count(), "busy_cores": round(busy, 3), "kernel_cores": round(kernel, 3),
            "service": out["total_cores"], "broker": broker, "generator": round(generator, 3),
            "the rest (kernel threads, other processes)": round(busy - out["total_cores"] - broker - generator, 3)}


def measure(rate: float, args, kafka: str | None, broker_pid: int | None = None) -> dict:
    conf_for = lambda root: variant_conf(root, args.variant, kafka)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="tierlog-ledger-tasks-") as tasks_dir, \
            service_under_load(conf_for, rate, args.body, prefix="tierlog-ledger-", keys=args.keys, bodies=args.bodies,
                               env={TASK_CPU: os.path.join(tasks_dir, "task-cpu"),
                                    NAMED_THREADS: os.path.join(tasks_dir, "named-threads")}) as service:
        cpu_file = service.env[TASK_CPU]
        time.sleep(args.warmup)
        log_start, _ = appended(service.conf.commitlog.dir)
        kinds0 = task_cpu(cpu_file)
        lags0, broker0 = sink_lags(service.conf, log_start), broker_pid and tree_cpu_s(broker_pid)
        machine0, generator0 = machine_cpu_s(), tree_cpu_s(service.generator_pid)
        sampler = Sampler(service.proc.pid, named=service.env[NAMED_THREADS])
        start_wall, before, t0 = time.time(), sampler.sample(), time.monotonic()
        slices, last, at = [], before, t0
        for i in range(max(1, args.slices)):
            snap = sampler.sleep_until(t0 + args.seconds * (i + 1) / max(1, args.slices))
            now = time.monotonic()
            if args.slices > 1:
                cut = ledger(last, snap, now - at, 1, 1)
                slices.append({"until_s": round(now - t0), "total_cores": cut["total_cores"],
                               "rss_mb": rss_mb(snap, service.proc.pid),
                               "parts": {r["part"]: r["cores"] for r in cut["parts"] if r["cores"] >= 0.005}})
            last, at = snap, now
        after, t1, end_wall = last, at, time.time()
        broker1 = broker_pid and tree_cpu_s(broker_pid)
        machine1, generator1 = machine_cpu_s(), tree_cpu_s(service.generator_pid)
        kinds = {k: v - kinds0.get(k, 0.0) for k, v in task_cpu(cpu_file).items()}
        log_end, messages = appended(service.conf.commitlog.dir, log_start)
        lags1 = sink_lags(service.conf, log_end)
        if service.proc.poll() is not None:
            raise RuntimeError(f"the service in {service.root} exited (see {service.log})")
        seconds = t1 - t0
        out = {"rate_msgs_s": rate, "body_bytes": args.body, "keys": args.keys, "window_s": round(seconds, 1),
               "appended": {"messages": messages, "mb": round((log_end - log_start) / 1e6, 1)},
               **ledger(before, after, seconds, messages, log_end - log_start, kinds)}
        batches = _batches(service.log, start_wall, end_wall)
        total_batches = sum(batches.values())
        out["micro_batches"] = batches
        out["sink_lag_mb"] = {sink: {"start": round(lags0.get(sink, 0) / 1e6, 1), "end": round(lag / 1e6, 1),
                                     "growth_mb_s": round((lag - lags0.get(sink, 0)) / seconds / 1e6, 2)}
                              for sink, lag in lags1.items()}
        if broker_pid:
            out["broker_cores"] = round((broker1 - broker0) / seconds, 3)
        out["machine"] = machine(out, (machine1[0] - machine0[0]) / seconds, (machine1[1] - machine0[1]) / seconds,
                                 (generator1 - generator0) / seconds)
        out["cpu_ms_per_micro_batch"] = (round(out["total_cores"] * seconds / total_batches * 1000)
                                         if total_batches else None)
        if slices:
            out["slices"] = slices
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100,10000", help="messages per second, comma-separated")
    parser.add_argument("--body", type=int, default=1024, help="body bytes (default 1024)")
    parser.add_argument("--keys", type=int, default=1000,
                        help="keys the messages are drawn from (default 1000; bench sustained's is 100000)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window (default 60)")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the window (default 30)")
    parser.add_argument("--kafka", action="store_true", help="the mirror and changelog into an embedded tansu")
    parser.add_argument("--broker", choices=BROKERS,
                        help="with Kafka: the broker (tansu, or the tests' Apache Kafka); implies --kafka")
    parser.add_argument("--variant", default="the default",
                        help="a configuration of ./dev bench quiet's (bench/bench_quiet.py), e.g. mirror-process")
    parser.add_argument("--slices", type=int, default=1, help="also print the window cut in this many slices")
    parser.add_argument("--bodies", choices=("random", "json"), default="random",
                        help="the generator's bodies: random bytes, or JSON orders (with --variant json-topics, typed)")
    args = parser.parse_args()
    broker = chosen_broker(args.kafka, args.broker)
    with kafka_broker(broker) as (bootstrap, broker_pid):
        runs = [measure(float(r), args, bootstrap, broker_pid) for r in args.rates.split(",")]
    report({"benchmark": "ledger", "variant": args.variant, "bodies": args.bodies, "kafka": broker is not None, "broker": broker, "runs": runs,
            "target_unattributed_share": 0.10})


if __name__ == "__main__":
    main()
