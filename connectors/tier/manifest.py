"""The tier's metadata, split so that a commit writes what changed and a reader reads what it needs.

Like Iceberg's manifest list and manifests, and Kafka's remote-log metadata kept per partition:

    _log/<seq>.json                      a commit record: what one batch, seal or expiry changed
    _log/<seq>.root.json                 a root: the committed state at <seq>, in small pieces
    _meta/buckets/<bucket>/<seq>.json    a bucket: one line per queue hashed to it (offsets, counts,
                                         the version of its queue manifest), and the queue-id count
                                         of each topic whose home it is
    _meta/queues/topic=<t>/queue=<q>/<seq>.json
                                         a queue manifest: offsets, the queue's unsealed staging
                                         parts, its newest segments, and its full pages
    _meta/pages/topic=<t>/queue=<q>/<base>.<seq>.json
                                         a page: up to ``PAGE_SEGMENTS`` older segments, immutable

A root names one version per bucket and nothing per queue, so its size is fixed by the bucket
count.  A fold rewrites only the queues (and their buckets) that commit records changed
since the last root; a queue's manifest holds at most ``PAGE_SEGMENTS`` segments inline before
they move to an immutable page.  So no cost grows with the tier's history: a commit is one
record, a fold is proportional to the queues it touched, and a reader of one queue reads
the root, the records after it, one bucket, one manifest and the pages the offsets it wants
fall in.

This module holds the pure part: the objects, their JSON, and how a commit record changes one
queue.  ``connectors.tier.log`` does the I/O.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field

from connectors.tier.errors import TierRecordError

QueueKey = tuple[str, int]
FORMAT = 2  # the layout version; written in every root and record
PAGE_SEGMENTS = 64  # a queue's segments move to an immutable page once this many are inline
DEFAULT_BUCKETS = 1024


def bucket_of(key: QueueKey, buckets: int) -> int:
    """A queue's bucket.  A topic's queues sit in consecutive buckets from its hash, so the
    queues of one topic are found by reading as many buckets as it has queue ids."""
    return (zlib.crc32(key[0].encode()) + key[1]) % buckets


def home_bucket(topic: str, buckets: int) -> int:
    """The bucket that records how many queue ids ``topic`` has (that of its queue 0)."""
    return bucket_of((topic, 0), buckets)


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

    @property
    def key(self) -> QueueKey:
        return self.topic, self.queue_id

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k != "keys"}

    @classmethod
    def from_json(cls, d: dict) -> "Segment":
        return cls(**d)


@dataclass
class StagingObject:
    """One committed staging object and, per queue, the queue offsets and store times it holds
    (first, last, rows, bytes, min_ts, max_ts).  This is the form of a batch record."""

    name: str
    size: int
    first_phy: int
    queues: dict[QueueKey, dict]
    time_ms: int = 0  # when it was committed; sealing by age counts from here, not from store times

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "first_phy": self.first_phy, "time_ms": self.time_ms,
                "queues": [[t, q, v] for (t, q), v in sorted(self.queues.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "StagingObject":
        return cls(d["name"], d["size"], d["first_phy"], {(t, q): v for t, q, v in d["queues"]}, d.get("time_ms", 0))

    def part(self, key: QueueKey) -> "StagingPart":
        s = self.queues[key]
        return StagingPart(self.name, self.size, self.first_phy, s["first"], s["last"], s["rows"],
                           s.get("bytes", 0), s["min_ts"], s["max_ts"], self.time_ms)


@dataclass(frozen=True)
class StagingPart:
    """The rows of one queue in one committed staging object."""

    name: str
    size: int  # of the whole object
    first_phy: int
    first: int
    last: int
    rows: int
    bytes: int
    min_ts: int
    max_ts: int
    time_ms: int

    def to_json(self) -> list:
        return [self.name, self.size, self.first_phy, self.first, self.last, self.rows, self.bytes, self.min_ts,
                self.max_ts, self.time_ms]

    @classmethod
    def from_json(cls, row: list) -> "StagingPart":
        return cls(*row)


@dataclass(frozen=True)
class PageRef:
    """An immutable page of a queue's older segments, and what it covers."""

    name: str
    base: int  # the first segment's base
    end: int  # the last segment's end
    min_ts: int
    max_ts: int
    count: int

    def to_json(self) -> list:
        return [self.name, self.base, self.end, self.min_ts, self.max_ts, self.count]

    @classmethod
    def from_json(cls, row: list) -> "PageRef":
        return cls(*row)

    @classmethod
    def of(cls, name: str, segments: list[Segment]) -> "PageRef":
        return cls(name, segments[0].base, segments[-1].end, min(s.min_ts for s in segments),
                   max(s.max_ts for s in segments), len(segments))


