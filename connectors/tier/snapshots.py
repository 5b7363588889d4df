"""Compacted snapshots: the whole latest-per-key view of a topic, as one Parquet object.

    _compacted/broker=<broker>/topic=<topic>/<through physical offset, 20 digits>.parquet

A snapshot holds every live key of its topic (``key``, ``body`` and where the
value came from) as of a physical offset: it reflects every message *below*
``through_phy`` and none at or above it.  Downstream users start from the
newest snapshot and replay only the messages at or above ``through_phy``
(for example ``WHERE phy_offset >= through_phy`` on the tier) instead of all
history.  ``through_phy`` is in the name and in the file's key-value metadata.  Physical offsets are a
broker's own, so each broker's tierlog keeps its own snapshots of the keys its broker holds.

Each object is written with one atomic ``put``, so a reader sees a whole
snapshot or none; the newest few per topic are kept and older ones deleted.

A snapshot holds whole values, also of the keys whose values the KV view keeps as references
into the tier (``state.kv_refs``): those unchanged since the previous snapshot are read from it
(both are in key order: one walk of each), the others from the tier.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.tier.backend import Backend
from connectors.tier.layout import COMPRESSION, escape_topic, unescape_topic

log = logging.getLogger(__name__)
PREFIX = "_compacted/"
SNAPSHOT_SCHEMA = pa.schema(
    [("key", pa.string()), ("body", pa.binary()), ("phy_offset", pa.int64()), ("queue_id", pa.int32()),
     ("queue_offset", pa.int64()), ("store_ts", pa.timestamp("ms", tz="UTC")),
     # Last, and null in snapshots written before it: the latest-per-key tables partition on it.
     ("broker", pa.string())]
)
_CHUNK = 64 * 1024  # rows per row group, and per pass through memory
# Key-value metadata: the newest store time (ms) of any change the snapshot reflects, deletes and
# expiries included; absent in snapshots written before as-of reads (connectors.tier.asof).
THROUGH_TS = "tierlog.through_ts"


@dataclass(frozen=True)
class Snapshot:
    topic: str
    through_phy: int
    name: str


class SnapshotTables(Protocol):
    """Tables that register snapshots in place (``connectors.tables.latest.LatestTables``)."""

    def commit(self, through_phy: int, names: dict[str, str]) -> None:
        """Make each topic's table hold ``names[topic]`` as this broker's snapshot."""

    def release(self, doomed: list[Snapshot]) -> set[str]:
        """Let go of ``doomed``; returns the names a table still needs (they must stay)."""


def _prefix(broker: str) -> str:
    return f"{PREFIX}broker={escape_topic(broker)}/"


def snapshot_name(broker: str, topic: str, through_phy: int) -> str:
    return f"{_prefix(broker)}topic={escape_topic(topic)}/{through_phy:020d}.parquet"


def list_snapshots(backend: Backend, broker: str, topic: str | None = None) -> list[Snapshot]:
    """Every complete snapshot of ``broker`` (of ``topic``, or of every topic), oldest first per topic."""
    base = _prefix(broker)
    prefix = base if topic is None else f"{base}topic={escape_topic(topic)}/"
    out = []
    for info in backend.list(prefix):
        parts = info.name[len(base) :].split("/")
        if len(parts) != 2 or not parts[0].startswith("topic=") or not parts[1].endswith(".parquet"):
            continue
        stem = parts[1][: -len(".parquet")]
        if stem.isdigit():
            out.append(Snapshot(unescape_topic(parts[0][len("topic=") :]), int(stem), info.name))
    return sorted(out, key=lambda s: (s.topic, s.through_phy))


def latest_snapshots(backend: Backend, broker: str, topic: str | None = None) -> dict[str, Snapshot]:
    """The newest snapshot of each topic (or of ``topic``) of ``broker``."""
    return {s.topic: s for s in list_snapshots(backend, broker, topic)}


def snapshot_time(backend: Backend, snapshot: Snapshot) -> int | None:
    """The moment ``snapshot`` stands as of (``THROUGH_TS``), from its footer alone; None when it
    was written without one."""
    meta = pq.ParquetFile(backend.open_input(snapshot.name)).metadata.metadata or {}
    raw = meta.get(THROUGH_TS.encode())
    return None if raw is None else int(raw)


def read_snapshot(backend: Backend, snapshot: Snapshot) -> pa.Table:
    return pq.read_table(pa.BufferReader(backend.read(snapshot.name)), schema=SNAPSHOT_SCHEMA)


def _encode(rows: Iterable[dict], topic: str, through_phy: int,
            through_ts: Callable[[], int | None] = lambda: None) -> tuple[bytes, int]:
    meta = {b"tierlog.topic": topic.encode(), b"tierlog.through_phy": str(through_phy).encode(),
            b"tierlog.created_ms": str(int(time.time() * 1000)).encode()}
    sink = io.BytesIO()
    count = 0
    with pq.ParquetWriter(sink, SNAPSHOT_SCHEMA.with_metadata(meta), compression=COMPRESSION) as writer:
        chunk: list[dict] = []
        for row in rows:
            chunk.append(row)
            if len(chunk) == _CHUNK:
                writer.write_table(pa.Table.from_pylist(chunk, SNAPSHOT_SCHEMA))
                count += len(chunk)
                chunk = []
        writer.write_table(pa.Table.from_pylist(chunk, SNAPSHOT_SCHEMA))
        count += len(chunk)
        at = through_ts()  # known once every row (and tombstone) of the topic has gone by
        if at is not None:
            writer.add_key_value_metadata({THROUGH_TS: str(at)})
    return sink.getvalue(), count


class _Previous:
    """The values of a topic's previous snapshot, read forward in key order beside the view's walk;
    nothing is listed or read until a value is asked for."""

    def __init__(self, backend: Backend, broker: str, topic: str):
        self.backend, self.broker, self.topic = backend, broker, topic
        self.batches = None
        self.keys: list[str] = []
        self.phys: list[int] = []
        self.bodies = None
        self.at = 0
        self.used = 0

    def body(self, key: str, phy: int) -> bytes | None:
        """The previous snapshot's value of ``key`` if it is the one at ``phy``; called in key order."""
        if self.batches is None:
            snapshot = latest_snapshots(self.backend, self.broker, self.topic).get(self.topic)
            self.batches = iter(()) if snapshot is None else pq.ParquetFile(
                self.backend.open_input(snapshot.name)).iter_batches(batch_size=_CHUNK,
                                                                     columns=["key", "phy_offset", "body"])
        while True:
            while self.at < len(self.keys) and self.keys[self.at] < key:
                self.at += 1
            if self.at < len(self.keys):
                break
            batch = next(self.batches, None)
            if batch is None:
                return None
            self.keys, self.phys, self.bodies, self.at = (batch["key"].to_pylist(), batch["phy_offset"].to_pylist(),
                                                          batch["body"], 0)
        if self.keys[self.at] != key or self.phys[self.at] != phy:
            return None
        self.used += 1
        return self.bodies[self.at].as_py() or b""


