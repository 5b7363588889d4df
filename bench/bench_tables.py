"""Iceberg table commit time over many seal commits: does it stay flat?

    ./dev bench tables [--commits 2000] [--baseline-commits 300] [--queues 8]

Each commit registers one sealed segment per queue (a small Parquet file, as a seal of ``--queues``
queues would) through ``MessageTables.sync``, the path ``tierlog run`` takes, with its settings
(manifests merged, snapshots past ``snapshots_kept`` expired with the manifests only they
referenced).  The baseline, in the same run, makes the same commits with pyiceberg's defaults
(``add_files``, no merging, no expiry) for ``--baseline-commits``.  Both report the median seconds
of their first and last 100 commits and the ratio; flat means a ratio near 1.
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
from connectors.tables.catalog import default_settings
from connectors.tables.messages import MessageTables, _schema_and_spec
from connectors.tier import layout
from connectors.tier.manifest import Segment


def segment_file(root: str, names: layout.Names, queue: int, base: int, rows: int = 50) -> Segment:
    table = pa.table({"topic": ["bench"] * rows, "queue_id": pa.array([queue] * rows, pa.int32()),
                      "queue_offset": list(range(base, base + rows)), "broker": [names.broker] * rows},
                     ).cast(pa.schema([MESSAGE_SCHEMA.field(n) for n in ("topic", "queue_id", "queue_offset", "broker")]))
    full = pa.table({f.name: table[f.name] if f.name in table.column_names else pa.nulls(rows, f.type)
                     for f in MESSAGE_SCHEMA}, schema=MESSAGE_SCHEMA)
    name = names.segment("bench", queue, base)
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(layout.to_parquet(full))
    return Segment(name, "bench", queue, base, base + rows - 1, rows, os.path.getsize(path), 0, 0)


def ours(root: str, commits: int, queues: int) -> list[float]:
    tier = os.path.join(root, "tier")
    tables = MessageTables(default_settings(tier, os.path.join(root, "state")), tier, "broker-a")
    names, tail, seconds = layout.Names("broker-a"), [], []
    tables.sync(-1, [], lambda: [])
    for seq in range(commits):
        segs = [segment_file(tier, names, q, seq * 50) for q in range(queues)]
        tail = [{"seq": seq, "type": "seal", "segments": [s.to_json() for s in segs], "retire": []}]
        started = time.perf_counter()
        tables.sync(seq, tail, lambda: [])
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


def summary(seconds: list[float]) -> dict:
    first, last = statistics.median(seconds[:100]), statistics.median(seconds[-100:])
    return {"commits": len(seconds), "first_100_median_s": round(first, 4), "last_100_median_s": round(last, 4),
            "last_over_first": round(last / first, 2), "total_s": round(sum(seconds), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=2000)
    ap.add_argument("--baseline-commits", type=int, default=300)
    ap.add_argument("--queues", type=int, default=8, help="segments per commit")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tables-") as root:
        base = summary(defaults(os.path.join(root, "base"), args.baseline_commits, args.queues))
        mine = summary(ours(os.path.join(root, "ours"), args.commits, args.queues))
    report({"bench": "tables", "segments_per_commit": args.queues, "message_tables": mine,
            "baseline_pyiceberg_defaults": base,
            "method": "seconds per commit (reading the new files' footers and the catalog commit); medians of "
                      "the first and last 100 commits; baseline with pyiceberg's defaults in the same run"})


if __name__ == "__main__":
    main()