@dataclass(slots=True)
class QueueState:
    """A queue's offsets and what it retains: the small part every bucket line carries."""

    commit: int = 0  # next queue offset to be committed (everything below is in the tier)
    sealed: int = 0  # next queue offset to be sealed (everything below is in segments)
    low: int = 0  # lowest queue offset still retained in the tier
    segments: int = 0  # retained segments
    bytes: int = 0  # their bytes

    def to_json(self) -> list:
        return [self.commit, self.sealed, self.low, self.segments, self.bytes]

    @classmethod
    def from_json(cls, row: list) -> "QueueState":
        return cls(*row)

    @classmethod
    def starting_at(cls, offset: int) -> "QueueState":
        return cls(commit=offset, sealed=offset, low=offset)


@dataclass
class QueueManifest:
    """Everything the tier knows of one queue: its state, its unsealed staging parts (oldest
    first), its newest segments inline (by base) and its pages of older ones (by base)."""

    state: QueueState = field(default_factory=QueueState)
    staging: list[StagingPart] = field(default_factory=list)
    recent: list[Segment] = field(default_factory=list)
    pages: list[PageRef] = field(default_factory=list)

    @property
    def commit(self) -> int:
        return self.state.commit

    @property
    def sealed(self) -> int:
        return self.state.sealed

    @property
    def low(self) -> int:
        return self.state.low

    def to_json(self) -> dict:
        return {"v": FORMAT, "state": self.state.to_json(), "staging": [p.to_json() for p in self.staging],
                "recent": [s.to_json() for s in self.recent], "pages": [p.to_json() for p in self.pages]}

    @classmethod
    def from_json(cls, d: dict) -> "QueueManifest":
        return cls(QueueState.from_json(d["state"]), [StagingPart.from_json(p) for p in d["staging"]],
                   [Segment.from_json(s) for s in d["recent"]], [PageRef.from_json(p) for p in d["pages"]])

    def pages_between(self, lo: int, hi: int) -> list[PageRef]:
        """Pages holding a retained segment that overlaps offsets ``[lo, hi)``, found by bisection."""
        lo = max(lo, self.state.low)
        i = bisect.bisect_right([p.end for p in self.pages], lo - 1)
        out = []
        for page in self.pages[i:]:
            if page.base >= hi:
                break
            out.append(page)
        return out


# ---------------------------------------------------------------- how a record changes a queue


def record_keys(record: dict) -> set[QueueKey]:
    """The queues a commit record changes."""
    kind = record["type"]
    if kind == "batch":
        return {(t, q) for obj in record["staging"] for t, q, _ in obj["queues"]}
    if kind in ("seal", "expire"):
        return {(s["topic"], s["queue_id"]) for s in record["segments"]}
    raise TierRecordError(f"commit record {record.get('seq')} has unknown type {kind!r}")


