"""compaction.nice: compaction's threads run behind the rest when the cores are full.

The real service's threads are checked in tests/test_observability.py (a running `tierlog run`:
the KV view's threads and its JVM's task threads at the default niceness, the tier's and the
mirror's at 0).  Here, the pieces on real threads of this and other processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from connectors.threads import lower_priority
from streaming import config as cfg
from streaming.runtime.priority import JvmThreads
from tests.cli_runner import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def niceness(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_a_thread_given_a_niceness_keeps_it_never_goes_lower_and_its_new_threads_inherit_it():
    seen = {}

    def child():
        seen["child"] = niceness(threading.get_native_id())

    def worker():
        tid = threading.get_native_id()
        assert lower_priority(6)
        seen["set"] = niceness(tid)
        assert lower_priority(3)  # lower than it has: left as it is
        seen["after"] = niceness(tid)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"set": 6, "after": 6, "child": 6}
    assert niceness(threading.get_native_id()) == 0  # the calling thread is not touched
    assert lower_priority(0) is False  # nothing asked


def test_arrow_pool_started_before_stays_at_niceness_0_when_a_niced_thread_reads():
    # A process of its own: this one's pool may be running already.
    script = textwrap.dedent("""
        import io, json, os, threading
        import pyarrow as pa, pyarrow.parquet as pq
        from connectors.threads import lower_priority, start_arrow_pool

        def threads():
            return {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}

        before = threads()
        start_arrow_pool()
        pool = threads() - before
        width = 4 * pa.cpu_count()
        data = io.BytesIO()
        pq.write_table(pa.table({f"c{i}": list(range(5000)) for i in range(width)}), data, row_group_size=500)
        new = []

        def niced_read():
            lower_priority(9)
            pq.read_table(pa.BufferReader(data.getvalue()), use_threads=True)
            new.extend(threads() - before - pool - {threading.get_native_id()})

        t = threading.Thread(target=niced_read)
        t.start()
        t.join()

        def alive(tid):
            # The starter thread has been joined, but its task can linger in /proc for a moment.
            try:
                return os.getpriority(os.PRIO_PROCESS, tid), open(f"/proc/self/task/{tid}/comm").read().strip()
            except (ProcessLookupError, FileNotFoundError):
                return None

        seen = [s for s in map(alive, pool) if s is not None]
        print(json.dumps({"started": len(seen), "cpus": pa.cpu_count(), "new": new,
                          "nices": sorted(nice for nice, _ in seen),
                          "names": sorted({name for _, name in seen})}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["started"] >= got["cpus"]  # the pool's threads, all of them
    assert set(got["nices"]) == {0}
    assert got["names"] == ["arrow-pool"]  # the ledger counts them as Arrow's pools by that name
    assert got["new"] == []  # the niced read started none at its niceness


def test_the_jvm_threads_named_for_compaction_get_the_niceness_once_each_and_the_others_keep_theirs():
    # A process whose threads carry the JVM's names (Linux's comm, as the JVM sets it): the names,
    # not the language, are what JvmThreads goes by.
    script = textwrap.dedent("""
        import ctypes, sys, threading, time
        libc = ctypes.CDLL("libc.so.6")
        stop = threading.Event()

        def named(name):
            libc.prctl(15, ctypes.c_char_p(name.encode()), 0, 0, 0)
            stop.wait()

        def start(name):
            threading.Thread(target=named, args=(name,), daemon=True).start()

        for name in ("Executor task l", "rocksdb:low", "stream executio", "dag-scheduler-e"):
            start(name)
        print("ready", flush=True)
        sys.stdin.readline()
        start("Executor task l")
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # the names set

        def by_name() -> list[tuple[str, int]]:
            out = []
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                with open(f"/proc/{proc.pid}/task/{tid}/comm") as fh:
                    out.append((fh.read().strip(), niceness(int(tid))))
            return sorted(out)

        jvm = JvmThreads(proc.pid, 7)
        assert jvm.lower() == 2
        assert by_name() == sorted([("Executor task l", 7), ("rocksdb:low", 7), ("stream executio", 0),
                                    ("dag-scheduler-e", 0), ("python", 0)])
        assert jvm.lower() == 0  # each thread once
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        assert jvm.lower() == 1  # the task thread started since
        assert [n for name, n in by_name() if name == "Executor task l"] == [7, 7]
        assert JvmThreads(proc.pid, 0).lower() == 0 and JvmThreads(None, 7).lower() == 0
    finally:
        proc.kill()
        proc.wait()


def test_compaction_nice_defaults_to_10_and_a_value_out_of_range_names_the_setting_and_where_it_came_from():
    assert cfg.Config().compaction.nice == 10
    assert cfg.load(None, env={"TIERLOG_COMPACTION_NICE": "0"}).compaction.nice == 0
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(None, env={"TIERLOG_COMPACTION_NICE": "20"})
    assert str(err.value) == ("setting compaction.nice (from environment variable TIERLOG_COMPACTION_NICE): "
                              "20 is not a niceness: use 0 to 19")
