"""The KV view's writes, three ways in the same run: the default (values of 1.5 KB and more in
RocksDB's blob files, no WAL: a memtable flush after each batch); the same through RocksDB's WAL,
synced (the code before); and every value in the LSM tree, through the WAL.

    python -m bench.bench_kv_apply [--body 2000] [--keys 400000] [--changes 110000]
                                   [--batches 8] [--rounds 3]

Each run is a fresh process and a fresh view.  It builds ``--batches`` batches of ``--changes``
changed keys (random keys of ``--keys``, bodies of ``--body`` random bytes) before it measures, then
applies them as the compaction query's apply thread does (``KVView.apply_table``, one durable
WriteBatch each) and closes the view.  Measured from the first apply to the end of ``close``: the
wall clock of the applies, and the process's CPU, RocksDB's flushes and compactions included (the
compactions a view still owes at its close are not, which favours the LSM-tree side).  Then, on the
view reopened read-only: point reads (p50/p99 of 3,000 random keys) and a full scan (what a snapshot
reads), with the page cache as the writes left it.  The kinds alternate, the order reversed every
other round; figures are per round and medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import percentiles, report

# Each kind: (blob_min_bytes, KVView's durable).  None: the view's default bound (state.kv.BLOB_MIN_BYTES).
# "default": the view as the service writes it; "wal": through RocksDB's WAL, synced (the code
# before); "lsm": every value in the LSM tree, through the WAL.
KINDS = {"default": (None, "flush"), "wal": (None, "wal"), "lsm": (0, "wal")}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_run(path: str, blob_min_bytes: int | None, durable: str, body: int, keys: int, changes: int,
            batches: int) -> dict:
    """One view written and read back in this process; the figures as a dict."""
    import numpy as np
    import pyarrow as pa

    from state.kv import BLOB_MIN_BYTES, KVView

    rng = np.random.default_rng(7)
    pool = np.frombuffer(os.urandom(body * 1024 + body), dtype=np.uint8)
    tables, phy = [], 0
    for _ in range(batches):
        picked = rng.choice(keys, changes, replace=False)
        starts = rng.integers(0, body * 1024, changes)
        tables.append(pa.table({
            "topic": pa.array([f"t{k % 4}" for k in picked]), "key": pa.array([f"k{k}" for k in picked]),
            "phy_offset": pa.array(np.arange(phy, phy + changes * (body + 100), body + 100)),
            "queue_id": pa.array(np.zeros(changes, np.int32)), "queue_offset": pa.array(np.arange(changes)),
            "store_ts": pa.array(np.full(changes, 1_700_000_000_000)), "deleted": pa.array(np.zeros(changes, bool)),
            "body": pa.array([pool[s:s + body].tobytes() for s in starts], pa.binary()),
        }))
        phy += changes * (body + 100)
    blob = BLOB_MIN_BYTES if blob_min_bytes is None else blob_min_bytes
    cpu0, applying = _cpu_s(), 0.0
    view = KVView(path, blob_min_bytes=blob, durable=durable)
    for table in tables:
        t = time.perf_counter()
        view.apply_table(table, applied_through=int(table["phy_offset"][-1].as_py()) + 1)
        applying += time.perf_counter() - t
    view.close()
    cpu = _cpu_s() - cpu0
    view = KVView(path, read_only=True)
    reads = []
    for k in rng.integers(0, keys, 3000):
        t = time.perf_counter()
        view.get(f"t{k % 4}", f"k{k}")
        reads.append(time.perf_counter() - t)
    t = time.perf_counter()
    scanned = sum(1 for _ in view.entries())
    scan_s = time.perf_counter() - t
    view.close()
    size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    return {"blob_min_bytes": blob, "durable": durable, "apply_s": round(applying, 3), "cpu_s": round(cpu, 3), "get": percentiles(reads),
            "scan_s": round(scan_s, 3), "keys": scanned, "disk_mb": round(size / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--body", type=int, default=2000, help="bytes of each value's body")
    ap.add_argument("--keys", type=int, default=400_000)
    ap.add_argument("--changes", type=int, default=110_000, help="changed keys a batch")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run in this process, JSON out
    args = ap.parse_args()
    if args.one is not None:
        blob, durable = KINDS[args.one]
        path = tempfile.mkdtemp(prefix="tierlog-kv-apply-")
        try:
            print(json.dumps(one_run(path, blob, durable, args.body, args.keys, args.changes, args.batches)))
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        for kind in (list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]):
            cmd = [sys.executable, "-m", "bench.bench_kv_apply", "--one", kind,
                   "--body", str(args.body), "--keys", str(args.keys), "--changes", str(args.changes),
                   "--batches", str(args.batches)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[kind].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1}: {kind}: {runs[kind][-1]}", file=sys.stderr)
    gb = args.batches * args.changes * args.body / 1e9
    summary = {kind: {f: statistics.median(run[f] for run in rs) for f in ("apply_s", "cpu_s", "scan_s")}
               for kind, rs in runs.items()}
    for kind, s in summary.items():
        s["get_p99_ms"] = statistics.median(run["get"]["p99_ms"] for run in runs[kind])
        s["core_s_per_gb"] = round(s["cpu_s"] / gb, 2)
    report({"benchmark": "kv_apply", "body": args.body, "changes": args.changes, "batches": args.batches,
            "keys": args.keys, "values_gb": round(gb, 3), "runs": runs, "median": summary,
            "cpu_ratio_wal": round(summary["default"]["cpu_s"] / summary["wal"]["cpu_s"], 3),
            "cpu_ratio_lsm": round(summary["default"]["cpu_s"] / summary["lsm"]["cpu_s"], 3)})


if __name__ == "__main__":
    main()