def _whole(group: Iterable, previous: _Previous, values: Callable[[list], list] | None) -> Iterator:
    """The live entries of one topic's walk (``KVView.entries(bodies=False)``), each with its body:
    as the view holds it, else from the previous snapshot, else read by ``values``
    (``KVView.values_of``: from the tier)."""
    live = (e for _, e in group if e is not None)
    while True:
        chunk = list(itertools.islice(live, _CHUNK))
        if not chunk:
            return
        for i, e in enumerate(chunk):
            if e.body is None:
                body = previous.body(e.key, e.phy_offset)
                if body is not None:
                    chunk[i] = dataclasses.replace(e, body=body)
        if values is not None and any(e.body is None for e in chunk):
            chunk = values(chunk)
        yield from chunk


def write_snapshots(
    backend: Backend,
    broker: str,
    entries: Iterator[tuple[str, object]],
    through_phy: int,
    *,
    keep: int = 2,
    on_topic: Callable[[str, int], None] | None = None,
    tables: SnapshotTables | None = None,
    times: dict[str, int] | None = None,
    values: Callable[[list], list] | None = None,
) -> dict[str, int]:
    """Write one snapshot per topic from ``entries`` (``KVView.entries()``: (topic, entry or None),
    in topic order); then keep only the newest ``keep`` per topic.  ``times``: what
    ``KVView.entries(times)`` fills in, each topic's newest store time, recorded as the moment the
    snapshot stands as of (``THROUGH_TS``, for as-of reads).  An entry without its body (a value
    the view keeps in the tier: ``entries(bodies=False)``) takes the previous snapshot's where that
    is the same message, else what ``values`` (``KVView.values_of``) reads.  With ``tables``, the new
    snapshots are committed to them before older ones go, and a snapshot a table still lists stays
    (a table commit that fails leaves every older snapshot for the next round).  Returns rows per topic."""
    written: dict[str, int] = {}
    names: dict[str, str] = {}
    times = {} if times is None else times
    for topic, group in itertools.groupby(entries, key=lambda pair: pair[0]):
        previous = _Previous(backend, broker, topic)
        rows = (
            {"key": e.key, "body": e.body, "phy_offset": e.phy_offset, "queue_id": e.queue_id,
             "queue_offset": e.queue_offset, "store_ts": e.store_ts, "broker": broker}
            for e in _whole(group, previous, values)
        )
        data, count = _encode(rows, topic, through_phy, lambda: times.get(topic))
        if previous.used:
            log.info("snapshot of %s: %d value(s) kept in the tier taken from the previous snapshot", topic,
                     previous.used)
        names[topic] = snapshot_name(broker, topic, through_phy)
        backend.put(names[topic], data)
        written[topic] = count
        if on_topic:
            on_topic(topic, count)
    if tables is not None:
        try:
            tables.commit(through_phy, names)
        except Exception as exc:  # the tables are derived from the tier: they never stop its snapshots
            log.warning("the latest-per-key tables missed the snapshot through physical offset %d (%s: %s); "
                        "older snapshots are kept until a later one reaches them", through_phy,
                        type(exc).__name__, exc)
            return written
    prune(backend, broker, keep, tables)
    return written


def prune(backend: Backend, broker: str, keep: int, tables: SnapshotTables | None = None) -> list[str]:
    """Delete all but the newest ``keep`` snapshots of every topic of ``broker`` (and of those, any
    that ``tables`` still needs stays)."""
    by_topic: dict[str, list[Snapshot]] = {}
    for s in list_snapshots(backend, broker):
        by_topic.setdefault(s.topic, []).append(s)
    doomed = [s for snaps in by_topic.values() for s in snaps[: max(0, len(snaps) - max(1, keep))]]
    if doomed and tables is not None:
        try:
            needed = tables.release(doomed)
        except Exception as exc:
            log.warning("the latest-per-key tables could not let go of %d older snapshot(s) (%s: %s); they are "
                        "kept until a later round", len(doomed), type(exc).__name__, exc)
            return []
        doomed = [s for s in doomed if s.name not in needed]
    for s in doomed:
        backend.delete(s.name)
    return [s.name for s in doomed]
