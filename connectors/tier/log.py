"""The tier's commit log: which objects are visible, and the committed offsets.

A commit record is one small JSON object, written with the backend's atomic
``put`` under ``_log/``.  Records are numbered 0, 1, 2, ...; an object is
visible exactly when a record that adds it is, and stops being visible when a
later record removes it.  Readers trust nothing else: an object in the tier
that no record names (an upload whose commit never happened) is invisible.

Record types:

``batch``   staging objects of one micro-batch, and each queue's new commit offset
``seal``    segments sealed from staging data, and the staging objects they retire
``expire``  segments removed by retention

A ``checkpoint`` holds the whole state at some seq, so the log can be
compacted: readers start from the newest checkpoint and apply what follows.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from connectors.tier import layout
from connectors.tier.backend import Backend
from connectors.tier.errors import ObjectNotFound, TierLogError

QueueKey = tuple[str, int]


@dataclass
class StagingObject:
    """One committed staging object and, per queue, the queue offsets and store times it holds."""

    name: str
    size: int
    first_phy: int
    queues: dict[QueueKey, dict]  # first, last, rows, bytes, min_ts, max_ts
    time_ms: int = 0  # when it was committed; sealing by age counts from here, not from store times

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "first_phy": self.first_phy, "time_ms": self.time_ms,
                "queues": [[t, q, v] for (t, q), v in sorted(self.queues.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "StagingObject":
        return cls(d["name"], d["size"], d["first_phy"], {(t, q): v for t, q, v in d["queues"]}, d.get("time_ms", 0))


@dataclass
class Segment:
    """A sealed segment: queue offsets ``base`` .. ``end`` (inclusive) of one queue."""

    name: str
    topic: str
    queue_id: int
    base: int
    end: int
    rows: int
    size: int
    min_ts: int
    max_ts: int
    keys: str | None = None  # its key index object; None for segments sealed before there were any

    @property
    def dense(self) -> bool:
        """Every offset from base to end is present, as sealing writes them: row i holds base + i."""
        return self.rows == self.end - self.base + 1

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k != "keys"}

    @classmethod
    def from_json(cls, d: dict) -> "Segment":
        return cls(**d)


@dataclass
class QueueState:
    commit: int = 0  # next queue offset to be committed (everything below is in the tier)
    sealed: int = 0  # next queue offset to be sealed (everything below is in segments)
    low: int = 0  # lowest queue offset still retained in the tier

    def to_json(self) -> dict:
        return {"commit": self.commit, "sealed": self.sealed, "low": self.low}


@dataclass
class TierState:
    """The committed view of a tier, as of commit record ``seq``."""

    seq: int = -1
    source_end: int | None = None  # physical offset just past the last committed message
    last_batch_id: int = -1
    queues: dict[QueueKey, QueueState] = field(default_factory=dict)
    staging: dict[str, StagingObject] = field(default_factory=dict)
    segments: dict[str, Segment] = field(default_factory=dict)
    # Corrupt commitlog ranges batches skipped (commitlog.on_corrupt = quarantine), by start offset:
    # kept here so `tier rebuild-metadata` restores them with everything else.
    quarantined: dict[int, dict] = field(default_factory=dict)

    # ------------------------------------------------------------ applying records

    def apply(self, record: dict) -> None:
        seq = record["seq"]
        if seq != self.seq + 1:
            raise TierLogError(f"commit record {seq} follows {self.seq}: the tier's commit log has a gap")
        kind = record["type"]
        if kind == "batch":
            for obj in record["staging"]:
                s = StagingObject.from_json(obj)
                self.staging[s.name] = s
                for key, stats in s.queues.items():
                    q = self.queues.setdefault(key, QueueState(commit=stats["first"], sealed=stats["first"], low=stats["first"]))
                    q.commit = max(q.commit, stats["last"] + 1)
            for q in record.get("quarantined", ()):
                self.quarantined[q["start_phy"]] = q
            self.source_end = record["source_end"]
            self.last_batch_id = record["batch_id"]
        elif kind == "seal":
            for d in record["segments"]:
                seg = Segment.from_json(d)
                self.segments[seg.name] = seg
                q = self.queues[(seg.topic, seg.queue_id)]
                q.sealed = max(q.sealed, seg.end + 1)
            for name in record["retire"]:
                self.staging.pop(name, None)
        elif kind == "expire":
            for name in record["segments"]:
                seg = self.segments.pop(name, None)
                if seg is not None:
                    q = self.queues[(seg.topic, seg.queue_id)]
                    q.low = max(q.low, seg.end + 1)
        else:
            raise TierLogError(f"commit record {seq} has unknown type {kind!r}")
        self.seq = seq

    # ------------------------------------------------------------ (de)serialising

    def to_json(self) -> dict:
        return {
            "seq": self.seq,
            "source_end": self.source_end,
            "last_batch_id": self.last_batch_id,
            "queues": [[t, q, s.to_json()] for (t, q), s in sorted(self.queues.items())],
            "staging": [s.to_json() for s in self.staging.values()],
            "segments": [s.to_json() for s in self.segments.values()],
            "quarantined": [q for _, q in sorted(self.quarantined.items())],
        }

    @classmethod
    def from_json(cls, d: dict) -> "TierState":
        return cls(
            seq=d["seq"],
            source_end=d["source_end"],
            last_batch_id=d["last_batch_id"],
            queues={(t, q): QueueState(**s) for t, q, s in d["queues"]},
            staging={s["name"]: StagingObject.from_json(s) for s in d["staging"]},
            segments={s["name"]: Segment.from_json(s) for s in d["segments"]},
            quarantined={q["start_phy"]: q for q in d.get("quarantined", ())},  # absent in older checkpoints
        )

    # ------------------------------------------------------------ questions readers ask

    def staging_for(self, key: QueueKey) -> list[StagingObject]:
        """Committed staging objects holding unsealed rows of queue ``key``, oldest first."""
        sealed = self.queues[key].sealed if key in self.queues else 0
        return sorted(
            (s for s in self.staging.values() if key in s.queues and s.queues[key]["last"] >= sealed),
            key=lambda s: s.first_phy,
        )

    def segments_for(self, key: QueueKey) -> list[Segment]:
        return sorted((s for s in self.segments.values() if (s.topic, s.queue_id) == key), key=lambda s: s.base)


class TierLog:
    """Reads and appends the commit log of one tier.  Only one process appends (see the metadata lock)."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def _listing(self) -> tuple[list[int], list[int]]:
        records, checkpoints = [], []
        for obj in self.backend.list(layout.LOG_PREFIX):
            parsed = layout.parse_log_name(obj.name)
            if parsed:
                (checkpoints if parsed[1] else records).append(parsed[0])
        return sorted(records), sorted(checkpoints)

    def read_state(self, *, attempts: int = 5) -> TierState:
        """The committed state: the newest checkpoint plus every record after it.

        A compaction running at the same time may delete what was just listed;
        the read is then started again.
        """
        for attempt in range(attempts):
            try:
                return self._read_state_once()
            except ObjectNotFound:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _read_state_once(self) -> TierState:
        records, checkpoints = self._listing()
        state = TierState()
        if checkpoints:
            data = json.loads(self.backend.read(layout.checkpoint_name(checkpoints[-1])))
            state = TierState.from_json(data["state"])
        for seq in records:
            if seq <= state.seq:
                continue
            state.apply(json.loads(self.backend.read(layout.log_name(seq))))
        return state

    def append(self, state: TierState, record: dict) -> int:
        """Write ``record`` as the next commit record and apply it to ``state``; returns its seq.

        The record is checked against ``state`` first, so a bad record is never written.
        """
        record = {**record, "seq": state.seq + 1, "time_ms": int(time.time() * 1000)}
        probe = TierState.from_json(state.to_json())
        probe.apply(record)
        self.backend.put(layout.log_name(record["seq"]), json.dumps(record, separators=(",", ":")).encode())
        state.apply(record)
        return record["seq"]

    def compact(self, state: TierState) -> None:
        """Write a checkpoint of ``state`` and delete the records and checkpoints it replaces."""
        self.backend.put(
            layout.checkpoint_name(state.seq),
            json.dumps({"type": "checkpoint", "state": state.to_json()}, separators=(",", ":")).encode(),
        )
        records, checkpoints = self._listing()
        for seq in records:
            if seq <= state.seq:
                self.backend.delete(layout.log_name(seq))
        for seq in checkpoints:
            if seq < state.seq:
                self.backend.delete(layout.checkpoint_name(seq))
