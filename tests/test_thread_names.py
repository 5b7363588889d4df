"""The cost ledger's driver parts: a thread ``name_native`` named is its part; a thread of the same
name that it started natively (Arrow's pools) is ``DRIVER_NATIVE``, not the named thread's part."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from bench.bench_ledger import DRIVER_NATIVE, snapshot
from connectors.threads import NAMED_THREADS, named_threads

# A driver-shaped process: a thread named as the tiering handler's starts Arrow's CPU pool (it
# reads Parquet), then sleeps so the snapshot finds every thread alive.
PROCESS = textwrap.dedent("""
    import io, threading, time
    import pyarrow as pa, pyarrow.parquet as pq
    from connectors.threads import name_native

    def work():
        name_native("tiering")
        out = io.BytesIO()
        pq.write_table(pa.table({f"c{i}": pa.array(range(i, i + 2_000_000)) for i in range(8)}), out)
        for _ in range(5):  # Parquet's columns decoded in Arrow's CPU pool, as the mirror's reads are
            pq.read_table(pa.BufferReader(out.getvalue()), use_threads=True)
        print("ready", flush=True)
        time.sleep(60)

    threading.Thread(target=work, name="tiering", daemon=True).start()
    time.sleep(60)
""")


def test_a_named_threads_native_children_are_their_own_part(tmp_path):
    listed = tmp_path / "named-threads"
    env = {**os.environ, NAMED_THREADS: str(listed)}
    proc = subprocess.Popen([sys.executable, "-c", PROCESS], env=env, cwd=os.getcwd(), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        named = named_threads(str(listed))
        assert len(named) == 1 and next(iter(named))[0] == proc.pid
        snap = snapshot(proc.pid, named=named)
        parts = {tid: part for (_pid, tid), (part, _u, _s) in snap["threads"].items()}
        (tiering_tid,) = [tid for _pid, tid in named]
        assert parts[tiering_tid].startswith("driver: tiering's handler")
        natives = [tid for tid, part in parts.items() if part == DRIVER_NATIVE]
        # The pool's threads were started by the tiering thread and took its name: the names alone
        # put them in its part, as the ledger did before.
        assert natives, parts
        for tid in natives:
            with open(f"/proc/{proc.pid}/task/{tid}/comm") as fh:
                assert fh.read().strip() == "tiering"
        unnamed = snapshot(proc.pid)
        assert DRIVER_NATIVE not in {part for part, _u, _s in unnamed["threads"].values()}
    finally:
        proc.kill()
        proc.wait()


def test_each_thread_is_listed_once_however_often_it_is_named(tmp_path):
    listed = tmp_path / "named-threads"
    code = textwrap.dedent("""
        import threading
        from connectors.threads import name_native
        def run():
            for _ in range(50):  # a handler names its thread every batch
                name_native("mirror")
        threads = [threading.Thread(target=run) for _ in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, NAMED_THREADS: str(listed)},
                   cwd=os.getcwd(), timeout=60)
    lines = listed.read_text().splitlines()
    assert len(lines) == len(set(lines)) == 3 and all(line.endswith(" mirror") for line in lines)
    assert len(named_threads(str(listed))) == 3
    assert named_threads(str(tmp_path / "missing")) == set()  # a service that named no thread yet
