"""Message tables: one Iceberg table per topic whose data files are the tier's sealed segments.

The contract: after ``sync(seq, ...)`` returns, each table holds exactly the segments that this
broker's tier commit records up to ``seq`` left committed (sealed and not expired), registered in
place with pyiceberg (``add_files`` reads each footer for the column statistics; no byte is
copied), and no other object of this broker.  Other brokers' files in the same table are never
touched, so several brokers may commit to one table; a commit that loses a race is retried
against the table's new state.

Why this shape: the table follows the tier's commit log, as a Kafka sink follows a topic.  Each
table records the last tier record it reflects (table property ``tierlog.tier-seq.<broker>``, and
the snapshot summary); a sync applies the seal and expire records after it.  A new process, or one
after a fold folded records it never saw (a catalog that was away), first reconciles each table,
a bounded part per call: a table whose record the log's tail still covers takes the records since,
any other is diffed against the tier.  Both are idempotent, so a crash between a seal and its
table commit is repaired by the next sync, and the writer deletes an expired segment's object only
once the tables no longer list it (``TierWriter.maintain``).
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
# Why a budget: the first sync of a process looked at every table and read every manifest, O(the
# retained segments), inside one maintenance call and so inside one batch.  It now does this much per
# call and goes on in the next; the tables, and the deletes they hold, catch up over a few batches.
RECONCILE_BUDGET_S = 0.1
FILES_PER_COMMIT = 500  # add_files reads each new file's footer: a topic's backlog goes in parts


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
        # The first reconciliation's tables still to look at, (name, topic or None: learned on
        # loading); None: not begun by this process.
        self._todo: list[tuple[str, str | None]] | None = None
        self._base = -1  # the tier record every table not in ``_todo`` reflects
        self._tier_topics: set[str] = set()  # the topics with queues when the reconciliation began
        self._resumed: dict | None = None  # where the last clean stop left the tables (resume)
        self._last_commit = float("-inf")

    # ------------------------------------------------------------ sync

    def sync(self, seq: int, tail: list[dict], topics: Callable[[], Iterable[str]],
             segments_of: Callable[[str], Iterable[Segment]]) -> bool:
        """Bring the tables toward tier record ``seq``; ``tail`` holds the records after the last
        fold, ``topics()`` the topics this broker's tier holds queues of, ``segments_of(topic)``
        their committed segments.  True: every table is in step with ``seq``.  False: some wait,
        for ``commit_interval_s`` or for a later call of the reconciliation, which does at most
        ``RECONCILE_BUDGET_S`` of work per call so that it never holds a batch."""
        if self._todo is None:
            self._resume_or_start(seq, topics)  # a new process
        if not _tail_covers(tail, self._base, seq):
            self._start(seq, topics())  # records it never saw were folded away
        pending = {name for name, _ in self._todo}
        changes = {t: c for t, c in _changes_in(tail, self._base).items() if self._name(t) not in pending}
        if changes and self._waiting():
            return False
        try:
            for topic, change in sorted(changes.items()):
                self._commit(topic, (change, seq))
            self._base = seq
            if self._todo:
                self._reconcile(seq, tail, segments_of)
        except BaseException:
            self._todo = None  # a commit may have landed before the failure: reconcile again
            self._tables.clear()
            raise
        if changes:
            self._last_commit = time.monotonic()
        return not self._todo

    @property
    def synced_seq(self) -> int | None:
        """The tier record every table is in step with; None while some are not."""
        return self._base if self._todo == [] else None

    def stopped(self) -> dict:
        """What a clean stop in step records (``resume`` takes it): the tier record, the catalog
        and name template, and the tables the namespace lists."""
        return {"seq": self.synced_seq, "catalog": self._catalog_id(), "tables": sorted(self._table_names())}

    def resume(self, stopped: dict) -> None:
        """The tables were in step with tier record ``stopped["seq"]`` when the last process
        stopped: the first sync takes the records since from the log, with no reconciliation, if
        the catalog is the same and still lists those tables."""
        self._resumed = stopped

    def _catalog_id(self) -> str:
        s = self.settings
        return f"{s.catalog_uri} {s.warehouse} {s.namespace} {s.name}"

    def _resume_or_start(self, seq: int, topics: Callable[[], Iterable[str]]) -> None:
        stopped, self._resumed, listed = self._resumed, None, None
        if stopped is not None and stopped["catalog"] == self._catalog_id() and stopped["seq"] <= seq:
            listed = self._table_names()
            if set(stopped["tables"]) <= listed:
                self._todo, self._base = [], stopped["seq"]
                return
            log.warning("the Iceberg catalog %s lost tables since the last stop: reconciling every table",
                        self.settings.catalog_uri)
        self._start(seq, topics(), listed)

    @property
    def reconciling(self) -> bool:
        """A reconciliation has tables left that the next call can take (no interval to wait for)."""
        return bool(self._todo) and not self._waiting()

    def _table_names(self) -> set[str]:
        """The names of every table in the namespace, of any kind (one catalog call)."""
        return {ident[-1] for ident in self.catalog.list_tables(self.settings.namespace)}

    def _start(self, seq: int, topics: Iterable[str], listed: set[str] | None = None) -> None:
        """List what a reconciliation must look at: each tier topic's table, and every other table
        of the namespace (it may hold this broker's expired segments); ``listed``: the namespace's
        table names, when the caller has them already."""
        mine = {self._name(t): t for t in topics}
        others = sorted((self._table_names() if listed is None else listed) - mine.keys())
        self._todo = [(n, mine[n]) for n in sorted(mine)] + [(n, None) for n in others]
        self._tier_topics = set(mine.values())
        self._base = seq

    def _waiting(self) -> bool:
        return time.monotonic() - self._last_commit < self.settings.commit_interval_s

    def _reconcile(self, seq: int, tail: list[dict], segments_of: Callable[[str], Iterable[Segment]]) -> None:
        """Bring the reconciliation's tables in step with ``seq``, within the budget: a table whose
        own record (``tierlog.tier-seq.<broker>``) the tail still covers takes the tail's changes
        since it, with no manifest read; any other is diffed against the tier."""
        deadline = time.monotonic() + RECONCILE_BUDGET_S
        worked = False
        while self._todo:
            if worked and time.monotonic() > deadline:
                return  # at least one table, or one commit, per call
            worked = True
            name, topic = self._todo[0]
            if topic is None:
                topic = self._topic_of(name)
                if topic is None or topic in self._tier_topics:
                    self._todo.pop(0)  # another kind's table, or one this process reaches by its name
                    continue
            change = self._reconciliation(topic, seq, tail, segments_of)
            if change.add or change.remove:
                if self._waiting():
                    return
                whole = len(change.add) <= FILES_PER_COMMIT
                if not whole:  # the rest in a later call; the table's own record stays where it was
                    change = Change(dict(sorted(change.add.items())[:FILES_PER_COMMIT]), change.remove)
                self._commit(topic, (change, seq if whole else None))
                self._last_commit = time.monotonic()
                if not whole:
                    self._todo[0] = (name, topic)
                    continue
            self._todo.pop(0)

    def _topic_of(self, name: str) -> str | None:
        """The topic of table ``name`` if it is one of this kind's tables, else None."""
        table = self.catalog.load_table((self.settings.namespace, name))
        if table.properties.get(KIND) != self.kind or TOPIC not in table.properties:
            return None
        self._tables.setdefault(table.properties[TOPIC], table)
        return table.properties[TOPIC]

    def _reconciliation(self, topic: str, seq: int, tail: list[dict],
                        segments_of: Callable[[str], Iterable[Segment]]) -> Change:
        exists = topic in self._tables or self.catalog.table_exists(self._identifier(topic))
        if exists:
            recorded = self._table(topic).properties.get(SEQ + self.broker)
            if recorded is not None and int(recorded) <= seq and _tail_covers(tail, int(recorded), seq):
                return _changes_in(tail, int(recorded)).get(topic, Change({}, set()))
        return _change({s.name: s for s in segments_of(topic)}, set(self._own_files(topic)) if exists else set())

    def rebuild(self, seq: int, segments: Iterable[Segment]) -> int:
        """Make every table equal to ``segments`` (the tier alone); returns the tables committed."""
        changes = self._diff(segments)
        for topic, change in sorted(changes.items()):
            self._commit(topic, (change, seq))
        self._todo, self._base = [], seq
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
            change = _change(wanted, set(self._own_files(topic)) if topic in listed else set())
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
        summary = {"tierlog.broker": self.broker}
        if seq is not None:
            summary["tierlog.tier-seq"] = str(seq)
        with table.transaction() as tx:
            if remove:
                with tx.update_snapshot(snapshot_properties=summary).overwrite() as overwrite:
                    for data_file in remove:
                        overwrite.delete_data_file(data_file)
                    for uri in add:
                        overwrite.append_data_file(parquet_file_to_data_file(table.io, tx.table_metadata, uri))
            elif add:
                tx.add_files(add, snapshot_properties=summary, check_duplicate_files=False)
            if seq is not None:
                tx.set_properties({SEQ + self.broker: str(seq)})
            elif SEQ + self.broker in table.properties:  # a part of a backlog: in step with no record yet
                tx.remove_properties(SEQ + self.broker)
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


def _change(wanted: dict[str, Segment], have: set[str]) -> Change:
    """What a table holding ``have`` must gain and lose to hold exactly ``wanted``."""
    return Change({n: s for n, s in wanted.items() if n not in have}, have - set(wanted))


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
