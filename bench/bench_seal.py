"""A seal on a quiet broker: every queue sealed by age at once, from many small staging objects,
against the same messages in a few large ones, in one process (``TierWriter`` alone, no Spark).

    ./dev bench seal [--objects 600] [--per 100] [--large 6] [--queues 64] [--rounds 3]

A quiet broker's tiering query commits a staging object a trigger, each holding a few messages
of every queue; ``tier.segment_age_s`` (600 s) later every queue is due by age and one
maintenance seals them all, reading every one of those objects.  Each round builds two tiers of
the same ``--objects`` x ``--per`` messages of 1 KiB over ``--queues`` queues: one committed as
``--objects`` staging objects, the baseline as ``--large``; then times ``TierWriter.maintain``
sealing every queue of each (CPU and wall; folds are off, so the figure is the seal and its
commit), in alternating order.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from bench.common import report
from connectors.commitlog.reader import CommitLogReader, ReaderOptions
from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.staging import CommitLogGaps, StageSettings, stage_range
from connectors.tier.writer import TierWriter, WriterSettings
from state.metadata import MetadataStore


def build(root: str, log_dir: str, bounds: list[tuple[int, int]], objects: int) -> TierWriter:
    """A tier of the log's records committed as ``objects`` staging objects of equal counts."""
    store = MetadataStore(f"{root}/metadata")
    writer = TierWriter(WriterSettings(location=f"{root}/tier", segment_age_s=1.0, fold_every=10**9,
                                       fold_bytes=1 << 50), store)
    stage_settings = StageSettings(location=f"{root}/tier", reader=ReaderOptions(log_dir))
    gaps = CommitLogGaps(ReaderOptions(log_dir))
    per = len(bounds) // objects
    for b in range(objects):
        first, last = bounds[b * per], bounds[min(len(bounds), (b + 1) * per) - 1]
        part, _ = stage_range(stage_settings, first[0], last[0] + last[1])
        writer.commit(b, [part], gaps.between)
    return writer


def seal_all(root: str, log_dir: str, bounds, objects: int) -> dict:
    writer = build(root, log_dir, bounds, objects)
    try:
        queues = len(writer.head.unsealed())
        cpu, wall = time.process_time(), time.monotonic()
        seals = writer.maintain(int(time.time() * 1000) + 60_000)
        out = {"cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall, "seals": seals}
    finally:
        writer.close()
        writer.index.close()
    assert seals == queues, (seals, queues)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=600, help="small staging objects (default 600)")
    parser.add_argument("--per", type=int, default=100, help="messages per small object (default 100)")
    parser.add_argument("--large", type=int, default=6, help="staging objects of the baseline (default 6)")
    parser.add_argument("--queues", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tierlog-bench-seal-")
    try:
        log_dir = f"{work}/commitlog"
        with CommitLogWriter(log_dir, file_size=256 << 20, fsync="never") as w:
            for m in Workload(messages=args.objects * args.per, topics=1, queues=args.queues, keys=100_000,
                              body_size=1024, seed=1).generate():
                w.append(m)
        with CommitLogReader(log_dir) as reader:
            bounds = [(s + span.file.base, size) for span in reader.spans(0, reader.end_offset())
                      for s, size in zip(span.starts, span.sizes)]
        runs: dict[str, list[dict]] = {"small": [], "large": []}
        for r in range(args.rounds):
            for name in (("small", "large") if r % 2 == 0 else ("large", "small")):
                root = f"{work}/{name}-{r}"
                runs[name].append(seal_all(root, log_dir, bounds, args.objects if name == "small" else args.large))
                shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {n: {k: round(statistics.median(x[k] for x in v), 3) for k in ("cpu_s", "wall_s")} for n, v in runs.items()}
    report({"benchmark": "seal", "messages": args.objects * args.per, "queues": args.queues,
            "small_objects": args.objects, "large_objects": args.large,
            "rounds": {n: [{k: round(x[k], 3) for k in ("cpu_s", "wall_s")} for x in v] for n, v in runs.items()},
            "seal_cpu_s": med["small"]["cpu_s"], "baseline_cpu_s": med["large"]["cpu_s"],
            "ratio": round(med["small"]["cpu_s"] / max(1e-9, med["large"]["cpu_s"]), 2)})


if __name__ == "__main__":
    main()
