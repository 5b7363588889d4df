"""The metadata store: the service's fast index of the tier, and the journal of its sinks, in
RocksDB (rocksdict).

The tier index (this class) holds, per queue, RocketMQ's *dispatch* offset (rows handed to upload)
and *commit* offset (rows durable in the tier and recorded), the sealed offset; the segment index;
the objects to delete; the quarantined ranges and what the tier's filter left out.  It changes only through the
tier writer (``apply`` takes in one commit record).  The journal (``state.journal``, ``.journal``)
holds each sink's applied physical offset, its health, what it skipped and what its filter left
out: what the queries write
as they go, apart from the tier's index.  Both live in one RocksDB so the tier's own progress is
written in the commit's WriteBatch.  Every change is one WriteBatch written with the WAL on and
synced, so a crash leaves either all of a commit or none of it.

It is an index, not the source of truth: the tier's commit log is.
``rebuild`` recreates it from the tier alone, and the service brings it up to
date with the log at every start.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Iterator

from rocksdict import WriteBatch

from connectors.errors import TierlogError
from connectors.tier.manifest import Segment, record_keys
from state import rocks
from state.tier_feed import TierFeed
from state.journal import SinkJournal

SEP = "\x00"
TABLE = "table" + SEP  # then a topic: its message table's state (``connectors.tables.messages``)


class MetadataError(TierlogError):
    """The metadata store cannot be opened or disagrees with the tier."""


class MetadataLockedError(MetadataError):
    """Another process has the metadata store open for writing (another `tierlog run`)."""


@dataclass(frozen=True)
class QueueOffsets:
    topic: str
    queue_id: int
    dispatch: int
    commit: int
    sealed: int
    low: int
    segments: int = 0


def _qkey(topic: str, queue_id: int) -> str:
    return f"q{SEP}{topic}{SEP}{queue_id:010d}"


def _segkey(topic: str, queue_id: int, base: int) -> str:
    return f"seg{SEP}{topic}{SEP}{queue_id:010d}{SEP}{base:020d}"


class MetadataStore:
    """Open with ``read_only=True`` to look while a service runs (``tierlog status``)."""

    def __init__(self, path: str, *, read_only: bool = False):
        self.path = path
        self.read_only = read_only
        if read_only and not rocks.exists(path):
            raise MetadataError(f"no metadata store at {path}: has `tierlog run` been started with this config?")
        try:
            self.db = rocks.open_rdict(path, read_only=read_only)
        except Exception as exc:  # rocksdict raises a plain Exception carrying RocksDB's message
            if "lock" in str(exc).lower():
                raise MetadataLockedError(
                    f"metadata store {path} is in use by another tierlog process (RocksDB lock held): "
                    "only one `tierlog run` may use a checkpoint directory; stop the other one first"
                ) from None
            raise MetadataError(f"cannot open metadata store {path}: {exc}") from None
        self._sync = rocks.synced_writes()
        self.journal = SinkJournal(self)
        self.feed = TierFeed(self)

    def close(self) -> None:
        self.db.close()

    def memory_bytes(self) -> int:
        """Memory the store's RocksDB holds: memtables, block cache, index and filter blocks."""
        return rocks.memory_bytes(self.db)

    # ------------------------------------------------------------ reading

    def get_json(self, key: str):
        raw = self.db.get(key)
        return None if raw is None else json.loads(raw)

    def prefix_json(self, prefix: str) -> Iterator[tuple[str, dict]]:
        for key, raw in self.db.items(from_key=prefix):
            if not key.startswith(prefix):
                break
            yield key, json.loads(raw)

    def last_seq(self) -> int:
        value = self.get_json("meta" + SEP + "last_seq")
        return -1 if value is None else value

    def source_end(self) -> int | None:
        return self.get_json("meta" + SEP + "source_end")

    def queues(self, topic: str | None = None, limit: int | None = None) -> list[QueueOffsets]:
        """Queues (of ``topic``) in name order, at most ``limit``: one read per queue listed."""
        out = []
        for key, v in self.prefix_json("q" + SEP + (topic + SEP if topic is not None else "")):
            if limit is not None and len(out) >= limit:
                break
            _, t, q = key.split(SEP)
            out.append(QueueOffsets(t, int(q), v["dispatch"], v["commit"], v["sealed"], v["low"], v.get("segments", 0)))
        return out

    def segments(self, topic: str, queue_id: int) -> list[Segment]:
        return list(self.oldest_segments(topic, queue_id))

    def oldest_segments(self, topic: str, queue_id: int) -> Iterator[Segment]:
        """A queue's retained segments, oldest first, read as the caller goes (retention stops early)."""
        prefix = f"seg{SEP}{topic}{SEP}{queue_id:010d}{SEP}"
        return (Segment.from_json(v) for _, v in self.prefix_json(prefix))

    def filtered(self) -> dict[str, dict[str, int]]:
        """Per sink, per topic class: messages its topic filter left out (counted as the tier commits)."""
        out: dict[str, dict[str, int]] = {}
        for key, n in self.prefix_json("filtered" + SEP):
            _, sink, cls = key.split(SEP)
            out.setdefault(sink, {})[cls] = n
        return out

    def quarantined(self) -> list[dict]:
        """Corrupt commitlog ranges skipped under ``commitlog.on_corrupt = "quarantine"``, in offset order."""
        return [v for _, v in self.prefix_json("quarantine" + SEP)]

    def held_from(self) -> int | None:
        """Retired staging objects at or above this physical offset are still to be read by a consumer
        of the tier (``state.tier_feed``); None: nothing is held."""
        return self.feed.held_from()

    def retention_holds(self) -> set[str]:
        """Topics the tier's retention must not drop segments of: the KV view keeps values there."""
        return self.journal.references()

    def pending_deletes(self) -> dict[str, float]:
        return {key.split(SEP, 1)[1]: v for key, v in self.prefix_json("del" + SEP)}

    def table_state(self, topic: str) -> dict | None:
        """What the message table of ``topic`` held at its last commit (``MessageTables``), and the
        table snapshot that was true of."""
        return self.get_json(TABLE + topic)

    def record_table_state(self, topic: str, state: dict) -> None:
        self.write_json({TABLE + topic: state})

    # ------------------------------------------------------------ writing

    def write_json(self, puts: dict[str, object], deletes: list[str] = ()) -> None:
        """``puts`` (as JSON) and ``deletes`` in one synced WriteBatch."""
        if self.read_only:
            raise MetadataError("metadata store opened read-only")
        wb = WriteBatch()
        for key, value in puts.items():
            wb.put(key, json.dumps(value))
        for key in deletes:
            wb.delete(key)
        self.db.write(wb, self._sync)

    def record_dispatch(self, offsets: dict[tuple[str, int], int]) -> None:
        """Queues whose rows up to ``offsets[key] - 1`` have been handed to upload."""
        puts = {}
        for (topic, q), dispatch in offsets.items():
            cur = self.get_json(_qkey(topic, q)) or {"commit": None, "sealed": None, "low": None, "dispatch": 0}
            cur["dispatch"] = max(cur["dispatch"], dispatch)
            puts[_qkey(topic, q)] = cur
        self.write_json(puts)

    def apply(self, head, record: dict, now: float, counted: dict | None = None) -> None:
        """Take in one commit record of the tier's log (``connectors.tier.records``), which ``head``
        (a ``TierHead``) has just applied, in one atomic, synced WriteBatch: the offsets of the
        queues it changes, the segments it seals or expires, the objects it retires (to delete once
        the grace after ``now`` has passed), the messages the tier's filter left out, and the
        corrupt ranges it skipped.  Everything of the tier comes from the record: a commit, a seal,
        an expiry and a catch-up after a crash are the same call, so they cannot disagree.
        ``counted``: what the other sinks' filters left out of a batch (the stagers count every
        sink's filter, where each message passes once), for the journal, in the same WriteBatch;
        the tier's record holds only its own."""
        kind = record["type"]
        segments = [Segment.from_json(d) for d in record.get("segments", ())]
        sealed = segments if kind == "seal" else []
        expired = segments if kind == "expire" else []
        deletes = {n: now for n in record.get("retire", ())} | {n: now for s in expired for n in (s.name, s.keys) if n}
        puts: dict[str, object] = {
            "meta" + SEP + "last_seq": head.seq,
            "meta" + SEP + "source_end": head.source_end,
        }
        if head.source_end is not None:
            puts["sink" + SEP + "tier"] = head.source_end
        for topic, q in record_keys(record):
            puts[_qkey(topic, q)] = self._queue_value(topic, q, head.queues[(topic, q)])
        for seg in sealed:
            puts[_segkey(seg.topic, seg.queue_id, seg.base)] = seg.to_json()
        for name, when in deletes.items():
            puts["del" + SEP + name] = when
        # A record written before the split holds every sink's counts: they are counted as before.
        for sink, by_class in [*(record.get("filtered") or {}).items(), *(counted or {}).items()]:
            for cls, n in by_class.items():
                key = f"filtered{SEP}{sink}{SEP}{cls}"
                puts[key] = (puts.get(key) or self.get_json(key) or 0) + n
        puts.update(self._quarantine_puts(record.get("quarantined", ())))
        puts.update(self.feed.puts(record))
        self.write_json(puts, [_segkey(s.topic, s.queue_id, s.base) for s in expired])

    def _queue_value(self, topic: str, q: int, state) -> dict:
        cur = self.get_json(_qkey(topic, q)) or {}
        return {"dispatch": max(cur.get("dispatch") or 0, state.commit), "commit": state.commit,
                "sealed": state.sealed, "low": state.low, "segments": state.segments, "bytes": state.bytes}

    def schedule_deletes(self, deletes: dict[str, float]) -> None:
        """Objects to delete once the grace period after ``when`` has passed."""
        self.write_json({"del" + SEP + name: when for name, when in deletes.items()})

    @staticmethod
    def _quarantine_puts(ranges) -> dict[str, dict]:
        """Corrupt ranges a batch skipped (``file``, ``start_phy``, ``end_phy``, ``reason``); a replay rewrites them."""
        return {f"quarantine{SEP}{r['start_phy']:020d}": {**r, "at": time.time()} for r in ranges}

    def forget_deletes(self, names: list[str]) -> None:
        self.write_json({}, ["del" + SEP + n for n in names])

    def rebuild(self, committed) -> None:
        """Replace everything tier-derived with what ``committed`` (a ``CommittedTier`` of the tier) says,
        quarantined commitlog ranges included.  Reads the whole tier: an offline repair.  The feed's
        listing is dropped (the tier's log no longer says which batches a consumer lacks): a
        consumer behind it is told so when it reads (``state.tier_feed.FeedGapError``)."""
        stale = [k for k in self.db.keys()
                 if k.startswith(("q" + SEP, "seg" + SEP, "meta" + SEP, "quarantine" + SEP, f"filtered{SEP}tier{SEP}",
                                  "feed" + SEP, TABLE))]
        self.write_json({}, stale)
        for key in committed.queue_keys():
            self.write_json({_qkey(*key): self._queue_value(*key, committed.state_of(key)),
                         **{_segkey(*key, s.base): s.to_json() for s in committed.segments_for(key)}})
        self.write_json({"meta" + SEP + "last_seq": committed.seq, "meta" + SEP + "source_end": committed.source_end,
                     **({"sink" + SEP + "tier": committed.source_end} if committed.source_end is not None else {})})
        self.write_json(self._quarantine_puts(committed.quarantined.values()))
        # The other sinks' counts are the journal's, not the tier's: they stay.
        self.write_json({f"filtered{SEP}tier{SEP}{cls}": n for cls, n in committed.filtered.get("tier", {}).items()})