def by_queue(record: dict) -> dict[QueueKey, dict]:
    """For each queue ``record`` changes, the record with only that queue's entries (its staging
    objects' stats of that queue, its segments of that queue), for ``apply_to_state`` and
    ``apply_to_manifest``.  Applying the whole record to each of its queues cost their product,
    quadratic in a batch's queues: a batch and a seal over 20,000 queues held a fold for minutes."""
    kind = record["type"]
    rest = {k: v for k, v in record.items() if k not in ("staging", "segments")}
    parts: dict[QueueKey, dict] = {}
    if kind == "batch":
        for obj in record["staging"]:
            head = {k: v for k, v in obj.items() if k != "queues"}
            for t, q, stats in obj["queues"]:
                part = parts.get((t, q)) or parts.setdefault((t, q), {**rest, "staging": []})
                part["staging"].append({**head, "queues": [[t, q, stats]]})
        return parts
    if kind in ("seal", "expire"):
        for s in record["segments"]:
            key = (s["topic"], s["queue_id"])
            part = parts.get(key) or parts.setdefault(key, {**rest, "segments": []})
            part["segments"].append(s)
        return parts
    raise TierRecordError(f"commit record {record.get('seq')} has unknown type {kind!r}")


def check_record(record: dict) -> None:
    """Refuse a record this layout cannot apply (written by an older tierlog, or unknown)."""
    if record.get("v") != FORMAT:
        raise TierRecordError(f"commit record {record.get('seq')} has layout {record.get('v', 1)}, not {FORMAT}")
    record_keys(record)


def apply_to_state(state: QueueState | None, key: QueueKey, record: dict) -> QueueState:
    """``state`` of queue ``key`` after ``record`` (a new state when the queue is new)."""
    kind = record["type"]
    if kind == "batch":
        for obj in record["staging"]:
            for t, q, stats in obj["queues"]:
                if (t, q) == key:
                    state = state or QueueState.starting_at(stats["first"])
                    state.commit = max(state.commit, stats["last"] + 1)
        return state
    if state is None:
        raise TierRecordError(f"commit record {record.get('seq')} ({kind}) names queue {key[0]}/{key[1]}, "
                           "which the tier does not hold")
    for s in record["segments"]:
        if (s["topic"], s["queue_id"]) != key:
            continue
        if kind == "seal":
            state.sealed = max(state.sealed, s["end"] + 1)
            state.segments += 1
            state.bytes += s["size"]
        else:  # expire
            state.low = max(state.low, s["end"] + 1)
            state.segments -= 1
            state.bytes -= s["size"]
    return state


def apply_to_manifest(m: QueueManifest | None, key: QueueKey, record: dict) -> QueueManifest:
    """``m`` after ``record``.  Pages dropped by an expiry are left to the caller: a page is
    dropped once every segment in it is below ``low`` (see ``dropped_pages``)."""
    state = apply_to_state(m.state if m else None, key, record)
    m = m or QueueManifest(state)
    m.state = state
    kind = record["type"]
    if kind == "batch":
        for obj in record["staging"]:
            if any((t, q) == key for t, q, _ in obj["queues"]):
                m.staging.append(StagingObject.from_json(obj).part(key))
        m.staging.sort(key=lambda p: p.first_phy)
    elif kind == "seal":
        for s in record["segments"]:
            if (s["topic"], s["queue_id"]) == key:
                bisect.insort(m.recent, Segment.from_json(s), key=lambda seg: seg.base)
    m.staging = [p for p in m.staging if p.last >= state.sealed]
    m.recent = [s for s in m.recent if s.end >= state.low]
    return m


def dropped_pages(m: QueueManifest) -> list[PageRef]:
    """Pages all of whose segments have expired; removes them from ``m``."""
    gone = [p for p in m.pages if p.end < m.state.low]
    if gone:
        m.pages = [p for p in m.pages if p.end >= m.state.low]
    return gone


def add_counts(into: dict[str, dict[str, int]], counts: dict[str, dict[str, int]]) -> dict:
    """Add nested ``{sink: {class: n}}`` counts (messages a sink's topic filter left out) to ``into``."""
    for sink, by_class in counts.items():
        for cls, n in by_class.items():
            into.setdefault(sink, {})[cls] = into.get(sink, {}).get(cls, 0) + n
    return into
