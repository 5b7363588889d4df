"""Tier metadata cost against the tier's history: `./dev bench metadata`.

Builds tiers of 1k, 10k, 100k and 1M segments over the same 1,000 queues (history grows, queues
do not), plus 1M segments over 100k queues, all through the product's own commit path
(``TierLog.append`` and ``TierLog.checkpoint``, as the tiering query calls them).  Segment
records are synthetic; the few segments a measured read opens are real Parquet objects with
their key indexes.  Then, in rounds that alternate the order of the tiers, it measures:

- ``commit_batch_s``: one batch record over 64 queues (check, write, apply);
- ``commit_seal_s``: one seal record of 64 segments;
- ``checkpoint_s``: folding those two records into manifests and a new root;
- ``reader_get_s``: a new ``TierReader`` (cold caches) and ``get`` of 5 messages of one queue,
  from the middle of its history, Parquet reads included;
- ``offset_for_time_s``: a new reader and ``offset_for_time`` in the middle of a queue's history;
- ``by_key_s``: a new reader and ``by_key`` over one topic (4 queues) in a 10 s store-time window;
- ``head_open_s`` / ``head_mb``: what a restarting service reads and holds (``open_head``),
  Python heap peak by tracemalloc.

Every figure is the median of the rounds, and its ratio against the 1k-segment tier of the same
run.  The 100k-queue tier's head is O(queues) by design (every queue's offsets); its other
figures show what 100 times more queues cost.

    ./dev bench metadata [--rounds 5] [--sizes 1000,10000,100000,1000000] [--queues 1000] [--wide 100000]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
import tracemalloc

import pyarrow as pa

from bench.common import report
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.log import TierLog
from connectors.tier.reader import TierReader
from connectors.brokers import DEFAULT_BROKER

NAMES = layout.Names(DEFAULT_BROKER)  # the names of a one-broker tier

T0 = 1_700_000_000_000
ROWS = 10  # messages per segment; store time = T0 + offset seconds
QUEUES_PER_TOPIC = 4
RECORD_QUEUES = 1000  # queues per record while building
MEASURED_QUEUES = 64


def key_of(i: int) -> tuple[str, int]:
    return f"t{i // QUEUES_PER_TOPIC}", i % QUEUES_PER_TOPIC


def segment(key, index: int) -> dict:
    base = index * ROWS
    return {"name": NAMES.segment(*key, base), "topic": key[0], "queue_id": key[1], "base": base,
            "end": base + ROWS - 1, "rows": ROWS, "size": 4096, "min_ts": T0 + base * 1000,
            "max_ts": T0 + (base + ROWS - 1) * 1000, "keys": NAMES.key_index(*key, base)}


def staging_object(keys, index: int, phy: int) -> dict:
    base = index * ROWS
    stats = [[t, q, {"first": base, "last": base + ROWS - 1, "rows": ROWS, "bytes": ROWS * 400,
                     "min_ts": T0 + base * 1000, "max_ts": T0 + (base + ROWS - 1) * 1000}] for t, q in keys]
    return {"name": NAMES.staging(phy), "size": 1 << 20, "first_phy": phy, "time_ms": T0, "queues": stats}


class Tier:
    """One tier, built through TierLog, and the head the 'service' keeps on it."""

    def __init__(self, root: str, segments: int, queues: int):
        self.location = os.path.join(root, f"tier-{segments}-{queues}")
        self.segments, self.queues = segments, queues
        self.log = TierLog(open_backend(self.location))
        self.head = self.log.open_head()
        self.per_queue = segments // queues
        self.phy = 0
        self.batch_id = 0
        started = time.perf_counter()
        keys = [key_of(i) for i in range(queues)]
        records_since = 0
        for index in range(self.per_queue):
            for lo in range(0, queues, RECORD_QUEUES):
                chunk = keys[lo:lo + RECORD_QUEUES]
                self._commit(chunk, index)
                records_since += 2
                if records_since >= 200 and queues <= 10_000:
                    self.log.fold(self.head)
                    records_since = 0
        self.log.fold(self.head)
        self.build_s = time.perf_counter() - started
        self.probe = key_of(1)  # its topic's queues hold real objects around the middle of history
        self.middle = self.per_queue // 2
        self._write_real_objects()

    def _commit(self, keys, index: int) -> None:
        self.log.append(self.head, {"type": "batch", "batch_id": self.batch_id, "source_start": self.phy,
                                    "source_end": self.phy + 1000, "staging": [staging_object(keys, index, self.phy)]})
        self.log.append(self.head, {"type": "seal", "segments": [segment(k, index) for k in keys],
                                    "retire": [NAMES.staging(self.phy)]})
        self.phy += 1000
        self.batch_id += 1

    def _write_real_objects(self) -> None:
        backend = self.log.backend
        for key, index in [((self.probe[0], q), self.middle) for q in range(QUEUES_PER_TOPIC)]:
            seg = segment(key, index)
            offsets = list(range(seg["base"], seg["end"] + 1))
            rows = {c: [None] * ROWS for c in MESSAGE_SCHEMA.names}
            rows.update(topic=[key[0]] * ROWS, queue_id=[key[1]] * ROWS, queue_offset=offsets, phy_offset=offsets,
                        key=[f"k{o % 7}" for o in offsets], body=[b"x" * 100] * ROWS,
                        store_ts=[(T0 + o * 1000) * 1000 for o in offsets],  # microseconds
                        born_ts=[(T0 + o * 1000) * 1000 for o in offsets],
                        size=[200] * ROWS, sysflag=[0] * ROWS, properties=[[]] * ROWS)
            table = pa.table({c: pa.array(rows[c], MESSAGE_SCHEMA.field(c).type) for c in MESSAGE_SCHEMA.names})
            backend.put(seg["name"], layout.to_parquet(table))
            backend.put(seg["keys"], layout.key_index(table))

    # ------------------------------------------------------------ the measured steps

    def commit_and_checkpoint(self, rng) -> tuple[float, float, float]:
        """A batch and a seal over 64 queues (never the probe's topic), then a checkpoint."""
        keys = [key_of(i) for i in rng.sample(range(QUEUES_PER_TOPIC, self.queues), MEASURED_QUEUES)]
        index = max(self.head.queues[k].commit for k in keys) // ROWS
        t0 = time.perf_counter()
        self.log.append(self.head, {"type": "batch", "batch_id": self.batch_id, "source_start": self.phy,
                                    "source_end": self.phy + 1000,
                                    "staging": [staging_object(keys, index, self.phy)]})
        t1 = time.perf_counter()
        self.log.append(self.head, {"type": "seal", "segments": [segment(k, index) for k in keys],
                                    "retire": [NAMES.staging(self.phy)]})
        t2 = time.perf_counter()
        self.log.fold(self.head)
        t3 = time.perf_counter()
        self.phy += 1000
        self.batch_id += 1
        return t1 - t0, t2 - t1, t3 - t2

    def reader_get(self) -> float:
        t = time.perf_counter()
        result = TierReader(self.location).get(*self.probe, self.middle * ROWS + 3, 5)
        elapsed = time.perf_counter() - t
        assert result.messages["queue_offset"].to_pylist() == list(range(self.middle * ROWS + 3, self.middle * ROWS + 8))
        return elapsed

    def offset_for_time(self) -> float:
        t = time.perf_counter()
        offset = TierReader(self.location).offset_for_time(*self.probe, T0 + (self.middle * ROWS + 5) * 1000)
        elapsed = time.perf_counter() - t
        assert offset == self.middle * ROWS + 5, offset
        return elapsed

    def by_key(self) -> float:
        base = self.middle * ROWS
        t = time.perf_counter()
        rows = TierReader(self.location).by_key(self.probe[0], "k3", T0 + base * 1000, T0 + (base + ROWS - 1) * 1000)
        elapsed = time.perf_counter() - t
        assert rows.num_rows >= QUEUES_PER_TOPIC, rows.num_rows
        return elapsed

    def head_open(self) -> tuple[float, float]:
        tracemalloc.start()
        t = time.perf_counter()
        head = TierLog(open_backend(self.location)).open_head()
        elapsed = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert head.seq == self.head.seq
        return elapsed, peak / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000", help="segment counts over --queues queues")
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--wide", type=int, default=100_000, help="queues of one more 1M-segment tier (0: none)")
    parser.add_argument("--dir", default=None, help="where to build the tiers (default: a temporary directory)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-metadata-", dir=args.dir)
    try:
        shapes = [(int(s), args.queues) for s in args.sizes.split(",")]
        if args.wide:
            shapes.append((max(s for s, _ in shapes), args.wide))
        tiers = [Tier(root, s, q) for s, q in shapes]
        rng = random.Random(0)
        samples = {id(t): {k: [] for k in ("commit_batch_s", "commit_seal_s", "checkpoint_s", "reader_get_s",
                                           "offset_for_time_s", "by_key_s", "head_open_s", "head_mb")} for t in tiers}
        for r in range(args.rounds):
            for tier in tiers if r % 2 == 0 else reversed(tiers):
                s = samples[id(tier)]
                batch, seal, checkpoint = tier.commit_and_checkpoint(rng)
                s["commit_batch_s"].append(batch)
                s["commit_seal_s"].append(seal)
                s["checkpoint_s"].append(checkpoint)
                s["reader_get_s"].append(tier.reader_get())
                s["offset_for_time_s"].append(tier.offset_for_time())
                s["by_key_s"].append(tier.by_key())
                opened, mb = tier.head_open()
                s["head_open_s"].append(opened)
                s["head_mb"].append(mb)
        base = {k: statistics.median(v) for k, v in samples[id(tiers[0])].items()}
        rows = []
        for tier in tiers:
            med = {k: statistics.median(v) for k, v in samples[id(tier)].items()}
            rows.append({"segments": tier.segments, "queues": tier.queues, "build_s": round(tier.build_s, 1),
                         **{k: round(v, 5) for k, v in med.items()},
                         "ratio_vs_first": {k: round(v / base[k], 2) for k, v in med.items() if base[k]}})
        report({"benchmark": "metadata", "rounds": args.rounds, "baseline": f"{shapes[0][0]} segments over "
                f"{shapes[0][1]} queues, measured in the same run", "tiers": rows})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
