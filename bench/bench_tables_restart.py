"""The first table syncs of a new process on a large tier, against a fresh small tier.

    ./dev bench tables_restart [--topics 1000] [--queues 20] [--segments 3] [--batches 30] [--rounds 2]

The large tier holds ``topics x queues x segments`` sealed segments (60,000 over 20,000 queues by
default), every one registered in its topic's message table.  A new process (a new
``MessageTables``) then keeps the tables in step while batches go on: each batch seals one segment
in each of 4 topics, and its ``sync`` call is timed, the call ``TierWriter.maintain`` makes after
every batch.  Two restarts are measured:

- ``tail``: the tier's log still holds every record since the tables' own (``tierlog.tier-seq``),
  so each table takes the changes since from the log, with no manifest read;
- ``folded``: those records were folded away, so each table is diffed against the tier.

The baseline, in the same run and alternating with them, is a fresh small tier (10 topics x 2
queues) whose process has been syncing all along: the same batches, the same 4 topics a batch.
Reported: mean and max seconds per ``sync`` call over the first ``--batches`` batches, the ratio of
the means to the baseline's, and how many calls and seconds the restart took until every table was
in step (the reconciliation goes on in later calls, ``RECONCILE_BUDGET_S`` of work per call).
Not in the figure: the writer's own commit and maintenance, the same on both tiers (the tier's
segment list here comes from memory; the writer reads it from its index).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench.bench_tables import segment_file
from bench.common import report
from connectors.tables.catalog import default_settings
from connectors.tables.messages import MessageTables
from connectors.tier import layout
from connectors.tier.manifest import Segment

BROKER = "broker-a"
PER_BATCH = 4  # topics sealed by each batch


class Tier:
    """Segment files on disk, the tier's records, and each topic's committed segments."""

    def __init__(self, root: str, topics: int, queues: int, segments: int):
        self.root, self.queues = root, queues
        self.location = os.path.join(root, "tier")
        self.names = layout.Names(BROKER)
        self.topics = [f"t{i:05d}" for i in range(topics)]
        self.segments: dict[str, list[Segment]] = {t: [] for t in self.topics}
        self.next_base: dict[tuple[str, int], int] = {}
        self.records: list[dict] = []
        for topic in self.topics:
            for queue in range(queues):
                for _ in range(segments):
                    self._new_segment(topic, queue)
        self.seq = 0
        self.settings = default_settings(self.location, os.path.join(root, "state"))
        started = time.perf_counter()
        MessageTables(self.settings, self.location, BROKER).rebuild(self.seq, self.all_segments())
        self.registered_s = time.perf_counter() - started

    def _new_segment(self, topic: str, queue: int) -> Segment:
        base = self.next_base.get((topic, queue), 0)
        seg = segment_file(self.location, self.names, queue, base, rows=5, topic=topic)
        self.next_base[(topic, queue)] = base + 5
        self.segments[topic].append(seg)
        return seg

    def all_segments(self):
        return [s for t in self.topics for s in self.segments[t]]

    def batch(self, i: int) -> None:
        """Seal one segment in each of ``PER_BATCH`` topics: a new tier record."""
        topics = [self.topics[(i * PER_BATCH + k) % len(self.topics)] for k in range(PER_BATCH)]
        segs = [self._new_segment(t, i % self.queues) for t in topics]
        self.seq += 1
        self.records.append({"seq": self.seq, "type": "seal", "segments": [s.to_json() for s in segs], "retire": []})

    def sync(self, tables: MessageTables, tail_from: int) -> tuple[float, bool]:
        tail = [r for r in self.records if r["seq"] >= tail_from]
        started = time.perf_counter()
        in_step = tables.sync(self.seq, tail, lambda: self.topics, lambda t: self.segments[t])
        return time.perf_counter() - started, in_step


def run_case(tier: Tier, batches: int, restart: str | None, tables: MessageTables | None = None) -> dict:
    """``batches`` timed batches; with ``restart``, a new process first, then on until in step."""
    tables = tables or MessageTables(tier.settings, tier.location, BROKER)
    tail_from = 1 if restart != "folded" else tier.seq + 1  # folded: the log keeps only what comes now
    seconds, calls, total, in_step = [], 0, 0.0, False
    while calls < batches or (restart and not in_step):
        tier.batch(calls)
        took, in_step = tier.sync(tables, tail_from)
        calls += 1
        total += took
        if calls <= batches:
            seconds.append(took)
        if calls > 100_000:
            raise RuntimeError("the tables never came in step")
    out = {"mean_s": round(statistics.mean(seconds), 4), "max_s": round(max(seconds), 4),
           "median_s": round(statistics.median(seconds), 4)}
    if restart:
        out.update(calls_until_in_step=calls, seconds_until_in_step=round(total, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--queues", type=int, default=20, help="queues per topic")
    ap.add_argument("--segments", type=int, default=3, help="sealed segments per queue")
    ap.add_argument("--batches", type=int, default=30, help="timed batches after each restart")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tables-restart-") as root:
        large = Tier(os.path.join(root, "large"), args.topics, args.queues, args.segments)
        small = Tier(os.path.join(root, "small"), 10, 2, args.segments)
        small_tables = MessageTables(small.settings, small.location, BROKER)
        run_case(small, 3, None, small_tables)  # its process has been syncing all along
        rounds = []
        for r in range(args.rounds):
            cases = [("fresh_small", lambda: run_case(small, args.batches, None, small_tables)),
                     ("large_tail", lambda: run_case(large, args.batches, "tail")),
                     ("large_folded", lambda: run_case(large, args.batches, "folded"))]
            if r % 2:
                cases.reverse()
            rounds.append({name: case() for name, case in cases})
    mean = {name: statistics.mean(r[name]["mean_s"] for r in rounds) for name in rounds[0]}
    report({"bench": "tables_restart", "segments": len(large.all_segments()), "queues": args.topics * args.queues,
            "tables": args.topics, "registered_in_s": round(large.registered_s, 1), "rounds": rounds,
            "tail_over_fresh_small": round(mean["large_tail"] / mean["fresh_small"], 2),
            "folded_over_fresh_small": round(mean["large_folded"] / mean["fresh_small"], 2),
            "method": f"seconds per MessageTables.sync call (the tables part of TierWriter.maintain) over the "
                      f"first {args.batches} batches of {PER_BATCH} seals each after a new process opens the "
                      "tables of the large tier, against a small tier's process syncing all along; rounds "
                      "alternate the order"})


if __name__ == "__main__":
    main()
