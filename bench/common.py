"""Helpers shared by the benchmarks: timing, page-cache control, JSON output."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time


def drop_cache(paths: list[str]) -> bool:
    """Ask the kernel to forget cached pages of ``paths`` (no root needed); True if it could."""
    ok = True
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            ok = False
    return ok


def alternating(fns: dict, rounds: int = 3, before=None) -> dict:
    """Each of ``fns`` (name -> callable) once per round, the order reversed every other round, so
    no figure has the warm or the cold side to itself; per name: seconds of every round, the
    median, and the last result."""
    names, times = list(fns), {name: [] for name in fns}
    results = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if before:
                before()
            t = time.perf_counter()
            results[name] = fns[name]()
            times[name].append(time.perf_counter() - t)
    return {name: {"rounds_s": [round(x, 4) for x in times[name]], "median_s": statistics.median(times[name]),
                   "result": results[name]} for name in names}


def pin_to_one_core() -> int | None:
    """Run on one CPU so 'per core' figures mean what they say."""
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def percentiles(seconds: list[float]) -> dict:
    """The median and 99th percentile of ``seconds``, in ms, and how many there were."""
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 2), "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
            "queries": len(ms)}


def report(result: dict) -> None:
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


def warmed_rounds(names: list[str], rounds: int, run) -> dict[str, list]:
    """``run(name, r)`` for each of ``names`` in ``rounds + 1`` rounds, the order reversed every
    other round; the first round warms up (the broker, the JIT) and is not kept.  Returns each
    name's kept results."""
    got: dict[str, list] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            result = run(name, r)
            if r:
                got[name].append(result)
    return got


def paired_medians(got: dict[str, list[dict]], measures, new: str, old: str) -> dict:
    """Each way's median and rounds of each of ``measures`` (``got``: way -> its rounds' figures),
    and each measure's ratio of way ``new`` to way ``old``."""
    out = {}
    for name, rounds in got.items():
        for measure in measures:
            values = [r[measure] for r in rounds]
            out[f"{name}: {measure}"] = {"median": round(statistics.median(values), 2),
                                         "rounds": [round(v, 2) for v in values]}
    for measure in measures:
        out[f"ratio_{measure}"] = round(out[f"{new}: {measure}"]["median"] / out[f"{old}: {measure}"]["median"], 3)
    return out


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    stack, out = list(children.get(root, [])), []
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def tree_cpu_s(root: int, skip: int | None = None) -> float:
    """CPU seconds of ``root`` and every descendant alive now, with the time of those that exited
    (in their parent's children's time); ``skip``: a descendant whose subtree is left out (an
    embedded broker beside what is measured)."""
    skipped = {skip, *descendants(skip)} if skip else set()
    total = 0
    for pid in [root, *descendants(root)]:
        if pid in skipped:
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime: stat's fields 14-17
    return total / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy since boot, and the kernel's part of them (system,
    interrupts, soft interrupts), from /proc/stat's first line: every process and kernel thread."""
    with open("/proc/stat") as fh:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fh.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (system + irq + softirq) / tick


BROKERS = ("tansu", "apache-kafka")


def chosen_broker(kafka: bool, broker: str | None) -> str | None:
    """The broker a benchmark's ``--kafka`` and ``--broker`` ask for: ``--broker`` implies Kafka,
    whose broker is tansu unless named; None for none."""
    return broker or ("tansu" if kafka else None)


@contextlib.contextmanager
def kafka_broker(kind: str | None):
    """``(bootstrap, pid)`` of a Kafka-protocol broker on loopback for the block: ``tansu`` (embedded,
    in memory), ``apache-kafka`` (the tests' KRaft node, from the jars ``./dev`` fetched), or None
    for none (``(None, None)``).  The pid is the broker's process, for its CPU."""
    if kind is None:
        yield None, None
    elif kind == "tansu":
        from connectors.kafka.embedded import EmbeddedBroker

        broker = EmbeddedBroker(log_path=os.path.join(tempfile.gettempdir(), "tierlog-bench-tansu.log")).start()
        try:
            yield broker.bootstrap, broker.process.pid
        finally:
            broker.stop()
    else:
        from pathlib import Path

        from tests.kafka_broker import ApacheKafka

        with tempfile.TemporaryDirectory(prefix="tierlog-bench-kafka-") as root, ApacheKafka(Path(root)) as broker:
            yield broker.bootstrap, broker.jvm.process.pid
