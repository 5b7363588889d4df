"""Rebuild the KV view from scratch, without Spark.

Sources, in order, each picking up where the one before stopped:

1. ``snapshot``: the newest compacted snapshot of each topic in the tier;
2. the tier's committed messages at or above what the snapshots cover;
3. the local commitlog from where the tier ends to its end.

``--from tier`` skips step 1 and ``--from commitlog`` uses step 3 alone.  A
gap between sources (messages neither in the tier nor in the local
commitlog) is an error, never skipped.  The new view is built beside the old
one and swapped in at the end, so a failed rebuild leaves the old view as it
was.  Because the view keeps the latest change by physical offset, the
overlap between sources is harmless.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from connectors.brokers import DEFAULT_BROKER
from connectors.commitlog.reader import CommitLogReader
from connectors.commitlog.topics import TopicFilter
from connectors.errors import TierlogError
from connectors.tier import snapshots
from connectors.tier.location import open_backend
from connectors.tier.reader import TierReader
from state.kv import KVView
from state.kv_refs import ReferencePolicy
from state.replay import keyed_rows, replay_messages

log = logging.getLogger("tierlog.kv")

SOURCES = ("snapshot", "tier", "commitlog")


class RebuildGapError(TierlogError):
    """Some messages are in neither source: the view cannot be rebuilt without them."""


@dataclass
class RebuildReport:
    snapshot_keys: int = 0
    tier_messages: int = 0
    commitlog_messages: int = 0
    applied_through: int = 0
    expired: int = 0


def rebuild_view(
    kv_path: str,
    *,
    commitlog_dir: str,
    tier_location: str,
    broker: str = DEFAULT_BROKER,
    source: str = "snapshot",
    ttl: dict[str, float] | None = None,
    key_property: str = "KEYS",
    progress: Callable[[str], None] = log.info,
    topics: TopicFilter | None = None,
    references: ReferencePolicy | None = None,
) -> RebuildReport:
    """``references``: which values read from the tier the new view keeps there (the service's
    ``compaction.reference_min_bytes``); those from snapshots and the commitlog are copies."""
    if source not in SOURCES:
        raise TierlogError(f"unknown rebuild source {source!r}: use one of {', '.join(SOURCES)}")
    if os.path.exists(kv_path):
        KVView(kv_path).close()  # refuses (RocksDB's lock) while `tierlog run` has the view open
    building = kv_path.rstrip("/") + ".rebuild"
    shutil.rmtree(building, ignore_errors=True)
    report = RebuildReport()
    # A crash leaves only a .rebuild to throw away.
    with KVView(building, ttl=ttl, durable="close", tier=tier_location, broker=broker) as kv:
        cursor = 0
        if source == "snapshot":
            cursor = _from_snapshots(kv, tier_location, broker, report, progress)
        if source in ("snapshot", "tier"):
            cursor = _from_tier(kv, tier_location, broker, cursor, report, progress, topics, references)
        report.applied_through = _from_commitlog(kv, commitlog_dir, cursor, key_property, report, progress,
                                                 must_start_at_zero=source == "commitlog", topics=topics)
        if ttl:
            report.expired = len(kv.expire(_now_ms()))
    _swap(building, kv_path)
    return report


def _from_snapshots(kv: KVView, tier_location: str, broker: str, report: RebuildReport, progress) -> int:
    backend = open_backend(tier_location)
    try:
        latest = snapshots.latest_snapshots(backend, broker)
        if not latest:
            progress("no compacted snapshot in the tier: replaying the tier from its start")
            return 0
        for snap in latest.values():
            table = snapshots.read_snapshot(backend, snap)
            rows = table.append_column("topic", pa.array([snap.topic] * table.num_rows, pa.string()))
            rows = rows.append_column("deleted", pa.array([False] * table.num_rows))
            kv.apply_table(rows)
            report.snapshot_keys += table.num_rows
            progress(f"snapshot {snap.name}: {table.num_rows} key(s) through physical offset {snap.through_phy}")
        return min(s.through_phy for s in latest.values())
    finally:
        backend.close()


def _from_tier(kv: KVView, tier_location: str, broker: str, cursor: int, report: RebuildReport, progress,
               topics: TopicFilter | None = None, references: ReferencePolicy | None = None) -> int:
    reader = TierReader(tier_location, broker=broker)  # the view holds this broker's keys; physical offsets are its own
    state = reader.committed()
    if state.source_end is None or state.source_end <= cursor:
        return cursor
    queues = reader.queues(state)
    next_report = time.monotonic() + 5
    for i, (topic, queue_id) in enumerate(queues):
        table = reader.read_queue(topic, queue_id, state)
        table = table.filter(pc.greater_equal(table["phy_offset"], cursor))
        if table.num_rows:
            rows = keyed_rows(table, topics)
            kv.apply_table(rows, referenced=references.mask(rows["topic"], rows["size"], rows["deleted"])
                           if references else None)
            report.tier_messages += table.num_rows
        if time.monotonic() >= next_report:
            progress(f"tier: {i + 1} of {len(queues)} queue(s), {report.tier_messages} message(s) so far")
            next_report = time.monotonic() + 5
    progress(f"tier: {report.tier_messages} message(s) from physical offset {cursor} to {state.source_end}")
    return state.source_end


def _from_commitlog(kv: KVView, commitlog_dir: str, cursor: int, key_property: str, report: RebuildReport,
                    progress, *, must_start_at_zero: bool, topics: TopicFilter | None = None) -> int:
    with CommitLogReader(commitlog_dir) as reader:
        first, end = reader.first_offset(), reader.end_offset()
        if first > cursor and (must_start_at_zero or cursor < end):
            raise RebuildGapError(
                f"messages from physical offset {cursor} to {first} are in neither the tier nor the local "
                f"commitlog {commitlog_dir} (its first file starts at {first}); rebuild from the tier "
                "(`tierlog kv rebuild --from tier`) or restore those files"
            )
        start = max(cursor, first)
        report.commitlog_messages += replay_messages(kv, reader, start, end, key_property, topics)
        kv.apply([], applied_through=max(end, cursor))
        progress(f"commitlog: {report.commitlog_messages} message(s) from physical offset {start} to {end}")
        return max(end, cursor)


def _swap(building: str, target: str) -> None:
    old = target.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(target):
        os.rename(target, old)
    os.rename(building, target)
    shutil.rmtree(old, ignore_errors=True)


def _now_ms() -> int:
    return int(time.time() * 1000)
