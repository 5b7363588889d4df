"""Message tables: one Iceberg table per topic holding every message the tier has committed, within
seconds of its commit.

The contract: after a round (``sync``) that found a topic due, that topic's table holds exactly the
tier's committed, retained messages of the moment the round looked (its ``TierView``), each once:
its queues' sealed segments, registered where they lie (no byte copied), and *fresh files*, Parquet
files of the rows committed since, written by the tables under ``_tables/fresh/``, where the tier's
Parquet globs and readers never look.  ``connectors.tables.fresh`` decides what each commit
removes, registers and adds; ``connectors.tables.view`` reads the rows it adds; this module
decides when, writes the files and commits.  Other brokers' files in the same table are never
touched, so several brokers may commit to one table; a commit that loses a race is retried
against the table's new state.

When: a topic's table commits at most every ``commit_interval_s``, once its new rows reach
``min_commit_bytes`` or have waited ``max_commit_delay_s``, and all tables together at most
``commits_per_minute`` times a minute (the request budget: each commit is a few PUTs), the topics
that waited longest first.  A quiet broker with no new rows commits nothing.

Why fresh files and not the staging objects: an Iceberg data file is a whole file, and a staging
object holds every topic of a batch.  Why the two partition specs: ``connectors.tables.commit``.

Crash safety: a fresh file is written before the commit that lists it; one no commit lists (a
crash between the two) is deleted by the next process's reconciliation, as are files whose last
listing snapshot expired.  A new process rebuilds each topic's state from its table (a table's
segments, its fresh files and their queues, which each file's footer carries) and the tier, a
bounded part per round, unless the metadata store kept the state its table still matches.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.bodies.base import ERRORS, ERRORS_TYPE, WHOLE, Typed, as_schema
from connectors.bodies.formats import BodyFormats
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.faults import crash_point
from connectors.tables import fresh
from connectors.tables.base import KIND, TOPIC, TopicTables, find_spec, spec_with
from connectors.tables.catalog import data_location
from connectors.tables.typed import TYPED_PREFIX, copy_name, grow, is_long, source_of, typed_parquet, typed_schema, \
    versioned, widening
from connectors.tables.view import StagingParts, TierView, oldest_ms, parts_from, read_rows, staging_parts
from connectors.tier import layout
from connectors.tier.layout import Names, escape_topic
from connectors.tier.manifest import Segment

log = logging.getLogger(__name__)
SEQ = "tierlog.tier-seq."  # + broker: the tier record whose rows the table held at its last commit
COVER = "tierlog.cover."  # + broker: [[queue, one past the highest offset the table holds], ...]
UNREADABLE = "tierlog.unreadable-bodies."  # + broker: the bodies of a typed topic its format could not read, so far
FRESH_PREFIX = "_tables/fresh/"
QUEUES_KEY = b"tierlog.queues"  # a fresh file's footer: [[queue, first, last], ...] of the rows it holds
# Why a budget: the first round of a process looks at every table and reads its manifests and the
# tier's segments, O(the retained segments): it does this much per round and goes on in the next,
# so it never holds a tiering batch for long.
RECONCILE_BUDGET_S = 0.1
FILES_PER_COMMIT = 500  # segments registered in one commit, at most: a backlog goes in parts


class _TableMoved(Exception):
    """The table is at a snapshot of this broker that this process did not make."""


class _Rewritten(_TableMoved):
    """A column widened and this broker's files were rewritten to it: plan again from the table.
    ``retired``: the files the rewrite took out, by the sequence number of the snapshot that did."""

    def __init__(self, topic: str, retired: dict[str, int]):
        super().__init__(topic)
        self.retired = retired


@dataclass
class _Topic:
    """A topic's table as this process knows it."""

    state: fresh.TopicState
    snapshot: int | None = None  # the table's current snapshot when the state was last true of it
    seen: int = -1  # the last commit record of the tier the state took
    waiting_since: float | None = None  # monotonic: when the table first had work not committed
    last_commit: float = float("-inf")
    caught_up_at: float | None = None  # the view time at which it last held every committed row
    retired: dict[str, int] = field(default_factory=dict)  # fresh files it removed -> the removal's sequence

    def record(self) -> dict:
        return {"state": self.state.to_json(), "snapshot": self.snapshot, "seen": self.seen}


