"""``CommittedTier``: the committed state of a tier as one reader sees it, loaded as it is asked.

A committed tier is the newest root and the commit records after it.  Nothing per queue is read until a
question needs it: ``state_of`` reads one bucket, ``queue`` one queue manifest, and
``segments_for`` only the pages whose offsets (or store times) the question covers.  Whole-tier
properties (``queues``, ``segments``, ``staging``) exist for tests and offline tools, and cost
what the tier holds.
"""

from __future__ import annotations

from functools import cached_property, partial
from typing import Iterator

from connectors.tier.pool import io_map
from connectors.tier.manifest import (
    QueueKey, QueueManifest, QueueState, Segment, StagingPart, add_counts, apply_to_manifest, apply_to_state,
    bucket_of, by_queue, home_bucket,
)

_FAR = 2**63 - 1


class CommittedTier:
    def __init__(self, log, root: dict, tail: list[dict]):
        self.log = log
        self.root = root
        self.tail = tail
        self.buckets = root["buckets"]
        self.seq = tail[-1]["seq"] if tail else root["seq"]
        self.source_end = root["source_end"]
        self.last_record = root.get("last_record")  # where the last committed record is, and its CRC
        self.last_batch_id = root["last_batch_id"]
        self.quarantined = {q["start_phy"]: q for q in root.get("quarantined", ())}
        self._tail_topics: dict[str, int] = {}  # queue-id counts the records after the root raised
        self.filtered: dict[str, dict[str, int]] = {k: dict(v) for k, v in root.get("filtered", {}).items()}
        self._tail_by_key: dict[QueueKey, list[dict]] = {}
        for record in tail:
            for key, part in by_queue(record).items():
                self._tail_by_key.setdefault(key, []).append(part)
                self._tail_topics[key[0]] = max(self._tail_topics.get(key[0], 0), key[1] + 1)
            if record["type"] == "batch":
                self.source_end, self.last_batch_id = record["source_end"], record["batch_id"]
                self.last_record = record.get("last_record", self.last_record)
                self.quarantined.update({q["start_phy"]: q for q in record.get("quarantined", ())})
                add_counts(self.filtered, record.get("filtered", {}))
        self._bucket_cache: dict[int, dict[QueueKey, tuple[int, list]]] = {}
        self._manifests: dict[QueueKey, QueueManifest | None] = {}

    # ------------------------------------------------------------ one queue

    def _bucket(self, b: int) -> dict[QueueKey, tuple[int, list]]:
        """Queue -> (manifest version, state row) for the queues of bucket ``b`` at the root."""
        return self._read_bucket(b)[0]

    def _read_bucket(self, b: int) -> tuple[dict[QueueKey, tuple[int, list]], dict[str, int]]:
        if b not in self._bucket_cache:
            version = self.root["versions"].get(str(b))
            data = self.log.read_json(self.log.names.bucket(b, version)) if version is not None else {"queues": []}
            self._bucket_cache[b] = ({(t, q): (v, state) for t, q, v, state in data["queues"]}, data.get("topics", {}))
        return self._bucket_cache[b]

    def queue_ids(self, topic: str) -> int:
        """One past the highest queue id ``topic`` has (its home bucket, and the records after the root)."""
        return max(self._read_bucket(home_bucket(topic, self.buckets))[1].get(topic, 0), self._tail_topics.get(topic, 0))

    def state_of(self, key: QueueKey) -> QueueState | None:
        """The queue's offsets and counts (one bucket read; no manifest), or None."""
        if key in self._manifests:
            m = self._manifests[key]
            return None if m is None else m.state
        entry = self._bucket(bucket_of(key, self.buckets)).get(key)
        state = QueueState.from_json(entry[1]) if entry else None
        for record in self._tail_by_key.get(key, ()):
            state = apply_to_state(state, key, record)
        return state

    def queue(self, key: QueueKey) -> QueueManifest | None:
        """Everything the tier holds of one queue, or None when it has no such queue."""
        if key not in self._manifests:
            entry = self._bucket(bucket_of(key, self.buckets)).get(key)
            m = None
            if entry is not None:
                m = QueueManifest.from_json(self.log.read_json(self.log.names.queue_manifest(*key, entry[0])))
            for record in self._tail_by_key.get(key, ()):
                m = apply_to_manifest(m, key, record)
            self._manifests[key] = m
        return self._manifests[key]

    def prefetch(self, keys) -> None:
        """Read the manifests of ``keys`` at once (an S3 request mostly waits), so a walk over many
        queues does not pay one round trip after another.  At most half the log's cache at a time."""
        names = []
        for key in keys:
            if key not in self._manifests:
                entry = self._bucket(bucket_of(key, self.buckets)).get(key)
                if entry is not None:
                    names.append(self.log.names.queue_manifest(*key, entry[0]))
        chunk = self.log.cache_objects // 2
        for i in range(0, len(names), chunk):
            io_map(self.log.read_json, names[i:i + chunk])

    def segments_for(self, key: QueueKey, lo: int = -1, hi: int = _FAR, min_ts: int = -_FAR,
                     max_ts: int = _FAR) -> list[Segment]:
        """Retained segments of ``key`` overlapping offsets ``[lo, hi)`` and store times
        ``[min_ts, max_ts]``, by base.  Reads only the pages those bounds fall in."""
        m = self.queue(key)
        if m is None:
            return []
        found = []
        for page in m.pages_between(lo, hi):
            if page.max_ts >= min_ts and page.min_ts <= max_ts:
                found.extend(self._page(page))
        found.extend(m.recent)
        lo = max(lo, m.state.low)
        return sorted((s for s in found if s.end >= lo and s.base < hi and s.max_ts >= min_ts and s.min_ts <= max_ts),
                      key=lambda s: s.base)

    def segments_in_order(self, key: QueueKey, min_ts: int = -_FAR, max_ts: int = _FAR,
                          reverse: bool = False) -> Iterator[Segment]:
        """Retained segments of ``key`` whose store times overlap ``[min_ts, max_ts]``, by base (from
        the highest with ``reverse``), reading each page only when the walk reaches it."""
        m = self.queue(key)
        if m is None:
            return
        low = m.state.low
        chunks = [partial(self._page, p) for p in m.pages if p.end >= low and p.max_ts >= min_ts and p.min_ts <= max_ts]
        chunks.append(lambda: m.recent)
        for chunk in reversed(chunks) if reverse else chunks:
            found = [s for s in chunk() if s.end >= low and s.max_ts >= min_ts and s.min_ts <= max_ts]
            yield from sorted(found, key=lambda s: s.base, reverse=reverse)

    def _page(self, page) -> list[Segment]:
        return [Segment.from_json(s) for s in self.log.read_json(page.name)["segments"]]

    def staging_for(self, key: QueueKey) -> list[StagingPart]:
        """Committed staging parts holding unsealed rows of ``key``, oldest first."""
        m = self.queue(key)
        return [] if m is None else [p for p in m.staging if p.last >= m.state.sealed]

    # ------------------------------------------------------------ listing

    def topics(self) -> dict[str, int]:
        """Topic -> one past its highest queue id (reads every bucket)."""
        out = dict(self._tail_topics)
        for b in range(self.buckets):
            for t, n in self._read_bucket(b)[1].items():
                out[t] = max(out.get(t, 0), n)
        return out

    def queue_keys(self, topic: str | None = None) -> list[QueueKey]:
        """The queues the tier holds (of ``topic`` only: reads as many buckets as it has queue ids)."""
        return sorted(self.queue_states(topic))

    def queue_states(self, topic: str | None = None) -> dict[QueueKey, QueueState]:
        if topic is None:
            buckets = range(self.buckets)
        else:
            n = self.queue_ids(topic)
            buckets = sorted({bucket_of((topic, q), self.buckets) for q in range(min(n, self.buckets))})
        keys = {k for b in buckets for k in self._bucket(b) if topic is None or k[0] == topic}
        keys |= {k for k in self._tail_by_key if topic is None or k[0] == topic}
        return {k: s for k in keys if (s := self.state_of(k)) is not None}

    # ------------------------------------------------------------ the whole tier (tests, offline tools)

    @cached_property
    def queues(self) -> dict[QueueKey, QueueManifest]:
        keys = self.queue_keys()
        self.prefetch(keys)
        return {k: self.queue(k) for k in keys}

    @cached_property
    def segments(self) -> dict[str, Segment]:
        return {s.name: s for k in self.queues for s in self.segments_for(k)}

    @cached_property
    def staging(self) -> dict[str, list[tuple[QueueKey, StagingPart]]]:
        out: dict[str, list] = {}
        for k in self.queues:
            for p in self.staging_for(k):
                out.setdefault(p.name, []).append((k, p))
        return out
