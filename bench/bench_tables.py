"""Iceberg table commit time over many seal commits: does it stay flat?

    ./dev bench tables [--commits 2000] [--baseline-commits 300] [--queues 8] [--snapshots-kept 20]

Each commit registers one sealed segment per queue (a small Parquet file, as a seal of ``--queues``
queues would) through ``MessageTables.sync``, the path ``tierlog run`` takes, with its settings
(manifests merged, snapshots past ``snapshots_kept`` expired with the manifests only they
referenced).  The baseline, in the same run, makes the same commits with pyiceberg's defaults
(``add_files``, no merging, no expiry) for ``--baseline-commits``.  Both report the median seconds
of their first and last 100 commits and the ratio; flat means a ratio near 1.

A commit's cost grows with the snapshots the table keeps (pyiceberg copies the table metadata for
each change a transaction makes), so the first commits, before the table holds ``snapshots_kept``
of them, are cheaper than any later one.  ``last_over_steady`` compares the last 100 with the 100
after the table first reached that count: what grows with the table's history alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import pyarrow as pa

from bench.common import report
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.tables.catalog import TableSettings, default_settings
from connectors.tables.messages import MessageTables, _schema_and_spec
from connectors.tier import layout
from connectors.tier.manifest import Segment


def segment_file(root: str, names: layout.Names, queue: int, base: int, rows: int = 50, topic: str = "bench") -> Segment:
    table = pa.table({"topic": [topic] * rows, "queue_id": pa.array([queue] * rows, pa.int32()),
                      "queue_offset": list(range(base, base + rows)), "broker": [names.broker] * rows},
                     ).cast(pa.schema([MESSAGE_SCHEMA.field(n) for n in ("topic", "queue_id", "queue_offset", "broker")]))
    full = pa.table({f.name: table[f.name] if f.name in table.column_names else pa.nulls(rows, f.type)
                     for f in MESSAGE_SCHEMA}, schema=MESSAGE_SCHEMA)
    name = names.segment(topic, queue, base)
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(layout.to_parquet(full))
    return Segment(name, topic, queue, base, base + rows - 1, rows, os.path.getsize(path), 0, 0)


def ours(root: str, commits: int, queues: int, snapshots_kept: int) -> list[float]:
    tier = os.path.join(root, "tier")
    settings = default_settings(tier, os.path.join(root, "state"), snapshots_kept=snapshots_kept)
    tables = MessageTables(settings, tier, "broker-a")
    names, tail, seconds = layout.Names("broker-a"), [], []
    tables.sync(-1, [], lambda: [], lambda topic: [])
    for seq in range(commits):
        segs = [segment_file(tier, names, q, seq * 50) for q in range(queues)]
        tail = [{"seq": seq, "type": "seal", "segments": [s.to_json() for s in segs], "retire": []}]
        started = time.perf_counter()
        tables.sync(seq, tail, lambda: [], lambda topic: [])
        seconds.append(time.perf_counter() - started)
    return seconds


def defaults(root: str, commits: int, queues: int) -> list[float]:
    from pyiceberg.catalog.sql import SqlCatalog

    tier = os.path.join(root, "tier")
    os.makedirs(os.path.join(root, "wh"), exist_ok=True)
    catalog = SqlCatalog("base", uri=f"sqlite:///{root}/base.db", warehouse=f"file://{root}/wh")
    catalog.create_namespace("b")
    schema, spec = _schema_and_spec()
    table = catalog.create_table("b.t", schema=schema, partition_spec=spec)
    names, seconds = layout.Names("broker-a"), []
    for seq in range(commits):
        paths = [f"file://{tier}/{segment_file(tier, names, q, seq * 50).name}" for q in range(queues)]
        started = time.perf_counter()
        table.add_files(paths)
        seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float], steady_from: int | None = None) -> dict:
    first, last = statistics.median(seconds[:100]), statistics.median(seconds[-100:])
    # The means hold the occasional manifest merge and snapshot expiry that the medians leave out.
    first_mean, last_mean = statistics.mean(seconds[:100]), statistics.mean(seconds[-100:])
    out = {"commits": len(seconds), "first_100_median_s": round(first, 4), "last_100_median_s": round(last, 4),
           "last_over_first": round(last / first, 2), "first_100_mean_s": round(first_mean, 4),
           "last_100_mean_s": round(last_mean, 4), "mean_last_over_first": round(last_mean / first_mean, 2),
           "total_s": round(sum(seconds), 1)}
    if steady_from is not None and steady_from + 100 <= len(seconds) - 100:
        steady = statistics.median(seconds[steady_from:steady_from + 100])
        out.update({"steady_from_commit": steady_from, "steady_100_median_s": round(steady, 4),
                    "last_over_steady": round(last / steady, 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=2000)
    ap.add_argument("--baseline-commits", type=int, default=300)
    ap.add_argument("--queues", type=int, default=8, help="segments per commit")
    ap.add_argument("--snapshots-kept", type=int, default=TableSettings.snapshots_kept,
                    help="tables.snapshots_kept (default: its default)")
    args = ap.parse_args()
    keep = args.snapshots_kept
    with tempfile.TemporaryDirectory(prefix="bench-tables-") as root:
        base = summary(defaults(os.path.join(root, "base"), args.baseline_commits, args.queues))
        # the table holds ``keep`` snapshots from its commit ``keep`` on, and expires in steps after that
        mine = summary(ours(os.path.join(root, "ours"), args.commits, args.queues, keep), keep + max(10, keep // 5))
    report({"bench": "tables", "segments_per_commit": args.queues, "snapshots_kept": keep, "message_tables": mine,
            "baseline_pyiceberg_defaults": base,
            "method": "seconds per commit (reading the new files' footers and the catalog commit); medians of "
                      "the first and last 100 commits; baseline with pyiceberg's defaults in the same run"})


if __name__ == "__main__":
    main()
