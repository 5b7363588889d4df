"""What one round of the message tables sees of a broker's tier (``TierView``, taken at one
moment), and the rows a round reads from it for its fresh files: the tables' only reads of data.

Why a view: the tier moves on while a round commits to the tables (the tiering query commits the
next batch beside it); the round works from one consistent moment and the next round sees the rest.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import pyarrow as pa

from connectors.tables import fresh
from connectors.tier import layout
from connectors.tier.manifest import QueueKey, Segment, StagingObject

ROUND_BYTES = 256 << 20  # staging and segment bytes one round reads for fresh files, at most


@dataclass
class TierView:
    """What one round sees of this broker's tier, taken at one moment (under the writer's lock):
    each queue's offsets, the live staging objects, and the commit records since the last root."""

    seq: int
    at: float  # time.time() of the moment
    queues: dict[QueueKey, fresh.QueueNow]
    staging: list[StagingObject]
    records: list[dict]
    segments_of: Callable[[str, int], Iterable[Segment]]  # a queue's retained segments, oldest first
    time_ms: dict[int, int] = field(default_factory=dict)  # a record's seq -> when it was committed

    def topics(self) -> set[str]:
        return {t for t, _ in self.queues}

    @classmethod
    def from_committed(cls, committed) -> "TierView":
        """The view of a tier as a reader loads it (``CommittedTier``): for the CLI's ``table``
        commands, which run beside the service or without it."""
        states = committed.queue_states()
        staging: dict[str, StagingObject] = {}
        for key in sorted(states):
            for p in committed.staging_for(key):
                obj = staging.setdefault(p.name, StagingObject(p.name, p.size, p.first_phy, {}, p.time_ms))
                obj.queues[key] = {"first": p.first, "last": p.last, "rows": p.rows, "bytes": p.bytes,
                                   "min_ts": p.min_ts, "max_ts": p.max_ts}
        return cls(committed.seq, time.time(), {k: fresh.QueueNow(s.commit, s.sealed, s.low) for k, s in states.items()},
                   sorted(staging.values(), key=lambda o: o.first_phy), list(committed.tail),
                   lambda topic, q: committed.segments_for((topic, q)))

    def queues_of(self, topic: str) -> dict[int, fresh.QueueNow]:
        return {q: now for (t, q), now in self.queues.items() if t == topic}


def read_rows(view: TierView, due: list[tuple[str, fresh.Plan]], pending: Callable[[str], dict[int, list[Segment]]],
              backend):
    """The rows each due plan (topic, plan) adds, read once per object for every topic of the
    round, at most ``ROUND_BYTES`` of objects: per topic a table in (queue, offset) order, and per
    queue how far it covers (the plan's end when every object it needed was read).  ``pending``: a
    topic's sealed segments its table has not registered yet, by queue."""
    wants: dict[QueueKey, tuple[int, int]] = {(t, q): r for t, plan in due for q, r in plan.rows.items()}
    if not wants:
        return {}, {}
    budget, spent = ROUND_BYTES, 0
    pieces: dict[QueueKey, list[pa.Table]] = {}
    cut: set[QueueKey] = set()
    # Sealed rows the table lacks come from the pending segments holding them (the table fell
    # behind a seal: rare); the rest from the live staging objects.
    for key, (first, end) in sorted(wants.items()):
        sealed = view.queues[key].sealed
        if first >= sealed:
            continue
        for seg in pending(key[0]).get(key[1], ()):
            if seg.end < first or seg.base >= min(end, sealed):
                continue
            if spent and spent + seg.size > budget:
                cut.add(key)
                break
            spent += seg.size
            pieces.setdefault(key, []).append(_segment_rows(backend, seg, first, min(end, sealed)))
    floor = {key: max(first, view.queues[key].sealed) for key, (first, _end) in wants.items() if key not in cut}
    group: list[pa.Table] = []
    for obj in view.staging:
        needs = [k for k in obj.queues if k in floor and obj.queues[k]["last"] >= floor[k]]
        if not needs:
            continue
        if spent and spent + obj.size > budget:
            cut.update(k for k in floor if any(o.queues.get(k, {}).get("last", -1) >= floor[k]
                                               for o in view.staging if o.first_phy >= obj.first_phy))
            break
        spent += obj.size
        group.append(layout.from_parquet(backend.read_whole(obj.name)))
    for key, table in layout.unsealed_by_queue(group, floor).items():
        pieces.setdefault(key, []).append(table)
    by_topic: dict[str, pa.Table] = {}
    covered: dict[str, dict[int, int]] = {}
    for key in sorted(wants):
        topic, q = key
        got = [p for p in pieces.get(key, ()) if p.num_rows]
        if got:
            by_topic.setdefault(topic, []).extend(got)
        if key not in cut:
            covered.setdefault(topic, {})[q] = wants[key][1]
        elif got:
            covered.setdefault(topic, {})[q] = max(p["queue_offset"][-1].as_py() for p in got) + 1
    return {t: pa.concat_tables(parts).combine_chunks() for t, parts in by_topic.items()}, covered


def _segment_rows(backend, seg: Segment, first: int, stop: int) -> pa.Table:
    """The rows ``[first, stop)`` of a sealed segment."""
    first, stop = max(first, seg.base), min(stop, seg.end + 1)
    if seg.dense:
        return layout.read_segment_slice(backend, seg.name, first - seg.base, stop - seg.base, size=seg.size)
    import pyarrow.compute as pc

    table = layout.from_parquet(backend.read_whole(seg.name))
    offsets = table["queue_offset"]
    return table.filter(pc.and_(pc.greater_equal(offsets, first), pc.less(offsets, stop)))


def staging_parts(view: TierView) -> dict[QueueKey, list[tuple[int, int, int]]]:
    """Per queue, its parts in the live staging objects, oldest first: (last offset, bytes, commit ms)."""
    return StagingParts().of(view)


def parts_from(parts: dict, key: QueueKey, first: int) -> list[tuple[int, int, int]]:
    """A queue's parts that hold its offset ``first`` or later (a queue's parts end in rising order)."""
    mine = parts.get(key, ())
    return mine[bisect.bisect_left(mine, (first,)):]


class StagingParts:
    """``staging_parts`` kept from one round to the next.  Between two seals the live staging
    objects only grow at the end (one a batch, hundreds before a queue seals by age), and a round
    runs more often than a batch: each adds only what is new.  Not thread-safe: one per caller."""

    def __init__(self):
        self._names: list[str] = []
        self._parts: dict[QueueKey, list[tuple[int, int, int]]] = {}

    def of(self, view: TierView) -> dict[QueueKey, list[tuple[int, int, int]]]:
        names = [obj.name for obj in view.staging]
        known = len(self._names)
        if names[:known] != self._names:  # a seal retired some: again from the start
            self._parts, known = {}, 0
        for obj in view.staging[known:]:
            for key, st in obj.queues.items():
                self._parts.setdefault(key, []).append((st["last"], st.get("bytes", 0), obj.time_ms))
        self._names = names
        return self._parts


def oldest_ms(topic: str, behind: dict[int, tuple[int, int]], parts: dict) -> int | None:
    """When the oldest committed row a table lacks was committed (the time of the staging object
    holding it), of the rows ``behind`` (queue -> [first, end)) and the view's ``staging_parts``;
    None when none waits in staging."""
    times = [next((ms for _last, _b, ms in parts_from(parts, (topic, q), first)), None)
             for q, (first, _end) in behind.items()]
    times = [ms for ms in times if ms is not None]
    return min(times) if times else None
