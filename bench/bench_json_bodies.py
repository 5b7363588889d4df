"""Typed tables: tiering a topic whose bodies are JSON with ``topics.body_format = "*=json"``
against tiering it as ``bytes``, and both against the floor, in one run.

    ./dev bench json_bodies [--messages 40000] [--body 1024] [--queues 8] [--rounds 5] [--shape steady|evolving]
                            [--commits 8]

One commitlog of JSON orders, about ``--body`` bytes each: ``steady``, one shape all along
(``Workload(body_format="json-steady")``), or ``evolving`` (``"json"``): a field added, a long
widened to double, one body in 31 with a customer of the wrong type and one in 97 not JSON at all,
each of which the format reads alone.
Each round runs three variants, in an order reversed every other round, each on a fresh tier:
- ``floor``: the stager alone over the log's ranges (read, body CRC, sort, zstd Parquet, write);
- ``bytes``: the same staging, then in ``--commits`` parts (the service's micro-batches) the tier
  writer's commit and the message tables brought to hold every row (a fresh file each); then the
  seal of every queue, and the tables again (the segments take the fresh files' place): the path
  of a message in ``tierlog run``;
- ``json``: the same, the topic typed: each body parsed into the fresh files, the table's schema
  grown, and at the seal each segment's typed copy written in its place.

Reported: process CPU µs per message of each variant (medians of the rounds, after one untimed
round of each), ``json/bytes`` (the issue's bound is 1.5) and ``json - bytes``: what typing costs
per message.  Process CPU counts every
thread (Arrow's included).  The tables' commits go to the embedded SQLite catalog on local disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace

from bench.bench_stage import ranges
from bench.common import report
from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.workload import Workload, append_in_chunks
from connectors.commitlog.writer import CommitLogWriter
from connectors.tables.catalog import default_settings
from connectors.tables.messages import MessageTables
from connectors.tier.staging import CommitLogGaps, StageSettings, stage
from connectors.tier.writer import TierWriter, WriterSettings
from state.metadata import MetadataStore


def tier_once(log_dir: str, root: str, parts: list, variant: str) -> dict:
    """Tier the whole log into a fresh tier under ``root``; CPU seconds and what the tables hold."""
    location = os.path.join(root, "tier")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    t0 = time.process_time()
    staged = [stage(StageSettings(location=location, reader=ReaderOptions(log_dir)), a, b, last)
              for a, b, last in parts]
    if variant == "floor":
        return {"cpu_s": time.process_time() - t0, "rows": sum(p.rows for p in staged)}
    store = MetadataStore(os.path.join(root, "metadata"))
    tables = MessageTables(replace(default_settings(location, os.path.join(root, "state")), commit_interval_s=0.0,
                                   min_commit_bytes=0, body_formats="*=json" if variant == "json" else ""),
                           location, "broker-a")
    writer = TierWriter(WriterSettings(location=location, segment_age_s=0.0, delete_grace_s=0), store, tables=tables)
    try:
        gaps = CommitLogGaps(ReaderOptions(log_dir)).between
        for batch_id, part in enumerate(staged):
            writer.commit(batch_id, [part], gaps)
            writer.settle_tables(300)  # a fresh file
        writer.maintain(int(time.time() * 1000) + 60_000)  # every queue sealed
        writer.settle_tables(300)  # the segments (or their typed copies) in the fresh files' place
        cpu = time.process_time() - t0
        held = sum(len(t.scan(selected_fields=("queue_offset",)).to_arrow()) for t in tables._listed().values())
        typed = {topic: [f.name for f in t.schema().fields][20:] for topic, t in tables._listed().items()}
    finally:
        writer.close()
        store.close()
    return {"cpu_s": cpu, "rows": held, "typed_columns": typed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=40_000)
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", choices=("steady", "evolving"), default="steady")
    ap.add_argument("--commits", type=int, default=8, help="the log tiered in this many commits (micro-batches)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-json-")
    try:
        log_dir = os.path.join(work, "commitlog")
        with CommitLogWriter(log_dir, fsync="never") as w:
            append_in_chunks(w, Workload(messages=args.messages, topics=1, queues=args.queues, keys=10_000,
                                         body_size=args.body, seed=1,
                                         body_format="json" if args.shape == "evolving" else "json-steady").generate())
        size = sum(end - first for first, end, _ in ranges(log_dir, 1 << 62))
        parts = ranges(log_dir, max(1 << 20, -(-size // max(1, args.commits))))
        names = ["floor", "bytes", "json"]
        got: dict[str, list[dict]] = {n: [] for n in names}
        for name in names:  # untimed: the first of each pays for imports and the catalog's first open
            tier_once(log_dir, os.path.join(work, "run"), parts, name)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                got[name].append(tier_once(log_dir, os.path.join(work, "run"), parts, name))
        us = {n: statistics.median(g["cpu_s"] for g in got[n]) / args.messages * 1e6 for n in names}
        for n in ("bytes", "json"):
            assert all(g["rows"] == args.messages for g in got[n]), (n, [g["rows"] for g in got[n]])
        report({"bench": "json_bodies", "shape": args.shape, "messages": args.messages, "commits": len(parts), "body_bytes": args.body, "rounds": args.rounds,
                "cpu_us_per_message": {n: round(v, 2) for n, v in us.items()},
                "rounds_cpu_s": {n: [round(g["cpu_s"], 3) for g in got[n]] for n in names},
                "json_over_bytes": round(us["json"] / us["bytes"], 3),
                "json_minus_bytes_us": round(us["json"] - us["bytes"], 2),
                "bytes_over_floor": round(us["bytes"] / us["floor"], 3),
                "typed_columns": got["json"][-1]["typed_columns"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
