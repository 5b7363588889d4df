"""What a message table's next commit changes, as pure functions: which of its fresh files go, which
sealed segments take their place, and which committed rows a new fresh file adds.

A message table holds each of its topic's queues as two runs: the queue's sealed segments,
registered where they lie in the tier, up to ``registered[q]``; then *fresh files*, Parquet files
the tables write themselves, each holding a topic's rows of several queues committed since the
table's last commit, up to ``cover[q]``.  A fresh file must be whole (Iceberg lists whole files), so
it leaves the table only when every row in it is in a registered segment, or past retention: the
file and the segments that take its rows go in one commit, and no row is ever listed twice or
missed.  A segment whose rows a file still holds beside another queue's unsealed rows waits, with
the segments after it (``pending``): with the defaults every queue seals within
``tier.segment_age_s`` of its oldest unsealed row, so a file waits at most about that long, and a
table holds at most that many seconds of fresh files per topic.

Contract: ``take_records`` files a seal's and an expiry's segments into the state; ``plan`` says what
the next commit does given each queue's offsets in the tier; ``apply`` records it once committed.
Nothing here reads or writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from connectors.tier.manifest import Segment

NEVER = 1 << 62  # an offset past every real one


@dataclass
class FreshFile:
    """A fresh file of the table: its tier object name and, per queue, the first and last offset it holds."""

    name: str
    queues: dict[int, tuple[int, int]]

    def to_json(self) -> dict:
        return {"name": self.name, "queues": [[q, lo, hi] for q, (lo, hi) in sorted(self.queues.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "FreshFile":
        return cls(d["name"], {q: (lo, hi) for q, lo, hi in d["queues"]})


@dataclass
class TopicState:
    """What one broker's part of one message table holds, per queue."""

    files: dict[str, FreshFile] = field(default_factory=dict)
    registered: dict[int, int] = field(default_factory=dict)  # q -> one past the last registered segment
    pending: dict[int, list[Segment]] = field(default_factory=dict)  # sealed, not registered yet, in order
    cover: dict[int, int] = field(default_factory=dict)  # q -> one past the highest offset the table holds
    unregister: list[Segment] = field(default_factory=list)  # listed segments retention expired: to remove

    def to_json(self) -> dict:
        return {"files": [f.to_json() for f in self.files.values()],
                "registered": sorted(self.registered.items()), "cover": sorted(self.cover.items()),
                "pending": [s.to_json() for segs in self.pending.values() for s in segs],
                "unregister": [s.to_json() for s in self.unregister]}

    @classmethod
    def from_json(cls, d: dict) -> "TopicState":
        state = cls({f["name"]: FreshFile.from_json(f) for f in d["files"]}, dict(map(tuple, d["registered"])),
                    {}, dict(map(tuple, d["cover"])), [Segment.from_json(s) for s in d.get("unregister", ())])
        for raw in d["pending"]:
            seg = Segment.from_json(raw)
            state.pending.setdefault(seg.queue_id, []).append(seg)
        return state


@dataclass(frozen=True)
class QueueNow:
    """One queue's offsets in the tier at the moment a commit is planned."""

    commit: int  # one past its last committed message
    sealed: int  # one past its last sealed message
    low: int  # its lowest retained offset


@dataclass
class Plan:
    """One commit of one table: files out, segments in, expired segments out, rows to add."""

    remove: list[str] = field(default_factory=list)
    register: list[Segment] = field(default_factory=list)
    unregister: list[Segment] = field(default_factory=list)
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # q -> [first, end) of rows to add
    registered: dict[int, int] = field(default_factory=dict)  # q -> ``registered`` once committed

    @property
    def empty(self) -> bool:
        return not (self.remove or self.register or self.unregister or self.rows)


def take_records(state: TopicState, sealed: Iterable[Segment], expired: Iterable[Segment]) -> None:
    """File newly sealed segments as pending, and expired ones: dropped if pending, else (listed)
    kept in ``unregister`` for the next commit to remove.  Idempotent: a segment seen again, or one
    already registered, changes nothing."""
    for seg in sealed:
        q = seg.queue_id
        queue = state.pending.setdefault(q, [])
        if seg.base >= state.registered.get(q, 0) and all(s.base != seg.base for s in queue):
            queue.append(seg)
            queue.sort(key=lambda s: s.base)
    for seg in expired:
        q = seg.queue_id
        queue = state.pending.get(q, [])
        if any(s.base == seg.base for s in queue):
            state.pending[q] = [s for s in queue if s.base != seg.base]
        elif seg.end < state.registered.get(q, 0) and all(s.name != seg.name for s in state.unregister):
            state.unregister.append(seg)


