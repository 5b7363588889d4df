"""A read-ahead cache for sequential readers of tiered queues, after RocketMQ's TieredMessageFetcher.

Readers (consumer groups) ask for ``max_messages`` from an offset, as with
``TierReader.get``.  On a miss the cache reads a window of
``factor x max_messages`` committed messages of that queue in one go and keeps
it; readers that follow hit it, and a reader that finishes a window has the
next one read ahead of its next request.  Per queue, the factor grows by one on every
hit and halves on every miss (additive increase, multiplicative decrease), so
a queue read sequentially by several groups reads ahead far, and a queue read
at random soon reads only what is asked for.  A window from a sealed segment
also keeps the rest of the Parquet row group it was decoded from (up to a
quarter of the memory bound): that work is done anyway, and without it a
consumer pulling 32 messages would decode a whole row group for every pull.

Memory is bounded (``max_bytes``, least recently used out first).  Unlike
RocketMQ, which keeps an entry until every consumer group has passed it, an
entry is dropped as soon as no group still behind it is expected to reach it
within ``ttl_s`` at the pace that group has been reading: a group far behind
would find it expired anyway, so holding it only wastes memory.

Contract: every result equals ``TierReader.get`` on the committed state the
cache last read (refreshed at most ``refresh_s`` old, and whenever a reader
asks past the commit offset it knows).  Committed messages never change, so a
cached window stays right; retention only raises a queue's lowest offset,
which is checked against the state before the cache is consulted.

A cache serves one broker's queues: on a tier of several brokers, give it a ``TierReader`` made
for one (``TierReader(location, broker=...)``), one cache per broker.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import pyarrow as pa

from connectors.tier.committed import CommittedTier
from connectors.tier.reader import GetResult, GetStatus, TierReader


START_FACTOR = 4  # a queue's first window: 4 x max_messages
_LIVE: "weakref.WeakSet[ReadAheadCache]" = weakref.WeakSet()


def live_caches() -> list["ReadAheadCache"]:
    """Every cache of this process still in use (for the metrics' hit ratio)."""
    return list(_LIVE)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes: int = 0  # held now
    evicted_lru: int = 0  # windows pushed out by the memory bound
    dropped_early: int = 0  # windows no group was expected to reach before they expired

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class _Window:
    topic: str
    queue_id: int
    start: int
    end: int  # exclusive
    table: pa.Table
    loaded: float = field(default_factory=time.monotonic)


@dataclass
class _Group:
    offset: int
    at: float
    rate: float = 0.0  # messages per second, smoothed


class ReadAheadCache:
    def __init__(self, reader: TierReader, *, max_bytes: int = 256 << 20, ttl_s: float = 60.0,
                 max_factor: int = 64, refresh_s: float = 1.0):
        self.reader = reader
        self.max_bytes, self.ttl_s, self.max_factor, self.refresh_s = max_bytes, ttl_s, max_factor, refresh_s
        self.stats = CacheStats()
        self._windows: OrderedDict[tuple[str, int, int], _Window] = OrderedDict()
        self._factor: dict[tuple[str, int], int] = {}
        self._groups: dict[tuple[str, int], dict[str, _Group]] = {}
        self._state: CommittedTier | None = None
        self._state_at = 0.0
        self._lock = threading.Lock()
        _LIVE.add(self)

    # ------------------------------------------------------------ reading

    def get(self, group: str, topic: str, queue_id: int, offset: int, max_messages: int = 32) -> GetResult:
        """``TierReader.get`` for consumer group ``group``, served from the cache when it can be."""
        with self._lock:
            state = self._current_state(topic, queue_id, offset)
            q = state.state_of((topic, queue_id))
            if q is None or offset < q.low or offset >= q.commit:
                return self.reader.get(topic, queue_id, offset, max_messages, state)
            end = min(q.commit, offset + max(1, max_messages))
            window = self._find(topic, queue_id, offset, end)
            key = (topic, queue_id)
            if window is None:
                self.stats.misses += 1
                self._factor[key] = max(1, self._factor.get(key, 2 * START_FACTOR) // 2)
                window = self._load(state, topic, queue_id, offset, max(end, offset + self._factor[key] * max_messages))
            else:
                self.stats.hits += 1
                self._factor[key] = min(self.max_factor, self._factor.get(key, START_FACTOR) + 1)
                self._windows.move_to_end((topic, queue_id, window.start))
            rows = window.table.slice(offset - window.start, end - offset)
            if end == window.end and end < q.commit and self._find(topic, queue_id, end, end + 1) is None:
                # The reader finished this window: read the next one ahead of its next request.
                self._load(state, topic, queue_id, end, end + self._factor[key] * max(1, max_messages))
            self._advance(group, key, end)
            return GetResult(GetStatus.FOUND, rows, end, q.low, q.commit)

    def _current_state(self, topic: str, queue_id: int, offset: int) -> CommittedTier:
        now = time.monotonic()
        q = self._state.state_of((topic, queue_id)) if self._state else None
        if self._state is None or now - self._state_at > self.refresh_s or q is None or offset >= q.commit:
            self._state, self._state_at = self.reader.committed(), now
        return self._state

    def _find(self, topic: str, queue_id: int, start: int, end: int) -> _Window | None:
        for (t, q, _), w in self._windows.items():
            if t == topic and q == queue_id and w.start <= start and end <= w.end:
                return w
        return None

    def _load(self, state: CommittedTier, topic: str, queue_id: int, start: int, end: int) -> _Window:
        q = state.state_of((topic, queue_id))
        wanted = min(end, q.commit)
        # Keep the rest of the row group the read decodes anyway, within a quarter of the memory bound.
        end = min(q.commit, max(wanted, self.reader.decoded_end(topic, queue_id, wanted - 1, state)))
        table = self.reader._range(topic, queue_id, start, end, state)
        if end > wanted and table.get_total_buffer_size() > self.max_bytes // 4:
            rows = max(wanted - start, table.num_rows * (self.max_bytes // 4) // table.get_total_buffer_size())
            table = table.take(pa.array(range(rows)))  # a copy, so the rest of the group is freed
            end = start + rows
        window = _Window(topic, queue_id, start, end, table)
        self._windows[(topic, queue_id, start)] = window
        self.stats.bytes += table.get_total_buffer_size()
        self._evict_lru()
        return window

    # ------------------------------------------------------------ eviction

    def _evict_lru(self) -> None:
        while self.stats.bytes > self.max_bytes and len(self._windows) > 1:
            _, w = self._windows.popitem(last=False)
            self.stats.bytes -= w.table.get_total_buffer_size()
            self.stats.evicted_lru += 1

    def _advance(self, group: str, key: tuple[str, int], offset: int) -> None:
        """Move ``group`` to ``offset`` and drop windows that no group will reach in time."""
        now = time.monotonic()
        groups = self._groups.setdefault(key, {})
        g = groups.get(group)
        if g is None:
            groups[group] = _Group(offset, now)
        else:
            elapsed = max(now - g.at, 1e-3)
            pace = max(0, offset - g.offset) / elapsed
            g.rate = pace if g.rate == 0 else 0.7 * g.rate + 0.3 * pace
            g.offset, g.at = offset, now
        for wkey in [k for k in self._windows if (k[0], k[1]) == key]:
            w = self._windows[wkey]
            if not any(self._will_reach(other, w, now) for other in groups.values()):
                del self._windows[wkey]
                self.stats.bytes -= w.table.get_total_buffer_size()
                self.stats.dropped_early += 1

    def _will_reach(self, g: _Group, w: _Window, now: float) -> bool:
        """Is group ``g`` expected to read part of ``w`` before ``w`` is ``ttl_s`` old?"""
        if g.offset >= w.end:
            return False  # it has passed the window
        if g.offset >= w.start:
            return True  # it is inside the window now
        if g.rate <= 0:
            return now - w.loaded < self.ttl_s  # no pace yet: keep it for its time to live
        eta = (w.start - g.offset) / g.rate
        return now + eta - w.loaded < self.ttl_s
