"""Message tables: one Iceberg table per topic whose data files are the tier's sealed segments.

The contract: after ``sync(seq, ...)`` returns, each table holds exactly the segments that this
broker's tier commit records up to ``seq`` left committed (sealed and not expired), registered in
place with pyiceberg (``add_files`` reads each footer for the column statistics; no byte is
copied), and no other object of this broker.  Other brokers' files in the same table are never
touched, so several brokers may commit to one table; a commit that loses a race is retried
against the table's new state.

Why this shape: the table follows the tier's commit log, as a Kafka sink follows a topic.  Each
table records the last tier record it reflects (table property ``tierlog.tier-seq.<broker>``, and
the snapshot summary); a sync applies the seal and expire records after it, or, when a fold has
folded records this process never saw (a crash, a catalog that was away), diffs the table's
files against the tier's.  Both are idempotent, so a crash between a seal and its table commit is
repaired by the next sync, and the writer deletes an expired segment's object only once the
tables no longer list it (``TierWriter.maintain``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from connectors.faults import crash_point
from connectors.tables.base import TopicTables
from connectors.tier.layout import Names, escape_topic
from connectors.tier.manifest import Segment

log = logging.getLogger(__name__)
SEQ = "tierlog.tier-seq."  # + broker


@dataclass
class Change:
    """What one topic's table must gain and lose, as tier object names."""

    add: dict[str, Segment]
    remove: set[str]