def plan(state: TopicState, queues: dict[int, QueueNow], max_register: int | None = None) -> Plan:
    """The next commit of the table, given each queue's offsets in the tier now.

    A fresh file goes when every row in it is in a segment this commit registers or already lists,
    or below its queue's low offset (retention); a pending segment is registered, in order, unless a
    fresh file that stays holds a row of it.  Each decides the other, so both are worked out
    together until neither changes (a few rounds: every file that stays pins what it holds).  The
    rows to add are each queue's from past what the table will hold to its commit offset.  With
    ``max_register``, at most that many segments (a backlog goes in parts): the files whose rows
    that leaves out of a segment stay, and with them the segments they pin."""
    removable = set(state.files)  # shrinks to the largest set of files that can go
    while True:
        registered, taken, cut = _registrable(state, removable, max_register)
        stays = {name for name in removable
                 if any(hi >= max(registered.get(q, state.registered.get(q, 0)), _low(queues, q))
                        for q, (_lo, hi) in state.files[name].queues.items())}
        if not stays:
            break
        removable -= stays
    out = Plan(remove=sorted(removable), register=[s for q in sorted(taken) for s in taken[q]],
               unregister=list(state.unregister), registered=registered)
    for q, now in sorted(queues.items()):
        first = max(state.cover.get(q, 0), registered.get(q, state.registered.get(q, 0)), now.low)
        if first < now.commit and q not in cut:  # a cut queue's rows would copy its own backlog
            out.rows[q] = (first, now.commit)
    return out


def _registrable(state: TopicState, removable: set[str], limit: int | None = None
                 ) -> tuple[dict[int, int], dict[int, list[Segment]], set[int]]:
    """Each queue's pending segments that no staying file holds a row of, in order up to the first
    that one does (at most ``limit`` in all, queue by queue); where each queue's registered run then
    ends; and the queues the limit cut short."""
    held_from: dict[int, int] = {}  # q -> the lowest offset a staying file holds
    for name, f in state.files.items():
        if name not in removable:
            for q, (lo, _hi) in f.queues.items():
                held_from[q] = min(held_from.get(q, NEVER), lo)
    ends, taken, cut, room = {}, {}, set(), NEVER if limit is None else limit
    for q, segs in sorted(state.pending.items()):
        got = []
        for seg in segs:
            if seg.end >= held_from.get(q, NEVER):
                break
            if len(got) >= room:
                cut.add(q)  # the rest of its backlog, and its rows past it, go next time
                break
            got.append(seg)
        room -= len(got)
        if got:
            taken[q] = got
            ends[q] = got[-1].end + 1
    return ends, taken, cut


def _low(queues: dict[int, QueueNow], q: int) -> int:
    now = queues.get(q)
    return now.low if now is not None else 0


def apply(state: TopicState, done: Plan, added: FreshFile | None, covered: dict[int, int]) -> None:
    """Record a committed ``done``, which added the fresh file ``added`` (None: no rows) and took
    each queue of ``covered`` up to the offset it maps to (past gaps a quarantine left: what the
    file holds may end sooner)."""
    gone = {s.name for s in done.unregister}
    state.unregister = [s for s in state.unregister if s.name not in gone]
    for name in done.remove:
        state.files.pop(name, None)
    for seg in done.register:
        q = seg.queue_id
        state.pending[q] = [s for s in state.pending.get(q, []) if s.base != seg.base]
        if not state.pending[q]:
            del state.pending[q]
    for q, end in done.registered.items():
        state.registered[q] = max(state.registered.get(q, 0), end)
        state.cover[q] = max(state.cover.get(q, 0), end)
    if added is not None:
        state.files[added.name] = added
        for q, (_lo, hi) in added.queues.items():
            state.cover[q] = max(state.cover.get(q, 0), hi + 1)
    for q, end in covered.items():
        state.cover[q] = max(state.cover.get(q, 0), end)
