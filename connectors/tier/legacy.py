"""The first tier layout, read only to upgrade a tier in place.

That layout kept the whole committed state in one object: a checkpoint
(``_log/<seq>.checkpoint.json``) plus every commit record after it, each applied to
an in-memory copy of everything.  It cost O(history) per commit and per read, which
is why it was replaced (``connectors.tier.manifest``).  ``read_state`` reads such a
tier once, whole, so ``TierLog.upgrade`` can write it again as manifests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from connectors.tier import layout
from connectors.tier.errors import TierRecordError
from connectors.tier.manifest import QueueKey, Segment, StagingObject


@dataclass
class LegacyQueue:
    commit: int = 0
    sealed: int = 0
    low: int = 0


@dataclass
class LegacyState:
    seq: int = -1
    source_end: int | None = None
    last_batch_id: int = -1
    queues: dict[QueueKey, LegacyQueue] = field(default_factory=dict)
    staging: dict[str, StagingObject] = field(default_factory=dict)
    segments: dict[str, Segment] = field(default_factory=dict)
    quarantined: dict[int, dict] = field(default_factory=dict)

    def apply(self, record: dict) -> None:
        seq = record["seq"]
        if seq != self.seq + 1:
            raise TierRecordError(f"commit record {seq} follows {self.seq}: the tier's commit log has a gap")
        kind = record["type"]
        if kind == "batch":
            for obj in record["staging"]:
                s = StagingObject.from_json(obj)
                self.staging[s.name] = s
                for key, stats in s.queues.items():
                    q = self.queues.setdefault(key, LegacyQueue(stats["first"], stats["first"], stats["first"]))
                    q.commit = max(q.commit, stats["last"] + 1)
            for q in record.get("quarantined", ()):
                self.quarantined[q["start_phy"]] = q
            self.source_end = record["source_end"]
            self.last_batch_id = record["batch_id"]
        elif kind == "seal":
            for d in record["segments"]:
                seg = Segment.from_json(d)
                self.segments[seg.name] = seg
                q = self.queues[seg.key]
                q.sealed = max(q.sealed, seg.end + 1)
            for name in record["retire"]:
                self.staging.pop(name, None)
        elif kind == "expire":
            for name in record["segments"]:
                seg = self.segments.pop(name, None)
                if seg is not None:
                    q = self.queues[seg.key]
                    q.low = max(q.low, seg.end + 1)
        else:
            raise TierRecordError(f"commit record {seq} has unknown type {kind!r}")
        self.seq = seq

    @classmethod
    def from_json(cls, d: dict) -> "LegacyState":
        return cls(
            seq=d["seq"], source_end=d["source_end"], last_batch_id=d["last_batch_id"],
            queues={(t, q): LegacyQueue(s["commit"], s["sealed"], s["low"]) for t, q, s in d["queues"]},
            staging={s["name"]: StagingObject.from_json(s) for s in d["staging"]},
            segments={s["name"]: Segment.from_json(s) for s in d["segments"]},
            quarantined={q["start_phy"]: q for q in d.get("quarantined", ())},
        )


def read_state(backend, records: list[int], checkpoints: list[int]) -> LegacyState:
    """The whole state of a first-layout tier: its newest checkpoint and the records after it."""
    state, names = LegacyState(), layout.Names(None)  # the first layout predates brokers
    if checkpoints:
        state = LegacyState.from_json(json.loads(backend.read(names.legacy_checkpoint(checkpoints[-1])))["state"])
    for seq in records:
        if seq > state.seq:
            state.apply(json.loads(backend.read(names.log(seq))))
    return state