class MessageTables(TopicTables):
    """Keeps one broker's sealed segments registered in the per-topic tables.  Not thread-safe."""

    kind = "messages"

    def __init__(self, settings, tier_location: str, broker: str, catalog=None):
        super().__init__(settings, tier_location, broker, catalog)
        self.names = Names(broker)
        self.synced_seq: int | None = None  # None: not synced by this process; the first sync diffs
        self._last_commit = float("-inf")

    # ------------------------------------------------------------ sync

    def sync(self, seq: int, tail: list[dict], all_segments: Callable[[], Iterable[Segment]]) -> bool:
        """Bring the tables to tier record ``seq``; ``tail`` holds the records after the last fold,
        ``all_segments()`` every committed segment of this broker.  False: a change is waiting for
        ``commit_interval_s``, and the tables stay where they were."""
        if self.synced_seq == seq:
            return True
        if self.synced_seq is None or not _tail_covers(tail, self.synced_seq, seq):
            changes = self._diff(all_segments())
        else:
            changes = _changes_in(tail, self.synced_seq)
        if not changes:  # records that change no table (commits, folds) need no commit and no wait
            self.synced_seq = seq
            return True
        if time.monotonic() - self._last_commit < self.settings.commit_interval_s:
            return False
        try:
            for topic, change in sorted(changes.items()):
                self._commit(topic, (change, seq))
        except BaseException:
            self.synced_seq = None  # a commit may have landed before the failure: diff next time
            self._tables.clear()
            raise
        self.synced_seq = seq
        self._last_commit = time.monotonic()
        return True

    def rebuild(self, seq: int, segments: Iterable[Segment]) -> int:
        """Make every table equal to ``segments`` (the tier alone); returns the tables committed."""
        changes = self._diff(segments)
        for topic, change in sorted(changes.items()):
            self._commit(topic, (change, seq))
        self.synced_seq = seq
        return len(changes)

    def _diff(self, segments: Iterable[Segment], listed: dict | None = None) -> dict[str, Change]:
        by_topic: dict[str, dict[str, Segment]] = {}
        for seg in segments:
            by_topic.setdefault(seg.topic, {})[seg.name] = seg
        listed = self._listed() if listed is None else listed
        self._tables.update(listed)  # loaded once: _own_files and the commits below use these
        for topic in listed:
            by_topic.setdefault(topic, {})
        changes = {}
        for topic, wanted in by_topic.items():
            have = set(self._own_files(topic)) if topic in listed else set()
            change = Change({n: s for n, s in wanted.items() if n not in have}, have - set(wanted))
            if change.add or change.remove:
                changes[topic] = change
        return changes

    def _commit_once(self, topic: str, change_at: tuple[Change, int]) -> None:
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        change, seq = change_at
        table = self._table(topic)
        # The table's files are read only when some go: a seal's segments are new names (a sync
        # after a crash diffs first), and reading every manifest per commit was most of its cost.
        have = self._own_files(topic) if change.remove else {}
        add = [self._uri(n) for n in sorted(change.add) if n not in have]
        remove = [have[n] for n in sorted(change.remove) if n in have]
        summary = {"tierlog.broker": self.broker, "tierlog.tier-seq": str(seq)}
        with table.transaction() as tx:
            if remove:
                with tx.update_snapshot(snapshot_properties=summary).overwrite() as overwrite:
                    for data_file in remove:
                        overwrite.delete_data_file(data_file)
                    for uri in add:
                        overwrite.append_data_file(parquet_file_to_data_file(table.io, tx.table_metadata, uri))
            elif add:
                tx.add_files(add, snapshot_properties=summary, check_duplicate_files=False)
            tx.set_properties({SEQ + self.broker: str(seq)})
            crash_point("table_committing")
        crash_point("table_committed")  # the transaction has brought ``table`` to the new metadata
        self._expire_snapshots(topic)
        if add or remove:
            log.info("table %s: %d segments added, %d removed (tier record %d)", self._name(topic),
                     len(add), len(remove), seq)

    def _expire_snapshots(self, topic: str) -> None:
        """Keep the newest ``snapshots_kept`` snapshots, expiring in steps, so not at every commit."""
        table, keep = self._tables[topic], self.settings.snapshots_kept
        snapshots = sorted(table.metadata.snapshots, key=lambda s: s.timestamp_ms)
        if len(snapshots) < keep + max(10, keep // 5):
            return
        current = table.current_snapshot().snapshot_id
        self._expire(topic, [s for s in snapshots[:-keep] if s.snapshot_id != current])

    def info(self, tier_seq: int | None = None, segments: Iterable[Segment] | None = None) -> list[dict]:
        """One row per message table: what ``tierlog table info`` prints.  With ``segments`` (the
        tier's committed ones), ``lag_segments`` counts what the table has yet to add or remove."""
        listed = self._listed()
        changes = self._diff(segments, listed) if segments is not None else {}
        rows = []
        for topic, table in sorted(listed.items()):
            snapshot = table.current_snapshot()
            seq = table.properties.get(SEQ + self.broker)
            change = changes.get(topic, Change({}, set()))
            rows.append({"table": ".".join(self._identifier(topic)), "kind": self.kind, "topic": topic,
                         "metadata_location": table.metadata_location,
                         "snapshot_id": snapshot.snapshot_id if snapshot else None,
                         "tier_seq": int(seq) if seq is not None else None, "tier_head_seq": tier_seq,
                         "lag_segments": len(change.add) + len(change.remove) if segments is not None else None})
        return rows

    # ------------------------------------------------------------ tables

    def _name_template(self) -> str:
        return self.settings.name

    def _own_files(self, topic: str) -> dict[str, object]:
        """This broker's data files in the table's current snapshot, by tier object name."""
        return self._files(topic, f"topic={escape_topic(topic)}/{self.names.level}")

    def _schema_and_spec(self):
        return _schema_and_spec()


def _tail_covers(tail: list[dict], after: int, seq: int) -> bool:
    """Whether ``tail`` holds every record in ``(after, seq]``: nothing was folded away unseen."""
    if seq <= after:
        return True
    return bool(tail) and tail[0]["seq"] <= after + 1 and tail[-1]["seq"] >= seq


def _changes_in(tail: list[dict], after: int) -> dict[str, Change]:
    changes: dict[str, Change] = {}
    for record in tail:
        if record["seq"] <= after or record["type"] not in ("seal", "expire"):
            continue
        for raw in record["segments"]:
            seg = Segment.from_json(raw)
            change = changes.setdefault(seg.topic, Change({}, set()))
            if record["type"] == "seal":
                change.add[seg.name] = seg
                change.remove.discard(seg.name)
            else:
                change.add.pop(seg.name, None)
                change.remove.add(seg.name)
    return changes


def _schema_and_spec():
    """The message row as an Iceberg schema, partitioned by broker and queue: each segment is one
    queue of one broker, so ``add_files`` finds each partition value in the file's statistics."""
    from pyiceberg.io.pyarrow import _pyarrow_to_schema_without_ids
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import assign_fresh_schema_ids
    from pyiceberg.transforms import IdentityTransform

    from connectors.commitlog.arrow import MESSAGE_SCHEMA

    schema = assign_fresh_schema_ids(_pyarrow_to_schema_without_ids(MESSAGE_SCHEMA))
    spec = PartitionSpec(
        PartitionField(schema.find_field("broker").field_id, 1000, IdentityTransform(), "broker"),
        PartitionField(schema.find_field("queue_id").field_id, 1001, IdentityTransform(), "queue_id"),
    )
    return schema, spec
