"""The stager alone (``connectors.tier.staging.stage``, what each Spark task of the tiering query
runs), against a copy of the same byte ranges into the same tier directory, in one process.

    ./dev bench stage [--mb 256] [--part-mb 32] [--queues 64] [--body 2000] [--rounds 3]
                      [--driver] [--no-uniq-key]

Each round stages the whole log in ``--part-mb`` ranges (as the source's partitions cut it) and
copies the same ranges (read, write, fsync: a staging object is durable before its batch commits),
in alternating order.  A pass with the phases timed apart (decode with the body CRC, sort, Parquet encode,
upload) says where a stager's time goes; passes of the stager before ``BodyViews`` (bodies copied
at decode, gathered again by the sort) alternate with them, and ``cpu_ratio_views`` is the CPU of
decode, sort and encode against theirs, medians of the passes.  No Spark: this is the floor of what one task can do,
and the tiering query's catch-up cannot beat its ratio.

``--driver`` stages each range as the driver stages a batch near the head (``stage_range``:
the range's record count too, as Spark would have counted it).  ``--no-uniq-key`` writes messages
without ``UNIQ_KEY``, whose message id is the broker's offset id, built at decode: as from
clients that set none, and the sustained benchmarks' generator.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time

import pyarrow as pa

from bench.common import report
from connectors.commitlog.arrow import dispatched_only
from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.workload import Workload, append_in_chunks
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.staging import StageSettings, read_rows, stage, stage_range


def ranges(directory: str, part_bytes: int) -> list[tuple[int, int, int]]:
    """(first, end, last record) of each part, cut at record boundaries and file ends."""
    out = []
    with CommitLogReader(directory) as reader:
        start = reader.first_offset()
        for span in reader.spans(start):
            i = 0
            while i < len(span.starts):
                first, size = span.starts[i], 0
                j = i
                while j < len(span.starts) and size < part_bytes:
                    size += span.sizes[j]
                    j += 1
                base = span.file.base
                out.append((base + first, base + span.starts[j - 1] + span.sizes[j - 1], base + span.starts[j - 1]))
                i = j
    return out


def copy_ranges(directory: str, target: str, parts) -> None:
    os.makedirs(target, exist_ok=True)
    with CommitLogReader(directory) as reader:
        for first, end, _ in parts:
            data = reader.read_bytes(first, end - first)
            with open(os.path.join(target, f"{first:020d}"), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())  # as durable as a staging object must be before its commit


def phases(directory: str, location: str, parts, *, views: bool = True) -> dict:
    """Seconds per phase of staging every part, timed apart, and the CPU of decode, sort and encode.

    ``views=False`` is the stager before ``BodyViews`` (the baseline of ``cpu_ratio_views``): bodies
    copied at decode, then gathered again by the sort."""
    out = {"decode": 0.0, "sort": 0.0, "encode": 0.0, "put": 0.0, "cpu_decode_sort_encode": 0.0}
    backend = open_backend(location)
    with CommitLogReader(directory, check_crc=True) as reader:
        for first, end, _ in parts:
            c0, t0 = time.process_time(), time.perf_counter()
            if views:
                table, held = read_rows(reader, first, end, "KEYS")
            else:
                table = dispatched_only(pa.Table.from_batches(list(reader.record_batches(first, end))))
            t1 = time.perf_counter()
            table = layout.sort_rows(table)
            t2 = time.perf_counter()
            data = layout.to_staging_parquet(held.bodies(table) if views else table)  # the bodies' copy: encode
            t3, c3 = time.perf_counter(), time.process_time()
            backend.put(f"_phases/{first:020d}.parquet", data)
            t4 = time.perf_counter()
            for k, a, b in (("decode", t0, t1), ("sort", t1, t2), ("encode", t2, t3), ("put", t3, t4),
                            ("cpu_decode_sort_encode", c0, c3)):
                out[k] += b - a
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--part-mb", type=int, default=32)
    ap.add_argument("--queues", type=int, default=64)
    ap.add_argument("--body", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--driver", action="store_true", help="stage as the driver does (stage_range)")
    ap.add_argument("--no-uniq-key", action="store_true", help="messages without UNIQ_KEY")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tierlog-stage-")
    log_dir = os.path.join(root, "log")
    w = Workload(messages=args.mb * (1 << 20) // (args.body + 200), topics=4, queues=args.queues // 4,
                 keys=100_000, body_size=args.body, delete_ratio=0.05, seed=7)
    messages = w.generate()
    if args.no_uniq_key:
        messages = (dataclasses.replace(m, properties={k: v for k, v in m.properties.items() if k != "UNIQ_KEY"})
                    for m in messages)
    with CommitLogWriter(log_dir, file_size=256 << 20, fsync="never") as writer:
        append_in_chunks(writer, messages)
    parts = ranges(log_dir, args.part_mb << 20)
    nbytes = sum(end - first for first, end, _ in parts)
    settings = StageSettings(location=os.path.join(root, "tier"), reader=ReaderOptions(log_dir))
    stage_s, copy_s = [], []
    for r in range(args.rounds):
        for kind in (("stage", "copy") if r % 2 == 0 else ("copy", "stage")):
            started = time.perf_counter()
            if kind == "stage":
                for first, end, last in parts:
                    if args.driver:
                        stage_range(settings, first, end)
                    else:
                        stage(settings, first, end, last)
                stage_s.append(time.perf_counter() - started)
            else:
                copy_ranges(log_dir, os.path.join(root, "tier", "_copy"), parts)
                copy_s.append(time.perf_counter() - started)
    with_views, copied = [], []  # alternating, as the rounds above
    for r in range(max(args.rounds, 2)):
        for views in ((True, False) if r % 2 == 0 else (False, True)):
            (with_views if views else copied).append(phases(log_dir, settings.location, parts, views=views))
    cpu = [p["cpu_decode_sort_encode"] for p in with_views], [p["cpu_decode_sort_encode"] for p in copied]
    shutil.rmtree(root, ignore_errors=True)
    ratios = [c / s for s, c in zip(stage_s, copy_s)]
    report({
        "benchmark": "stage", "bytes": nbytes, "parts": len(parts), "queues": args.queues, "body": args.body,
        "rounds": args.rounds, "messages": w.messages, "driver": args.driver, "uniq_key": not args.no_uniq_key,
        "stage_us_per_message": [round(s / w.messages * 1e6, 2) for s in stage_s],
        "stage_MBps": [round(nbytes / s / 1e6, 1) for s in stage_s],
        "copy_MBps": [round(nbytes / s / 1e6, 1) for s in copy_s],
        "ratio_per_round": [round(x, 3) for x in ratios], "ratio_median": round(statistics.median(ratios), 3),
        "phases_s": with_views[-1],
        "cpu_decode_sort_encode_s": cpu[0], "bodies_copied_at_decode_s": cpu[1],
        "cpu_ratio_views": round(statistics.median(cpu[0]) / statistics.median(cpu[1]), 3),
    })


if __name__ == "__main__":
    main()