class MessageTables(TopicTables):
    """Keeps one broker's part of the per-topic message tables in step with its tier.  Not thread-safe.

    ``states``: where each topic's state is kept after each commit (``state.metadata.MetadataStore``:
    ``table_state``, ``record_table_state``), so a new process whose table is as it left it takes
    the state back instead of reading the table's manifests; None: every new process reconciles."""

    kind = "messages"

    def __init__(self, settings, tier_location: str, broker: str, catalog=None, backend=None, states=None):
        super().__init__(settings, tier_location, broker, catalog)
        self.names = Names(broker)
        self._backend = backend
        self.states = states
        self._topics: dict[str, _Topic] = {}
        self._todo: list[tuple[str, str | None]] | None = None  # still to look at: (table name, topic or None)
        self._commits: deque[float] = deque()  # monotonic times of the last minute's commits
        self._lag: dict[str, tuple[int, int | None]] = {}  # topic -> (rows behind, commit ms of the oldest)
        self._parts = StagingParts()  # the staging objects' parts, kept from round to round
        self._last: TierView | None = None  # the view of the last round
        self.formats = BodyFormats(settings.body_formats)
        self.unreadable: dict[str, int] = {}  # per topic: bodies its format could not read, since this process started
        self._copies_removed: dict[str, list[str]] = {}  # per topic: the typed copies its last commit took out
        self.commits = 0  # commits made, since this process started
        self.files_written = 0  # fresh files written, likewise

    @property
    def backend(self):
        if self._backend is None:
            from connectors.tier.location import open_backend

            self._backend = open_backend(self.tier_location)
        return self._backend

    # ------------------------------------------------------------ a round

    def sync(self, view: TierView, *, hold: bool = True) -> bool:
        """One round at ``view``: take each table's state (back from the metadata store, or
        reconciled from the table and the tier: a bounded part a round), the seal and expire records
        since, and commit each table that is due (every one with work, ``hold`` off).  True when
        every table holds every row ``view`` has."""
        self._last = view
        if self._todo is None:
            self._start(view)
        for topic in sorted(view.topics() - set(self._topics) - {t for _, t in self._todo}):
            self._todo.append((self._name(topic), topic))  # a topic new to the tier
        if self._todo:
            self._reconcile(view)
        self._take_records(view)
        due = self._due(view, hold)
        if due:
            self._commit_round(view, due)
        return self.synced_at is not None and self.synced_at >= view.at

    @property
    def synced_at(self) -> float | None:
        """The view time up to which every table held every committed row and let go of every
        expired segment: objects the tier retired before it may be deleted.  None while a table
        is still to be reconciled or to catch up."""
        if self._todo is None or self._todo:
            return None
        times = [t.caught_up_at for t in self._topics.values()]
        return None if any(t is None for t in times) else min(times, default=self._last.at if self._last else None)

    @property
    def synced_seq(self) -> int | None:
        """The tier record whose every row every table held at the last round; None while some did not."""
        last = self._last
        if last is None or self._todo != [] or any(t.caught_up_at != last.at for t in self._topics.values()):
            return None
        return last.seq

    @property
    def reconciling(self) -> bool:
        """Tables are left that a round must reconcile before they commit."""
        return bool(self._todo)

    def lag(self) -> dict[str, tuple[int, float]]:
        """Per table, as of the last round: the committed messages it lacks, and how long the oldest
        of them has waited (seconds)."""
        now_ms = time.time() * 1000  # the round worked out what lags; asking (the metrics' clock) only reads it
        return {topic: (messages, round(max(0.0, now_ms - oldest) / 1000, 1) if oldest is not None else 0.0)
                for topic, (messages, oldest) in self._lag.items()}

    def holds(self, topic: str, queue_id: int) -> int | None:
        """The lowest offset of the queue a fresh file of its table holds (None: none): retention
        leaves the segments at and past it alone until the file goes, so a table never lists a row
        retention dropped."""
        known = self._topics.get(topic)
        if known is None:
            return None
        held = [f.queues[queue_id][0] for f in known.state.files.values() if queue_id in f.queues]
        return min(held, default=None)

    def _take_records(self, view: TierView) -> None:
        """The seal and expire records each topic's state has not taken; a topic whose records the
        tier folded away unseen is reconciled again."""
        for topic, known in list(self._topics.items()):
            if known.seen >= view.seq:
                continue
            if not _tail_covers(view.records, known.seen, view.seq):
                log.info("table %s: the tier folded records it had not taken; reconciling it", self._name(topic))
                self._reconcile_topic(topic, view)
                continue
            sealed, expired = [], []
            for record in view.records:
                if record["seq"] > known.seen and record["type"] in ("seal", "expire"):
                    into = sealed if record["type"] == "seal" else expired
                    into += [s for raw in record["segments"] if (s := Segment.from_json(raw)).topic == topic]
            fresh.take_records(known.state, sealed, expired)
            known.seen = view.seq

    def _due(self, view: TierView, hold: bool) -> list[tuple[str, fresh.Plan]]:
        """The topics whose table commits this round, with their plans, longest waiting first."""
        now, s = time.monotonic(), self.settings
        while self._commits and now - self._commits[0] > 60:
            self._commits.popleft()
        waiting, lag = [], {}
        parts = self._parts.of(view)
        for topic in sorted(view.topics()):
            known = self._topics.get(topic)
            if known is None:
                continue  # still to reconcile
            plan = fresh.plan(known.state, view.queues_of(topic), FILES_PER_COMMIT)
            lag[topic] = (sum(b - a for a, b in plan.rows.values()), oldest_ms(topic, plan.rows, parts))
            if not plan.rows and not plan.unregister:
                known.caught_up_at = view.at
            if plan.empty:
                known.waiting_since = None
                continue
            if known.waiting_since is None:
                known.waiting_since = now
            pending = sum(b for q, (a, _end) in plan.rows.items() for _last, b, _ms in parts_from(parts, (topic, q), a))
            ready = not hold or (now - known.last_commit >= s.commit_interval_s and (
                pending >= s.min_commit_bytes or now - known.waiting_since >= s.max_commit_delay_s))
            if ready:
                waiting.append((known.waiting_since, topic, plan))
        self._lag = lag  # whole, for ``lag`` on another thread
        waiting.sort(key=lambda w: (w[0], w[1]))
        room = len(waiting) if not hold else max(0, s.commits_per_minute - len(self._commits))
        return [(topic, plan) for _, topic, plan in waiting[:room]]

    def _commit_round(self, view: TierView, due: list[tuple[str, fresh.Plan]]) -> None:
        rows, covered = read_rows(view, due, lambda topic: self._topics[topic].state.pending, self.backend)
        for topic, plan in due:
            try:
                self._commit_topic(view, topic, plan, rows.get(topic), covered.get(topic, {}))
            except _TableMoved as moved:
                # Another process of this broker committed to the table since this one planned (a
                # ``tierlog table rebuild``), or a widened column rewrote its files: the table says
                # what it holds, and the next round plans anew.
                if not isinstance(moved, _Rewritten):
                    log.info("table %s changed outside this process: taking its state afresh", self._name(topic))
                self._reconcile_topic(topic, view)
                if isinstance(moved, _Rewritten):
                    self._topics[topic].retired.update(moved.retired)
            except BaseException:
                # The commit may have landed before the failure: the table, not this state, says what
                # it holds, and a fresh file no commit lists is deleted when the table is reconciled.
                self._topics.pop(topic, None)
                self._tables.pop(topic, None)
                if self._todo is not None:
                    self._todo.append((self._name(topic), topic))
                raise

    # ------------------------------------------------------------ commits

    def _commit_topic(self, view: TierView, topic: str, plan: fresh.Plan, rows: pa.Table | None,
                      covered: dict[int, int]) -> None:
        from connectors.tables.commit import described

        known = self._check_snapshot(topic, view)
        table = self._table(topic)
        register = plan.register  # at most FILES_PER_COMMIT: a backlog goes in parts (``fresh.plan``)
        added = None
        if rows is not None and not rows.num_rows:
            rows = None
        if self.formats.typed(topic):
            segments, rows_typed, unreadable = self._typed(topic, table, register, rows, plan.remove,
                                                           known.state.cover)
            table = self._tables[topic]
            add = [self._typed_copy(table, seg, seg_rows, typed) for seg, seg_rows, typed in segments]
        else:
            rows_typed, unreadable = None, 0
            add = [self._segment_file(table, seg) for seg in register]
        if rows is not None:
            name, data, queues = self._fresh_file(view.seq, topic, rows, rows_typed)
            self.backend.put(name, data)
            self.files_written += 1
            crash_point("table_fresh_written")
            footer = pq.read_metadata(pa.BufferReader(data))
            add.append(described(table.metadata, self._fresh_spec(table), self._uri(name), footer, len(data)))
            added = fresh.FreshFile(name, queues)
        remove_names = ({self._uri(n) for n in plan.remove}, {s.name for s in plan.unregister})
        summary = {"tierlog.broker": self.broker, "tierlog.tier-seq": str(view.seq)}
        props = {SEQ + self.broker: str(view.seq)}
        cover = dict(known.state.cover)
        for q, end in {**plan.registered, **covered}.items():
            cover[q] = max(cover.get(q, 0), end)
        props[COVER + self.broker] = json.dumps(sorted(cover.items()), separators=(",", ":"))
        if unreadable:
            props[UNREADABLE + self.broker] = str(int(table.properties.get(UNREADABLE + self.broker, 0)) + unreadable)
        summary["tierlog.commit"] = uuid.uuid4().hex  # a retry finds whether this commit landed
        self._commit(topic, (add, remove_names, summary, props))
        table = self._tables[topic]
        fresh.apply(known.state, plan, added, covered)
        known.snapshot = table.current_snapshot().snapshot_id
        removed_seq = table.current_snapshot().sequence_number
        for name in plan.remove:
            known.retired[name] = removed_seq
        for name in self._copies_removed.pop(topic, ()):  # typed copies taken out: the table's own
            known.retired[name] = removed_seq
        self._keep(topic)
        self.commits += 1
        known.last_commit = time.monotonic()
        self._commits.append(known.last_commit)
        rest = fresh.plan(known.state, view.queues_of(topic))
        known.waiting_since = None if rest.empty else known.waiting_since
        if not rest.rows:
            known.caught_up_at = view.at
        self._expire_snapshots(topic)
        log.debug("table %s: %d rows added, %d fresh files removed, %d segments registered, %d removed (tier "
                  "record %d)", self._name(topic), 0 if rows is None else rows.num_rows, len(plan.remove),
                  len(register), len(plan.unregister), view.seq)

    def _commit_once(self, topic: str, change) -> None:
        from connectors.tables.commit import replace, spec_files

        add, remove_names, summary, props = change
        table = self._table(topic)
        if any((s.summary or {}).get("tierlog.commit") == summary["tierlog.commit"] for s in table.metadata.snapshots):
            return  # an attempt before landed, and its answer was lost
        if not self._others_only(table, self._topics[topic]):
            raise _TableMoved(topic)  # the plan was made against a table this broker has changed since
        remove, snapshot = [], table.current_snapshot()
        # Each spec's manifests are read only for the files of it that go: fresh files' always few,
        # the segments' only when retention expired one.
        fresh_uris, segment_names = remove_names
        if fresh_uris and snapshot is not None:
            remove += [f for f in spec_files(table, snapshot, self._fresh_spec(table)) if f.file_path in fresh_uris]
        if segment_names and snapshot is not None:
            gone = [f for f in spec_files(table, snapshot, self._segment_spec(table))
                    if source_of(self._name_of(f.file_path) or "") in segment_names]
            remove += gone
            added = {f.file_path for f in add}
            self._copies_removed[topic] = [self._name_of(f.file_path) for f in gone if f.file_path not in added
                                           and self._name_of(f.file_path).startswith(TYPED_PREFIX)]
        with table.transaction() as tx:
            replace(tx, add, remove, summary)
            tx.set_properties(props)
            crash_point("table_committing")
        crash_point("table_committed")  # the transaction has brought ``table`` to the new metadata

    def _check_snapshot(self, topic: str, view: TierView) -> _Topic:
        """The topic's state, taken afresh from the table and the tier when something else of this
        broker changed the table since this process knew it (``tierlog table rebuild`` while the
        service was stopped, say)."""
        known = self._topics[topic]
        table = self._table(topic)
        if not self._others_only(table, known):
            log.info("table %s changed outside this process: taking its state afresh", self._name(topic))
            self._reconcile_topic(topic, view)
            known = self._topics[topic]
        return known

    def _others_only(self, table, known: _Topic) -> bool:
        """Whether the table is at the snapshot this process knows, or every one after it was another
        broker's."""
        current = table.current_snapshot()
        if (None if current is None else current.snapshot_id) == known.snapshot:
            return True
        if known.snapshot is None:
            return False
        seen = False
        for snap in table.metadata.snapshots:
            if snap.snapshot_id == known.snapshot:
                seen = True
                continue
            if seen and (snap.summary or {}).get("tierlog.broker") == self.broker:
                return False
        return seen

    def _segment_file(self, table, seg: Segment):
        from connectors.tables.commit import described

        footer = pq.read_metadata(self.backend.open_input(seg.name, seg.size))
        return described(table.metadata, self._segment_spec(table), self._uri(seg.name), footer, seg.size)

    # ------------------------------------------------------------ typed columns

    def _typed(self, topic: str, table, register: list[Segment], rows: pa.Table | None, removing: list[str],
               cover: dict[int, int]):
        """The typed columns of the segments to register and of the fresh rows, all as one schema,
        the table's grown by what they hold (committed to the table before the files that need it).
        A segment whose every row is in the fresh files this commit removes takes its typed rows
        from them: each body is parsed once, for its fresh file.  Also: how many bodies the format
        could not read, of the rows new to the table (a fresh file's, or a segment's past ``cover``)."""
        fmt = self.formats.of(topic)
        known = typed_schema(table)
        schema, widened, read = known, set(), []
        held = self._held_rows(removing, known) if register and removing else None
        for seg in register:
            from_fresh = _rows_of(held, seg) if held is not None else None
            if from_fresh is not None:
                names = [n for n in from_fresh.column_names if n not in MESSAGE_SCHEMA.names]
                read.append((seg, from_fresh.select(MESSAGE_SCHEMA.names),
                             Typed(from_fresh.select(names), known)))
                continue
            seg_rows = layout.from_parquet(self.backend.read_whole(seg.name))
            typed = fmt.typed(seg_rows["body"], schema)
            read.append((seg, seg_rows, typed))
            schema, widened = typed.schema, widened | typed.widened
        fresh_typed = None
        if rows is not None:
            fresh_typed = fmt.typed(rows["body"], schema)
            schema, widened = fresh_typed.schema, widened | fresh_typed.widened
        unreadable = fresh_typed.unreadable if fresh_typed else 0
        for seg, seg_rows, t in read:
            if t.unreadable and seg.end >= cover.get(seg.queue_id, 0):  # a backlog: rare, and small in Python
                first = cover.get(seg.queue_id, 0)
                unreadable += sum(1 for offset, errors in zip(seg_rows["queue_offset"].to_pylist(),
                                                              t.columns[ERRORS].to_pylist())
                                  if errors == [WHOLE] and offset >= first)
        if unreadable:
            self.unreadable[topic] = self.unreadable.get(topic, 0) + unreadable
            log.info("table %s: %d bodies are not JSON objects; kept whole, their typed columns null and "
                     "_body_errors [\"$\"]", self._name(topic), unreadable)
        if schema != known:
            self._evolve(topic, schema, widened)
        segments = [(seg, seg_rows, as_schema(t.columns, schema)) for seg, seg_rows, t in read]
        return segments, (as_schema(fresh_typed.columns, schema) if fresh_typed is not None else None), unreadable

    def _held_rows(self, names: list[str], known: pa.Schema) -> pa.Table | None:
        """The rows of these fresh files, their typed columns as ``known`` (the table's: each file's
        are a part of it, written before it grew)."""
        pieces = []
        for name in names:
            rows = pq.read_table(self.backend.read_whole(name))
            typed = rows.select([n for n in rows.column_names if n not in MESSAGE_SCHEMA.names])
            if ERRORS not in typed.column_names:
                return None  # written before the topic was typed: parse the segments instead
            typed = as_schema(typed, known)
            pieces.append(pa.Table.from_arrays([*rows.select(MESSAGE_SCHEMA.names).cast(MESSAGE_SCHEMA).columns,
                                                *typed.columns],
                                               names=[*MESSAGE_SCHEMA.names, *typed.column_names]))
        return pa.concat_tables(pieces) if pieces else None

    def _evolve(self, topic: str, schema: pa.Schema, widened: set[str]) -> None:
        """Grow the table's schema to hold ``schema``'s typed columns: a commit of the schema alone, so
        a crash after it leaves columns no file holds yet, which read as null."""
        from pyiceberg.exceptions import CommitFailedException

        full = pa.schema([*MESSAGE_SCHEMA, *schema, pa.field(ERRORS, ERRORS_TYPE)])
        for attempt in range(COMMIT_ATTEMPTS_SCHEMA):
            table = self._table(topic)
            widen = widening(table.schema(), widened)
            try:
                if widen:
                    self._widen(topic, table, full, widen)  # commits with the files it rewrites; raises _Rewritten
                with table.transaction() as tx:
                    grow(tx, full, [])
                break
            except CommitFailedException:  # another broker's change came first: measure against it
                if attempt == COMMIT_ATTEMPTS_SCHEMA - 1:
                    raise
                self._tables.pop(topic, None)
        log.info("table %s: schema now %s", self._name(topic), ", ".join(f"{f.name} {f.type}" for f in schema))
        crash_point("table_schema_changed")

    def _widen(self, topic: str, table, full: pa.Schema, widen: list[str]) -> None:
        """Widen the long columns at ``widen`` to double, and in the same commit rewrite each of this
        broker's files that holds one of them as a long: Iceberg's rules read a file's long as a
        long only.  Then the plan of this round is stale: raises ``_Rewritten``."""
        from connectors.tables.commit import described, replace, spec_files

        snapshot = table.current_snapshot()
        mine = (self._fresh_prefix(topic), TYPED_PREFIX + self._segment_prefix(topic))
        listed = [(spec, f) for spec in (self._fresh_spec(table), self._segment_spec(table))
                  for f in (spec_files(table, snapshot, spec) if snapshot is not None else ())
                  if (self._name_of(f.file_path) or "").startswith(mine)]
        add, remove = [], []
        with table.transaction() as tx:
            grow(tx, full, widen)
            schema_id = tx.table_metadata.current_schema_id
            target = typed_schema(tx.table_metadata)
            for spec, f in listed:
                name = self._name_of(f.file_path)
                rows = pq.read_table(pa.BufferReader(self.backend.read(name)))
                if not any(is_long(rows.schema, path) for path in widen):
                    continue
                meta = rows.schema.metadata or {}
                typed = as_schema(rows.select([n for n in rows.column_names if n not in MESSAGE_SCHEMA.names]), target)
                data = typed_parquet(rows.select(MESSAGE_SCHEMA.names), typed,
                                {QUEUES_KEY: meta[QUEUES_KEY]} if QUEUES_KEY in meta else None)
                new = versioned(name, schema_id)
                self.backend.put(new, data)
                footer = pq.read_metadata(pa.BufferReader(data))
                add.append(described(tx.table_metadata, spec, self._uri(new), footer, len(data)))
                remove.append(f)
            replace(tx, add, remove, {"tierlog.broker": self.broker, "tierlog.commit": uuid.uuid4().hex})
            crash_point("table_widening")
        seq = table.current_snapshot().sequence_number
        log.info("table %s: %s widened from long to double; %d files of this broker rewritten", self._name(topic),
                 ", ".join(widen), len(add))
        raise _Rewritten(topic, {self._name_of(f.file_path): seq for f in remove})

    def _typed_copy(self, table, seg: Segment, rows: pa.Table, typed: pa.Table):
        from connectors.tables.commit import described

        name = copy_name(seg.name, table.metadata.current_schema_id)
        data = typed_parquet(rows, typed)
        self.backend.put(name, data)
        crash_point("table_typed_copy_written")
        footer = pq.read_metadata(pa.BufferReader(data))
        return described(table.metadata, self._segment_spec(table), self._uri(name), footer, len(data))

    def _fresh_file(self, seq: int, topic: str, rows: pa.Table,
                    typed: pa.Table | None = None) -> tuple[str, bytes, dict[int, tuple[int, int]]]:
        queues = {}
        ids, offsets = rows["queue_id"].to_pylist(), rows["queue_offset"].to_pylist()
        for q, o in zip(ids, offsets):
            lo, hi = queues.get(q, (o, o))
            queues[q] = (min(lo, o), max(hi, o))
        meta = {QUEUES_KEY: json.dumps([[q, lo, hi] for q, (lo, hi) in sorted(queues.items())]).encode()}
        name = f"{FRESH_PREFIX}{self.names.level}topic={escape_topic(topic)}/{seq:020d}-{uuid.uuid4().hex[:8]}.parquet"
        return name, typed_parquet(rows, typed, meta), queues

    def _expire_snapshots(self, topic: str) -> None:
        """Keep the newest ``snapshots_kept`` snapshots, expiring in steps, not at every commit; then
        delete the fresh files this process removed that no kept snapshot lists."""
        table, keep = self._tables[topic], self.settings.snapshots_kept
        snapshots = sorted(table.metadata.snapshots, key=lambda s: s.timestamp_ms)
        if len(snapshots) >= keep + max(10, keep // 5):
            current = table.current_snapshot().snapshot_id
            self._expire(topic, [s for s in snapshots[:-keep] if s.snapshot_id != current])
        retired = self._topics[topic].retired
        if retired:
            oldest = min(s.sequence_number for s in self._tables[topic].metadata.snapshots)
            for name in [n for n, seq in retired.items() if seq <= oldest]:
                self.backend.delete(name)
                del retired[name]

    # ------------------------------------------------------------ reconciliation

    def _start(self, view: TierView) -> None:
        """What a new process must look at: each tier topic's table (its state taken back, or
        reconciled), and every other table of the namespace (it may list this broker's expired
        segments)."""
        mine = {self._name(t): t for t in view.topics()}
        others = sorted(self._table_names() - mine.keys())
        self._todo = [(n, mine[n]) for n in sorted(mine)] + [(n, None) for n in others]
        self._topics = {}

    def _reconcile(self, view: TierView) -> None:
        deadline = time.monotonic() + RECONCILE_BUDGET_S
        worked = False
        while self._todo:
            if worked and time.monotonic() > deadline:
                return
            worked = True
            name, topic = self._todo[0]
            if topic is None:
                topic = self._topic_of(name)
                if topic is None or topic in view.topics():
                    self._todo.pop(0)  # another kind's table, or a tier topic, reached by its name
                    continue
            if not self._take_back(topic):
                self._reconcile_topic(topic, view)
            self._todo.pop(0)

    def _reconcile_topic(self, topic: str, view: TierView) -> None:
        """The topic's state from its table and the tier: the segments it lists and those it lacks,
        its fresh files and their queues (from their footers); fresh files of this broker that no
        kept snapshot lists are deleted (a crash left them, or their snapshots expired)."""
        from connectors.tables.commit import spec_files

        table = self._table(topic)
        snapshot = table.current_snapshot()
        seg_prefix, fresh_prefix = self._segment_prefix(topic), self._fresh_prefix(topic)
        listed_segments, listed_fresh = set(), {}
        if snapshot is not None:
            for spec_id in sorted({s.spec_id for s in table.specs().values()}):
                for f in spec_files(table, snapshot, spec_id):
                    name = self._name_of(f.file_path)
                    if name is None:
                        continue
                    name = source_of(name)  # a segment's typed copy is in its place
                    if name.startswith(seg_prefix):
                        listed_segments.add(name)
                    elif name.startswith(fresh_prefix):
                        listed_fresh[name] = f
        state = fresh.TopicState()
        for q in sorted(view.queues_of(topic)):
            tier_segments = list(view.segments_of(topic, q))
            in_tier = {s.name for s in tier_segments}
            # The listed run, oldest first; a listed segment after one the table lacks is taken out
            # and registered again in order (a table of an older tierlog could list any).
            for seg in tier_segments:
                listed = seg.name in listed_segments
                if listed and not state.pending.get(q):
                    state.registered[q] = state.cover[q] = seg.end + 1
                elif listed:
                    state.unregister.append(seg)
                    state.pending[q].append(seg)
                else:
                    state.pending.setdefault(q, []).append(seg)
            for name in sorted(listed_segments):  # listed, but retention expired it
                if name.startswith(f"{seg_prefix}queue={q}/") and name not in in_tier:
                    base = int(name.rsplit("/", 1)[1].split(".")[0])
                    state.unregister.append(Segment(name, topic, q, base, base, 0, 0, 0, 0))
        for name in sorted(listed_fresh):
            footer = pq.read_metadata(self.backend.open_input(name))
            queues_held = {q: (lo, hi) for q, lo, hi in json.loads(footer.metadata[QUEUES_KEY])}
            state.files[name] = fresh.FreshFile(name, queues_held)
            for q, (_lo, hi) in queues_held.items():
                state.cover[q] = max(state.cover.get(q, 0), hi + 1)
        self._topics[topic] = _Topic(state, None if snapshot is None else snapshot.snapshot_id, view.seq)
        self._delete_unlisted_fresh(topic, table)
        self._keep(topic)

    def _take_back(self, topic: str) -> bool:
        """The topic's state as the metadata store kept it, if its table is still at the snapshot
        the state was true of (no manifest read)."""
        record = self.states.table_state(topic) if self.states is not None else None
        if record is None:
            return False
        current = self._table(topic).current_snapshot()
        if (None if current is None else current.snapshot_id) != record["snapshot"]:
            return False
        self._topics[topic] = _Topic(fresh.TopicState.from_json(record["state"]), record["snapshot"], record["seen"])
        return True

    def _keep(self, topic: str) -> None:
        if self.states is not None:
            self.states.record_table_state(topic, self._topics[topic].record())

    def _delete_unlisted_fresh(self, topic: str, table) -> None:
        """Delete the table's own files of this broker (fresh files, typed copies) no kept snapshot lists."""
        from connectors.tables.commit import spec_files

        kept = set()
        specs = [self._fresh_spec(table)] + ([self._segment_spec(table)] if self.formats.typed(topic) else [])
        for snap in table.metadata.snapshots:
            for spec in specs:
                kept |= {self._name_of(f.file_path) for f in spec_files(table, snap, spec)}
        prefixes = [self._fresh_prefix(topic)] + ([TYPED_PREFIX + self._segment_prefix(topic)] if len(specs) > 1 else [])
        for prefix in prefixes:
            for info in list(self.backend.list(prefix)):
                if info.name not in kept:
                    self.backend.delete(info.name)

    def _topic_of(self, name: str) -> str | None:
        table = self.catalog.load_table((self.settings.namespace, name))
        if table.properties.get(KIND) != self.kind or TOPIC not in table.properties:
            return None
        self._tables.setdefault(table.properties[TOPIC], table)
        return table.properties[TOPIC]

    def _name_of(self, uri: str) -> str | None:
        root = data_location(self.tier_location, "")
        return uri[len(root):] if uri.startswith(root) else None

    def _segment_prefix(self, topic: str) -> str:
        return f"topic={escape_topic(topic)}/{self.names.level}"

    def _fresh_prefix(self, topic: str) -> str:
        return f"{FRESH_PREFIX}{self.names.level}topic={escape_topic(topic)}/"

    # ------------------------------------------------------------ stops and rebuilds

    def _table_names(self) -> set[str]:
        return {ident[-1] for ident in self.catalog.list_tables(self.settings.namespace)}

    def rebuild(self, view: TierView) -> int:
        """Make every table hold exactly the tier's committed rows (``tierlog table rebuild``):
        reconciled from the table and the tier alone, then committed until nothing is left to do.
        Returns the tables committed."""
        self._last = view
        self._start(view)
        while self._todo:
            name, topic = self._todo.pop(0)
            if topic is None:
                topic = self._topic_of(name)
                if topic is None or topic in view.topics():
                    continue
            self._reconcile_topic(topic, view)
        committed = set()
        for _ in range(1000):
            due = self._due(view, hold=False)
            if not due:
                break
            self._commit_round(view, due)
            committed |= {t for t, _ in due}
        return len(committed)

    def info(self, view: TierView | None = None) -> list[dict]:
        """One row per message table: what ``tierlog table info`` prints.  With ``view`` (the tier's
        committed state), ``lag_messages`` and ``lag_s``: the committed messages the table does not
        hold yet, and how long the oldest of them has waited."""
        rows = []
        now_ms = int(time.time() * 1000)
        parts = staging_parts(view) if view is not None else {}  # once, not once a table
        for topic, table in sorted(self._listed().items()):
            snapshot = table.current_snapshot()
            seq = table.properties.get(SEQ + self.broker)
            row = {"table": ".".join(self._identifier(topic)), "kind": self.kind, "topic": topic,
                   "metadata_location": table.metadata_location,
                   "snapshot_id": snapshot.snapshot_id if snapshot else None,
                   "tier_seq": int(seq) if seq is not None else None,
                   "tier_head_seq": None if view is None else view.seq}
            if view is not None:
                cover = dict(map(tuple, json.loads(table.properties.get(COVER + self.broker, "[]"))))
                behind = {q: (max(cover.get(q, 0), now.low), now.commit) for q, now in view.queues_of(topic).items()
                          if now.commit > max(cover.get(q, 0), now.low)}
                oldest = oldest_ms(topic, behind, parts)
                row.update(lag_messages=sum(b - a for a, b in behind.values()),
                           lag_s=round(max(0, now_ms - oldest) / 1000, 1) if oldest is not None else 0.0)
            if self.formats.typed(topic) or any(k.startswith(UNREADABLE) for k in table.properties):
                row["unreadable_bodies"] = sum(int(v) for k, v in table.properties.items() if k.startswith(UNREADABLE))
            rows.append(row)
        return rows

    # ------------------------------------------------------------ tables

    def _name_template(self) -> str:
        return self.settings.name

    def _schema_and_spec(self):
        return _schema_and_spec()

    def _segment_spec(self, table) -> int:
        return spec_with(table, ("broker", "queue_id"))

    def _fresh_spec(self, table) -> int:
        return spec_with(table, ("broker",))

    def _prepare(self, table):
        """A table without the fresh files' spec (made before there were fresh files, or just made)
        gains it, as its default: the segments keep theirs."""
        if find_spec(table, ("broker",)) is None:
            with table.update_spec() as update:
                update.remove_field("queue_id")
            table = self.catalog.load_table(self._identifier(table.properties[TOPIC]))
        return table


COMMIT_ATTEMPTS_SCHEMA = 5


def _rows_of(held: pa.Table, seg: Segment) -> pa.Table | None:
    """The segment's rows in ``held``, in offset order, when every one of them is there; else None."""
    import pyarrow.compute as pc

    mask = pc.and_(pc.equal(held["queue_id"], seg.queue_id),
                   pc.and_(pc.greater_equal(held["queue_offset"], seg.base), pc.less_equal(held["queue_offset"], seg.end)))
    rows = held.filter(mask)
    if rows.num_rows != seg.rows:
        return None
    return rows.sort_by("queue_offset")


def _tail_covers(records: list[dict], after: int, seq: int) -> bool:
    """Whether ``records`` hold every record in ``(after, seq]``: nothing was folded away unseen."""
    if seq <= after:
        return True
    return bool(records) and records[0]["seq"] <= after + 1 and records[-1]["seq"] >= seq



def _schema_and_spec():
    """The message row as an Iceberg schema, and the segments' spec, by broker and queue: each
    segment is one queue of one broker, so each partition value is in its statistics.  The fresh
    files' spec (broker alone: a fresh file holds several queues) is added beside it (``_prepare``)."""
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
