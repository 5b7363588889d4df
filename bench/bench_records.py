"""Applying one commit record over many queues: `./dev bench records`.

A batch record whose staging objects cover ``--queues`` queues (as a catch-up batch over every
queue of a broker writes), and a seal record of one segment per queue, applied to each queue's
state and manifest as the head (every commit) and a fold (every ``tier.fold_every`` records) do.
Measured: through ``by_queue`` (each queue gets only its own entries), against the baseline of the
same run, the whole record applied to each of its queues (what the head and the fold did before:
its cost grew with the queues squared).  Rounds alternate the order; medians.

    ./dev bench records [--queues 1024,4096] [--rounds 3]
"""

from __future__ import annotations

import argparse

from bench.common import alternating, report
from connectors.tier.manifest import apply_to_manifest, apply_to_state, by_queue, record_keys


def records(queues: int, objects: int = 2) -> list[dict]:
    """A batch record over ``queues`` queues in ``objects`` staging objects, then a seal of each queue."""
    keys = [(f"topic-{i // 1000}", i % 1000) for i in range(queues)]
    staging = [{"name": f"s{o}", "size": 1 << 20, "first_phy": o << 20, "time_ms": 1,
                "queues": [[t, q, {"first": o * 10, "last": o * 10 + 9, "rows": 10, "bytes": 10_000,
                                   "min_ts": 1, "max_ts": 2}] for t, q in keys]} for o in range(objects)]
    seal = [{"name": f"seg-{t}-{q}", "topic": t, "queue_id": q, "base": 0, "end": objects * 10 - 1,
             "rows": objects * 10, "size": 20_000, "min_ts": 1, "max_ts": 2, "keys": f"keys-{t}-{q}"} for t, q in keys]
    return [{"type": "batch", "seq": 1, "staging": staging}, {"type": "seal", "seq": 2, "retire": [], "segments": seal}]


def apply_by_queue(tail: list[dict]) -> int:
    states, manifests = {}, {}
    for record in tail:
        for key, part in by_queue(record).items():
            states[key] = apply_to_state(states.get(key), key, part)
            manifests[key] = apply_to_manifest(manifests.get(key), key, part)
    return len(manifests)


def apply_whole(tail: list[dict]) -> int:
    states, manifests = {}, {}
    for record in tail:
        for key in record_keys(record):
            states[key] = apply_to_state(states.get(key), key, record)
            manifests[key] = apply_to_manifest(manifests.get(key), key, record)
    return len(manifests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", default="1024,4096", help="comma-separated queue counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = {"benchmark": "records", "rounds": args.rounds,
           "method": "a batch record (2 staging objects over every queue) and a seal record (a segment per queue), "
                     "applied to every queue's state and manifest; baseline: the whole record applied to each "
                     "queue, same run, rounds alternating", "runs": []}
    for queues in (int(q) for q in args.queues.split(",")):
        tail = records(queues)
        timed = alternating({"by_queue": lambda: apply_by_queue(tail), "whole_record": lambda: apply_whole(tail)},
                            rounds=args.rounds)
        assert timed["by_queue"]["result"] == timed["whole_record"]["result"] == queues
        by, whole = timed["by_queue"]["median_s"], timed["whole_record"]["median_s"]
        out["runs"].append({"queues": queues, "by_queue_s": round(by, 4), "whole_record_s (baseline)": round(whole, 4),
                            "speedup": round(whole / by, 1)})
    report(out)


if __name__ == "__main__":
    main()
