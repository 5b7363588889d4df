"""The tier's sealed segments as Iceberg tables (``connectors.tables``), without Spark: the writer
of ``test_tier_writer`` keeps the tables in step through random commits, seals, expirations, folds,
restarts and crashes (at the tier's writes and inside a table commit); each table, read by
pyiceberg and by DuckDB's ``iceberg_scan`` from its metadata file alone, holds exactly the ledger's
messages of the queues' sealed and retained offsets, and never lists an object that is gone."""

from __future__ import annotations

import base64
import json
import os
import random
import threading

from dataclasses import replace
from pathlib import Path

import duckdb
import pytest

from connectors.brokers import DEFAULT_BROKER
from connectors.tier.location import open_backend
from state.metadata import MetadataStore
from connectors.tables import messages as tables_module
from connectors.tables.catalog import data_location, default_settings
from connectors.tables.messages import MessageTables
from connectors.tier.reader import TierReader
from connectors.tier.writer import TierWriter
from tests import test_tier_writer as tw
from tests.oracle import entered_a_queue, message_row

COLUMNS = ("topic", "queue_id", "queue_offset", "phy_offset", "key", "body", "broker")


CURRENT: dict = {}  # the faults of the run whose writer is open


class Killed(BaseException):
    """A crash as a kill is: no ``except Exception`` of the code under test sees it."""


class CheckedWriter(TierWriter):
    """After each maintenance: no table lists a file twice or an object the tier deleted, and every
    segment a table lists is one of the tier's."""

    def maintain(self, now_ms=None):
        seals = super().maintain(now_ms)
        assert_tables_in_step(self)
        return seals


def listed_files(tables, topic: str) -> list[str]:
    """The data files of the table's current snapshot as the catalog has it, as tier object names."""
    table = tables.catalog.load_table(tables._identifier(topic))
    snapshot, root = table.current_snapshot(), len(data_location(tables.tier_location, ""))
    if snapshot is None:
        return []
    return [e.data_file.file_path[root:] for m in snapshot.manifests(table.io)
            for e in m.fetch_manifest_entry(table.io, discard_deleted=True)]


def assert_tables_in_step(writer) -> None:
    tables = writer.tables
    listed: list[str] = []
    for topic in tables.topics():
        listed += listed_files(tables, topic)
    assert len(listed) == len(set(listed)), "a table lists a file twice"
    for name in listed:
        assert writer.backend.exists(name), f"a table lists {name}, which the tier deleted"
    if tables.synced_seq == writer.head.seq:  # this broker's files: another's may be in the table too
        mine = {n for n in listed if n.startswith("topic=") and n.split("/", 1)[1].startswith(tables.names.level)}
        assert mine <= {s.name for s in writer._segments()}, "a table lists a segment the tier does not hold"


class TablesRun(tw.Run):
    """``test_tier_writer``'s run with message tables; a restart opens them afresh, as a new process.
    ``tier``, ``state`` and ``broker`` let several runs share one tier and one catalog."""

    def __init__(self, root, *, tier=None, state=None, broker: str = DEFAULT_BROKER, **kw):
        self.shared = (tier, state, broker)
        super().__init__(root, **kw)

    def open(self) -> None:
        tier, state, broker = self.shared
        if tier is not None:
            self.location = str(tier)
            self.stage_settings = replace(self.stage_settings, location=self.location,
                                          reader=replace(self.stage_settings.reader, broker=broker))
            self.settings = replace(self.settings, location=self.location, broker=broker)
        self.store = MetadataStore(str(self.root / "metadata"))
        backend = tw.FaultyBackend(open_backend(self.location), self.faults)
        # Each maintenance commits what the tier committed: the tests' writers run no clock.
        tables = MessageTables(replace(default_settings(self.location, str(state or self.root / "state")),
                                       commit_interval_s=0.0, min_commit_bytes=0), self.location, self.settings.broker)
        self.writer = CheckedWriter(self.settings, tw.FaultyIndex(self.store, self.faults), backend, tables=tables)
        CURRENT["faults"] = self.faults


@pytest.fixture(autouse=True)
def whole_reconciliations(monkeypatch):
    """A process's first sync does a time budget's work per maintenance; these tests assert the
    tables in step after one, which a busy host would make flaky.  The tests of the budget set it
    to nothing (one table or one commit per call)."""
    monkeypatch.setattr(tables_module, "RECONCILE_BUDGET_S", 3600.0)


@pytest.fixture(autouse=True)
def table_faults(monkeypatch):
    """The table commit's crash points count as writes of the run, so a crash can land in one; a
    crash is a ``BaseException``, so the writer's guard around the tables cannot take it for a
    catalog that is away."""
    def point(name):
        if name.startswith("table_") and "faults" in CURRENT:
            CURRENT["faults"].write(name)
    monkeypatch.setattr(tables_module, "crash_point", point)
    monkeypatch.setattr(tw, "Crash", Killed)
    yield
    CURRENT.clear()


def drive(root, seed: int, crash_at: int | None = None, messages: int = 240):
    original, tw.Run = tw.Run, TablesRun  # tw.drive builds its run through this name
    try:
        return tw.drive(root, seed, crash_at=crash_at, messages=messages)
    finally:
        tw.Run = original


def expected_rows(run) -> dict[tuple[str, int], list[tuple]]:
    """The ledger's messages at each queue's committed and retained offsets (from the tier, itself
    checked against the ledger by ``assert_tier_equals_ledger``)."""
    states = TierReader(run.location).committed().queue_states()
    out: dict[tuple[str, int], list[tuple]] = {}
    for m in run.written:
        row = message_row(m)
        key = (row["topic"], row["queue_id"])
        if entered_a_queue(row) and states[key].low <= row["queue_offset"] < states[key].commit:
            out.setdefault(key, []).append(tuple(row[c] for c in COLUMNS))
    return out


def table_rows(rows: list[dict]) -> dict[tuple[str, int], list[tuple]]:
    out: dict[tuple[str, int], list[tuple]] = {}
    for r in sorted(rows, key=lambda r: (r["topic"], r["queue_id"], r["queue_offset"])):
        out.setdefault((r["topic"], r["queue_id"]), []).append(tuple(r[c] for c in COLUMNS))
    return out


def duckdb_rows(metadata_location: str, s3: bool = False, columns=COLUMNS) -> list[dict]:
    if s3:
        from tests.test_tier_reader import duckdb_connection

        con = duckdb_connection()  # httpfs and an S3 secret for the test's endpoint
    else:
        from tests.test_tier_reader import duckdb_extensions

        con = duckdb.connect(config={"extension_directory": duckdb_extensions(), "autoinstall_known_extensions": False})
    con.execute("LOAD iceberg")
    cur = con.execute(f"SELECT {', '.join(columns)} FROM iceberg_scan('{metadata_location}')")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def assert_tables_equal_ledger(run) -> int:
    """Every topic's table, through pyiceberg and DuckDB, holds the ledger's sealed rows; returns rows."""
    tables = run.writer.tables
    want = expected_rows(run)
    got: dict = {}
    for topic in tables.topics():
        table = tables.catalog.load_table(tables._identifier(topic))
        pyice = table.scan(selected_fields=COLUMNS).to_arrow().to_pylist()
        assert table_rows(duckdb_rows(table.metadata_location)) == table_rows(pyice), topic
        got.update(table_rows(pyice))
        for task in table.scan().plan_files():  # nothing listed that the tier deleted
            assert os.path.exists(task.file.file_path.removeprefix("file://")), task.file.file_path
    assert got == {k: v for k, v in want.items() if v}
    return sum(len(v) for v in got.values())


@pytest.mark.parametrize("seed", range(3))
def test_tables_follow_random_commits_seals_expirations_folds_and_restarts(tmp_path, seed):
    run, did = drive(tmp_path, seed)
    try:
        tw.assert_tier_equals_ledger(run)
        rows = assert_tables_equal_ledger(run)
        assert rows > 0 and did["restart"] and did["fold"], (rows, did)
        removed = sum(1 for t in run.writer.tables.topics()
                      for s in run.writer.tables.table(t).snapshots()
                      if s.summary and s.summary.operation.value == "overwrite")
        assert removed, "retention expired no segment from a table"
    finally:
        run.close()


def test_a_crash_at_any_write_including_inside_a_table_commit_leaves_table_equal_tier(tmp_path):
    clean, _ = drive(tmp_path / "clean", 5, messages=120)
    writes = clean.faults.count
    clean.close()
    fired = set()
    for at in range(1, writes + 1, 3):
        run, did = drive(tmp_path / f"crash{at}", 5, crash_at=at, messages=120)
        try:
            fired.add(run.faults.fired)
            run.writer.maintain()  # the process after the crash brings the tables in step
            assert_tables_equal_ledger(run)
        finally:
            run.close()
    assert {"table_fresh_written", "table_committing", "table_committed"} <= fired, fired


def test_a_tier_sealed_without_tables_is_registered_by_the_first_sync(tmp_path):
    run = tw.Run(tmp_path, messages=120, seed=3, faults=tw.Faults())
    rng = random.Random(3)
    for batch_id, first in enumerate(range(0, 120, 30)):
        run.writer.commit(batch_id, run.parts(first, first + 30, 2, rng), run.gaps.between)
        run.writer.maintain()
    run.writer.fold()
    run.close()
    again = TablesRun(tmp_path, messages=0, seed=3, faults=tw.Faults())
    again.written = run.written
    try:
        assert again.writer.tables.topics() == []
        again.writer.maintain()
        assert assert_tables_equal_ledger(again) > 0
    finally:
        again.close()


def commit_batches(run, rng: random.Random, first: int, last: int, size: int, batch_id: int = 0) -> None:
    """Messages ``first .. last - 1`` of the run's log as batches of ``size`` (2 parts each), each
    committed and followed by a maintenance, batch ids from ``batch_id``."""
    for i, start in enumerate(range(first, last, size)):
        run.writer.commit(batch_id + i, run.parts(start, start + size, 2, rng), run.gaps.between)
        run.writer.maintain()


def test_the_first_sync_of_a_large_tier_goes_in_parts_registering_each_file_once(tmp_path, monkeypatch):
    """With a budget of one table per maintenance and three segments per commit, a tier sealed without
    tables is registered over many maintenance calls, each reconciling at most one table and
    committing bounded parts; the writer's deletes wait until the tables are in step; a restart in
    the middle of a topic's backlog reconciles that table again from the table itself, so no file is
    added twice (CheckedWriter)."""
    monkeypatch.setattr(tables_module, "RECONCILE_BUDGET_S", 0.0)
    monkeypatch.setattr(tables_module, "FILES_PER_COMMIT", 3)
    run = tw.Run(tmp_path, messages=240, seed=5, faults=tw.Faults())
    commit_batches(run, random.Random(5), 0, 240, 30)
    run.close()
    commits: list[int] = []
    reconciled: list[str] = []
    real, real_reconcile = MessageTables._commit_once, MessageTables._reconcile_topic

    def counted(self, topic, change):
        commits.append(sum(1 for f in change[0] if "/queue=" in f.file_path))
        return real(self, topic, change)

    def reconcile(self, topic, view):
        reconciled.append(topic)
        return real_reconcile(self, topic, view)
    monkeypatch.setattr(MessageTables, "_commit_once", counted)
    monkeypatch.setattr(MessageTables, "_reconcile_topic", reconcile)
    again = TablesRun(tmp_path, messages=0, seed=5, faults=tw.Faults())
    again.written = run.written
    try:
        calls = 0
        while again.writer.tables.synced_seq != again.writer.head.seq:
            before = len(reconciled)
            again.writer.maintain()
            calls += 1
            assert len(reconciled) - before <= 1 and max(commits, default=0) <= 3, (reconciled, commits)
            if calls == 2:  # a new process in the middle of the first table's backlog
                again.restart()
                again.written = run.written
            assert calls < 200, "the tables never came in step"
        assert calls > 3 and len(commits) > 3, (calls, commits)
        assert assert_tables_equal_ledger(again) > 0
    finally:
        again.close()


def test_a_clean_stop_in_step_spares_the_next_process_the_reconciliation(tmp_path, monkeypatch):
    """Each table's state is kept in the metadata store with the snapshot it was true of: after a
    clean stop (and the fold that empties the log's tail) the next process takes it back at once and
    reconciles no table.  A table someone else changed meanwhile (here: its state's snapshot no
    longer current) is reconciled, and CheckedWriter fails on a file listed twice."""
    run = TablesRun(tmp_path, messages=240, seed=10, faults=tw.Faults())
    run.settings = replace(run.settings, fold_every=1000)  # the log's tail holds whatever the process saw
    run.restart()
    rng = random.Random(10)
    listed: list[str] = []
    real = MessageTables._reconcile_topic

    def own_files(self, topic, view):
        listed.append(topic)
        return real(self, topic, view)

    def batch(batch_id):
        run.writer.commit(batch_id, run.parts(batch_id * 30, batch_id * 30 + 30, 2, rng), run.gaps.between)
        run.writer.maintain()
    try:
        for batch_id in range(3):
            batch(batch_id)
        run.writer.settle_tables()  # a clean stop, as the tiering query's flush makes it
        run.writer.fold()
        run.restart()
        monkeypatch.setattr(MessageTables, "_reconcile_topic", own_files)
        batch(3)
        assert run.writer.tables.synced_seq == run.writer.head.seq and listed == [], listed
        for batch_id in (4, 5):
            batch(batch_id)
        topic = run.writer.tables.topics()[0]
        kept = run.store.table_state(topic)
        run.store.record_table_state(topic, {**kept, "snapshot": -1})  # as if the table moved on since
        run.restart()  # a crash: no clean stop
        tables = run.writer.tables
        tables.settings = replace(tables.settings, commit_interval_s=3600.0)  # a round that commits nothing
        tables.sync(run.writer.table_view())
        assert listed == [topic], "a kept state was taken back though its table moved on"
        tables.settings = replace(tables.settings, commit_interval_s=0.0)
        for batch_id in (6, 7):
            batch(batch_id)
        for _ in range(20):
            if run.writer.tables.synced_seq == run.writer.head.seq:
                break
            run.writer.maintain()
        assert listed == [topic], listed
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def listed_segments(tables) -> set[str]:
    return {n for t in tables.topics() for n in listed_files(tables, t) if n.startswith("topic=")}


def test_tables_turned_off_and_on_again_catch_up_with_what_was_sealed_and_expired(tmp_path):
    """Tables on, then a process with them off (nothing touches the catalog) seals, expires and
    deletes segments the tables still list, and folds; turned on again, the tables take what was
    sealed and let go of what expired, and list no deleted object."""
    on = TablesRun(tmp_path, messages=240, seed=9, faults=tw.Faults())
    rng = random.Random(9)
    commit_batches(on, rng, 0, 80, 20)
    on.settings = replace(on.settings, segment_age_s=0)
    on.restart()
    on.maintain()  # every queue seals by age, the tables' fresh files go, and they list segments
    listed_before = listed_segments(on.writer.tables)
    on.close()
    off = tw.Run(tmp_path, messages=0, seed=9, faults=tw.Faults())
    commit_batches(off, rng, 80, 240, 20, batch_id=4)
    off.writer.fold()
    gone = {n for n in listed_before if not off.writer.backend.exists(n)}
    off.close()
    again = TablesRun(tmp_path, messages=0, seed=9, faults=tw.Faults())
    again.written = off.written
    try:
        assert listed_before and gone, "the tables held nothing that retention deleted while they were off"
        for _ in range(50):
            TierWriter.maintain(again.writer)  # unchecked: the tables list deleted objects until they catch up
            if again.writer.tables.synced_seq == again.writer.head.seq:
                break
        assert_tables_in_step(again.writer)
        assert assert_tables_equal_ledger(again) > 0
    finally:
        again.close()


def test_a_restart_with_tables_in_step_reads_no_manifest(tmp_path, monkeypatch):
    """A new process (no clean stop) whose tables are at the snapshots their kept states name takes
    the states back and the records since from the tail: it reads no table's manifests (the
    O(retained segments) part)."""
    from connectors.tables import commit as commit_module

    run = TablesRun(tmp_path, messages=120, seed=6, faults=tw.Faults())
    rng = random.Random(6)
    try:
        commit_batches(run, rng, 0, 90, 30)
        run.restart()
        listed: list[str] = []
        real = commit_module.spec_files

        def spec_files(table, snapshot, spec_id):
            listed.append((table.name(), spec_id))
            return real(table, snapshot, spec_id)
        monkeypatch.setattr(commit_module, "spec_files", spec_files)
        run.writer.commit(3, run.parts(90, 120, 2, rng), run.gaps.between)
        run.writer.maintain()
        assert run.writer.tables.synced_seq == run.writer.head.seq
        segment_reads = [r for r in listed if r[1] == 0]
        assert segment_reads == [], segment_reads
        monkeypatch.setattr(commit_module, "spec_files", real)
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def assert_no_queue_has_a_hole(run, held: dict | None = None) -> None:
    """Every table holds rows of each queue the tier holds, from its low offset on without a hole: a commit that
    takes out a fresh file before the segments holding its rows are in leaves one."""
    states = TierReader(run.location).committed().queue_states()
    tables = run.writer.tables
    for topic in tables.topics():
        table = tables.catalog.load_table(tables._identifier(topic))
        rows = table.scan(selected_fields=("queue_id", "queue_offset")).to_arrow().to_pylist()
        by_queue: dict[int, list[int]] = {q: [] for (t, q), s in states.items() if t == topic and s.commit > s.low}
        for r in rows:
            by_queue.setdefault(r["queue_id"], []).append(r["queue_offset"])
        backlog = tables._topics[topic].state.pending  # a queue whose backlog goes in parts waits with its rows
        for q, offsets in by_queue.items():
            low = states[(topic, q)].low
            assert offsets or backlog.get(q), f"no row of {topic}/{q} in its table"
            assert sorted(offsets) == list(range(low, low + len(offsets))), f"a hole in {topic}/{q}"
            if held is not None:  # what a table held once it holds on, retention aside
                before = held.get((topic, q), -1)
                assert max(offsets, default=-1) >= before or before < low, f"rows of {topic}/{q} left the table"
                held[(topic, q)] = max(before, max(offsets, default=-1))


def test_a_seal_of_more_segments_than_a_commit_takes_registers_each_once(tmp_path, monkeypatch):
    """A process seals several queues of each topic at once, more than one commit takes: the
    segments go in parts over several commits, the fresh files they free only once all are in (no
    queue has a hole after any commit), and no file twice (CheckedWriter); the tables end equal to
    the ledger."""
    run = TablesRun(tmp_path, messages=240, seed=8, faults=tw.Faults())
    run.settings = replace(run.settings, fold_every=1000)  # the tail keeps every record
    run.restart()
    rng = random.Random(8)
    try:
        commit_batches(run, rng, 0, 120, 30)
        monkeypatch.setattr(tables_module, "FILES_PER_COMMIT", 1)
        for batch_id, first in enumerate(range(120, 240, 30), start=4):  # sealed by one maintain below
            run.writer.commit(batch_id, run.parts(first, first + 30, 2, rng), run.gaps.between)
        segments_per_commit = []
        real = MessageTables._commit_once

        def counted(self, topic, change):
            segments_per_commit.append(sum(1 for f in change[0] if "/queue=" in f.file_path))
            return real(self, topic, change)
        monkeypatch.setattr(MessageTables, "_commit_once", counted)
        held: dict = {}
        assert_no_queue_has_a_hole(run, held)
        for _ in range(100):
            run.writer.maintain()
            assert_no_queue_has_a_hole(run, held)
            if run.writer.tables.synced_seq == run.writer.head.seq and not any(
                    k.state.pending for k in run.writer.tables._topics.values()):
                break
        assert max(segments_per_commit) == 1 and segments_per_commit.count(1) > 2, segments_per_commit
        monkeypatch.setattr(MessageTables, "_commit_once", real)
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def test_a_table_rebuilt_beside_a_running_writer_is_taken_afresh(tmp_path):
    """``tierlog table rebuild`` (another process of the same broker: a second ``MessageTables`` over
    the committed tier) commits to the tables between two rounds of a running writer: the writer
    notices its tables moved on and takes their state afresh, so it adds no row twice."""
    from connectors.tables.view import TierView

    run = TablesRun(tmp_path, messages=200, seed=13, faults=tw.Faults())
    rng = random.Random(13)
    try:
        commit_batches(run, rng, 0, 100, 20)
        run.writer.commit(5, run.parts(100, 140, 2, rng), run.gaps.between)  # rows the writer has not taken
        other = MessageTables(run.writer.tables.settings, run.location, run.settings.broker)
        assert other.rebuild(TierView.from_committed(TierReader(run.location).committed())) > 0
        commit_batches(run, rng, 140, 200, 20, batch_id=6)
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def test_two_brokers_commit_into_one_table_at_once(tmp_path):
    """Two writers of one tier and one catalog, brokers a and b, commit into the same tables from two
    threads; each table holds both brokers' committed rows."""
    runs = [TablesRun(tmp_path / b, tier=tmp_path / "tier", state=tmp_path / "state", broker=b, messages=200,
                      seed=7, faults=tw.Faults()) for b in ("broker-a", "broker-b")]
    done = {}

    def work(run):
        rng = random.Random(1)
        for batch_id, first in enumerate(range(0, len(run.written), 20)):
            run.writer.commit(batch_id, run.parts(first, first + 20, 1, rng), run.gaps.between)
            run.writer.maintain()
        done[run.settings.broker] = run.writer.tables.synced_seq
    threads = [threading.Thread(target=work, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert set(done) == {"broker-a", "broker-b"} and all(done.values()), done
        for run in runs:  # a new process diffs its tables against its tier, the other's files in them
            run.restart()
            run.writer.maintain()
        tables = runs[0].writer.tables
        assert tables.topics()
        for topic in tables.topics():
            table = tables.catalog.load_table(tables._identifier(topic))
            rows = table.scan(selected_fields=("broker", "queue_id", "queue_offset")).to_arrow().to_pylist()
            for run in runs:
                states = TierReader(run.location, broker=run.settings.broker).committed().queue_states()
                low_sealed = {k[1]: (s.low, s.commit) for k, s in states.items() if k[0] == topic}
                mine = sorted((r["queue_id"], r["queue_offset"]) for r in rows if r["broker"] == run.settings.broker)
                assert mine == sorted((q, o) for q, (lo, hi) in low_sealed.items() for o in range(lo, hi))
                assert mine, f"{run.settings.broker} committed nothing into {topic}"
    finally:
        for run in runs:
            run.close()


def test_a_catalog_that_is_away_holds_the_deletes_not_the_tier(tmp_path, monkeypatch):
    """While every table commit fails, batches commit and seal, retention expires segments, and
    their objects stay (the tables still list them); once the catalog is back the tables catch up
    and the held deletes happen."""
    away = {"on": False, "refused": 0, "held": 0}
    real = MessageTables._commit_once

    def commit_once(self, *args):
        if away["on"]:
            away["refused"] += 1
            raise ConnectionError("the catalog is unreachable")
        return real(self, *args)
    monkeypatch.setattr(MessageTables, "_commit_once", commit_once)
    run = TablesRun(tmp_path, messages=240, seed=2, faults=tw.Faults())
    run.settings = replace(run.settings, segment_age_s=0)  # every maintenance seals every queue: segments listed
    run.restart()
    rng = random.Random(2)
    try:
        for batch_id, first in enumerate(range(0, 240, 20)):
            away["on"] = 5 <= batch_id < 11
            run.writer.commit(batch_id, run.parts(first, first + 20, 2, rng), run.gaps.between)
            run.writer.maintain()  # CheckedWriter: nothing a table lists was deleted
            if away["on"]:  # expired, still listed by a table, so not deleted
                listed = listed_segments(run.writer.tables)
                away["held"] = max(away["held"], len(listed & set(run.store.pending_deletes())))
                info = run.writer.tables.info(run.writer.table_view())
                away["lag"] = max(away.get("lag", 0), sum(i["lag_messages"] for i in info))
        assert away["refused"] and away["held"] and away["lag"], away
        run.writer.maintain()
        assert [i["lag_messages"] for i in run.writer.tables.info(run.writer.table_view())] == \
            [0] * len(run.writer.tables.topics())
        assert run.writer.tables.synced_seq == run.writer.head.seq
        assert not [n for n in run.store.pending_deletes() if n.startswith("topic=")]
        tw.assert_tier_equals_ledger(run)
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def test_tierlog_run_keeps_tables_that_every_reader_sees_as_the_ledger(spark, tmp_path, tier_location):
    """``tierlog run`` with ``[tables] enabled``: ``tierlog table info`` names each table's metadata
    file; DuckDB's ``iceberg_scan`` on it (no catalog) and pyiceberg's scan return the ledger's
    messages at every queue's committed offsets, each once, on posix and on S3; ``table rebuild``
    changes nothing."""
    import json

    from streaming import config as cfg
    from streaming.service import Service
    from tests.cli_runner import tierlog
    from tests.oracle import written_rows
    from tests.tiering_helpers import make_conf, produce

    conf = make_conf(tmp_path, tier_location, segment_messages=150,
                     compaction=cfg.CompactionConfig(snapshot_interval_s=0.01))  # a snapshot per batch
    conf = replace(conf, tables=cfg.TablesConfig(enabled=True))
    produce(conf, 1500)
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    from tests.test_tables_latest import assert_latest_tables_equal_ledger

    assert assert_latest_tables_equal_ledger(conf) > 20
    want = committed_ledger_rows(conf)
    assert sum(map(len, want.values())) > 500, "too little was committed to tell"
    assert sealed_count(conf) > 500, "too little was sealed to tell"

    (tmp_path / "tierlog.toml").write_text(cfg.to_toml(conf, with_docs=False))
    infos = []
    for command in ("info", "rebuild"):
        r = tierlog("table", command, "--format", "json", "--config", str(tmp_path / "tierlog.toml"))
        assert r.returncode == 0, r.stderr[-2000:]
        infos.append([json.loads(line) for line in r.stdout.splitlines()])
    assert infos[0] == infos[1], "rebuild found something to change in tables equal to the tier"
    r = tierlog("status", "--format", "json", "--config", str(tmp_path / "tierlog.toml"))
    assert r.returncode == 0, r.stderr[-2000:]
    lag = {(t["table_kind"], t["topic"]): t for t in map(json.loads, r.stdout.splitlines()) if t["kind"] == "table"}
    assert {k for k, _ in lag} == {"messages", "latest"}
    assert all(t["lag_messages"] == 0 for (kind, _), t in lag.items() if kind == "messages"), lag
    assert {i["topic"] for i in infos[0] if i["kind"] == "messages"} == {k[0] for k in want}
    assert {i["kind"] for i in infos[0]} == {"messages", "latest"}
    got_duck, got_pyice = {}, {}
    for info in (i for i in infos[0] if i["kind"] == "messages"):
        assert info["kind"] == "messages" and info["snapshot_id"] and info["tier_seq"] <= info["tier_head_seq"]
        got_duck.update(table_rows(duckdb_rows(info["metadata_location"], s3=tier_location.startswith("s3://"))))
        from pyiceberg.table import StaticTable

        static = StaticTable.from_metadata(info["metadata_location"], properties=_s3_properties(tier_location))
        got_pyice.update(table_rows(static.scan(selected_fields=COLUMNS).to_arrow().to_pylist()))
    assert got_duck == want
    assert got_pyice == want
    if not tier_location.startswith("s3://"):
        assert_raw_readers_see_sealed_rows_once(conf)


def assert_raw_readers_see_sealed_rows_once(conf) -> None:
    """The README's raw Parquet readers (DuckDB's glob, pyarrow's hive dataset) see each sealed row
    once: never a fresh file's copy of it, which lies under ``_tables/``, where neither looks."""
    import duckdb
    import pyarrow.dataset as ds

    tier = conf.tier.location
    raw = duckdb.sql(f"select topic, queue_id, queue_offset from read_parquet('{tier}/topic=*/broker=*/queue=*/*.parquet', "
                     "hive_partitioning=false)").fetchall()
    assert len(raw) == len(set(raw)) == sealed_count(conf)
    assert ds.dataset(tier, format="parquet", partitioning="hive").count_rows() == sealed_count(conf)
    assert any((Path(tier) / "_tables" / "fresh").rglob("*.parquet")), "no fresh file to be seen or not"


def committed_ledger_rows(conf) -> dict:
    """(topic, queue) -> the ledger's rows below the queue's commit offset in the tier, in order."""
    from tests.oracle import written_rows

    states = TierReader(conf.tier.location).committed().queue_states()
    want: dict = {}
    for row in written_rows(conf.commitlog.dir):
        key = (row["topic"], row["queue_id"])
        if entered_a_queue(row) and key in states and row["queue_offset"] < states[key].commit:
            want.setdefault(key, []).append(tuple(row[c] for c in COLUMNS))
    return want


def sealed_count(conf) -> int:
    return sum(s.sealed - s.low for s in TierReader(conf.tier.location).committed().queue_states().values())


def assert_message_tables_equal_ledger(conf) -> int:
    """After ``tierlog run``: each message table, through the catalog, read by pyiceberg and DuckDB,
    holds exactly the ledger's committed rows, each once; returns the rows."""
    from streaming.settings import tables as table_settings

    tables = MessageTables(table_settings(conf), conf.tier.location, conf.broker.name)
    got: dict = {}
    for topic in tables.topics():
        table = tables.table(topic)
        pyice = table_rows(table.scan(selected_fields=COLUMNS).to_arrow().to_pylist())
        s3 = conf.tier.location.startswith("s3://")
        assert table_rows(duckdb_rows(table.metadata_location, s3=s3)) == pyice, topic
        got.update(pyice)
    want = committed_ledger_rows(conf)
    assert got == want
    return sum(map(len, want.values()))


def _s3_properties(location: str) -> dict:
    if not location.startswith("s3://"):
        return {}
    return {"s3.endpoint": os.environ["AWS_ENDPOINT_URL_S3"], "s3.access-key-id": os.environ["AWS_ACCESS_KEY_ID"],
            "s3.secret-access-key": os.environ["AWS_SECRET_ACCESS_KEY"], "s3.region": os.environ["AWS_REGION"]}


def test_readme_table_examples_run_against_a_real_tier(spark, tmp_path):
    from collections import Counter

    from streaming import config as cfg
    from streaming.service import Service
    from tests.oracle import written_rows
    from tests.test_tier_reader import readme_python_blocks
    from tests.tiering_helpers import make_conf, produce

    conf = replace(make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=150,
                             compaction=cfg.CompactionConfig(snapshot_interval_s=0.01)),
                   tables=cfg.TablesConfig(enabled=True))
    produce(conf, 1200)
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0
    sealed = TierReader(conf.tier.location).committed().queue_states()
    rows = [r for r in written_rows(conf.commitlog.dir)
            if r["topic"] == "topic-0" and entered_a_queue(r) and r["queue_offset"] < sealed[("topic-0", r["queue_id"])].commit]

    [block] = readme_python_blocks("SqlCatalog", "iceberg_scan", "rmq_topic_0")  # the typed columns' reads orders-0
    ns: dict = {}
    exec(block.replace("data/demo/state", conf.state.dir), ns)  # the docs read the demo's tables: this test's
    want = sorted((r["queue_offset"], r["body"]) for r in rows if r["queue_id"] == 1 and r["queue_offset"] >= 100)
    assert want and sorted(zip(ns["recent"]["queue_offset"].to_pylist(), ns["recent"]["body"].to_pylist())) == want
    assert ns["per_queue"] == sorted(Counter(r["queue_id"] for r in rows).items())

    from tests.test_tables_latest import ledger_latest

    [block] = readme_python_blocks("scan_iceberg", "_latest")
    table = ns["catalog"].load_table("tierlog.rmq_topic_0_latest")
    through = int(table.properties[f"tierlog.through-phy.{conf.broker.name}"])
    want = {k: v for (t, k), v in ledger_latest(conf.commitlog.dir, through).items() if t == "topic-0"}
    key = sorted(want)[0]
    exec(block.replace("data/demo/state", conf.state.dir).replace("key-00000042", key), ns)
    assert ns["value"]["body"].to_list() == [want[key][0]]
    older = table.snapshots()[-2]  # what the README's `previous` read: the table one snapshot before
    before = ledger_latest(conf.commitlog.dir, int(older.summary["tierlog.through-phy"]))
    assert sorted(zip(ns["previous"]["key"].to_pylist(), ns["previous"]["phy_offset"].to_pylist())) == \
        sorted((k, v[1]) for (t, k), v in before.items() if t == "topic-0")

    # A downstream Spark (4.1: the newest Iceberg publishes a runtime for) runs the README's block.
    [block] = readme_python_blocks("SparkSession", "tierlog.tierlog.rmq_topic_0")
    got = run_spark_reader(block.replace("data/demo/state", conf.state.dir)
                           .replace("data/demo/tier", conf.tier.location).replace("key-00000042", key), tmp_path)
    assert got["per_queue"] == [list(kv) for kv in sorted(Counter(r["queue_id"] for r in rows).items())]
    latest_now = ledger_latest(conf.commitlog.dir, through)
    assert got["value"] == [[base64.b64encode(latest_now[("topic-0", key)][0]).decode()]]


SPARK_READER = Path(__file__).parents[1] / ".cache" / "spark-reader" / "bin" / "python"


def spark_reader_output(script: str, tmp_path) -> dict:
    """Runs ``script`` in the downstream reader's Spark (``./dev`` sets it up); the JSON of its
    last line of output."""
    import subprocess

    assert SPARK_READER.exists(), f"{SPARK_READER} is missing: run `./dev setup`"
    (tmp_path / "spark_reader.py").write_text(script)
    result = subprocess.run([str(SPARK_READER), str(tmp_path / "spark_reader.py")], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_spark_reader(block: str, tmp_path) -> dict:
    """Runs a README Spark block in the downstream reader's Spark, with the jars ``./dev`` fetched
    in place of ``spark.jars.packages``; returns its results as JSON."""
    import re

    from tests.jvm import classpath

    jars = ",".join(classpath("spark-iceberg").split(":"))
    script = re.sub(r'\.config\("spark\.jars\.packages",.*?\)\n', f'.config("spark.jars", "{jars}")\n', block,
                    count=1, flags=re.S)
    assert jars in script
    script = ("import base64, json\n" + script.replace(".getOrCreate())", '.config("spark.ui.enabled", "false")'
                                                        '.master("local[1]").getOrCreate())')
              + "\nprint(json.dumps({'per_queue': [list(r) for r in per_queue],"
                " 'value': [[base64.b64encode(bytes(r[0])).decode()] for r in value]}))\n")
    return spark_reader_output(script, tmp_path)


def run_spark_sql(catalog_uri: str, warehouse: str, queries: dict[str, str], tmp_path) -> dict[str, list[dict]]:
    """Each of ``queries`` as the downstream reader's Spark answers it over tierlog's SQLite catalog
    (a ``jdbc`` catalog named ``tierlog``, as reading.md configures it): its rows as dicts, structs
    as dicts, timestamps as ISO strings, bytes as base64."""
    from tests.jvm import classpath

    assert catalog_uri.startswith("sqlite:///"), catalog_uri
    script = f"""
import base64, datetime, json
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.jars", {",".join(classpath("spark-iceberg").split(":"))!r})
         .config("spark.sql.catalog.tierlog", "org.apache.iceberg.spark.SparkCatalog")
         .config("spark.sql.catalog.tierlog.type", "jdbc")
         .config("spark.sql.catalog.tierlog.uri", {"jdbc:sqlite:" + catalog_uri[len("sqlite://"):]!r})
         .config("spark.sql.catalog.tierlog.warehouse", {warehouse!r})
         .getOrCreate())
def plain(v):
    if isinstance(v, dict):
        return {{k: plain(x) for k, x in v.items()}}
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, datetime.datetime):
        return v.isoformat()
    return v
out = {{name: [plain(r.asDict(recursive=True)) for r in spark.sql(q).collect()] for name, q in {queries!r}.items()}}
print(json.dumps(out))
"""
    return spark_reader_output(script, tmp_path)


def test_a_sync_that_fails_after_its_commit_landed_registers_nothing_twice(tmp_path, monkeypatch):
    """The commit is in the catalog, then the step after it fails, before the process took in what
    it committed, and again after: the next round must not add the same rows or segments again
    (CheckedWriter counts every file a table lists; the ledger every row)."""
    from connectors.tables import fresh

    failed = []
    real_apply, real_expire = fresh.apply, MessageTables._expire_snapshots

    def apply_once(*args):
        if len(failed) == 2:  # the third commit: it landed, and the answer is lost
            failed.append("apply")
            raise ConnectionError("the catalog went away after the commit")
        return real_apply(*args)

    def expire_once(self, topic):
        if not failed:
            failed.append(topic)
            raise ConnectionError("the catalog went away after the commit")
        if len(failed) == 1:
            failed.append("ok")
        return real_expire(self, topic)
    monkeypatch.setattr(fresh, "apply", apply_once)
    monkeypatch.setattr(MessageTables, "_expire_snapshots", expire_once)
    run = TablesRun(tmp_path, messages=200, seed=4, faults=tw.Faults())
    rng = random.Random(4)
    try:
        for batch_id, first in enumerate(range(0, 200, 20)):
            run.writer.commit(batch_id, run.parts(first, first + 20, 2, rng), run.gaps.between)
            run.writer.maintain()
        assert "apply" in failed, f"no commit was followed by a failure: {failed}"
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def count_commits(monkeypatch) -> list[str]:
    """The topics of the table commits made from now on, in order."""
    commits: list[str] = []
    real = MessageTables._commit_once

    def counted(self, topic, *args):
        commits.append(topic)
        return real(self, topic, *args)
    monkeypatch.setattr(MessageTables, "_commit_once", counted)
    return commits


def test_a_commit_interval_holds_a_table_and_its_lag_shows_what_waits(tmp_path, monkeypatch):
    """With ``commit_interval_s`` far off, each table commits at its first round, then holds its new
    rows: ``info`` counts them as its lag, and the writer deletes no staging object the tables
    still need; with the interval 0, the next round takes them, and nothing is left behind.  Rounds
    that find nothing new commit nothing (a replacement the last commit made possible aside)."""
    commits = count_commits(monkeypatch)
    run = TablesRun(tmp_path, messages=240, seed=3, faults=tw.Faults())
    tables = run.writer.tables
    tables.settings = replace(tables.settings, commit_interval_s=3600.0)
    rng = random.Random(3)
    held = 0
    try:
        for batch_id, first in enumerate(range(0, 240, 20)):
            run.writer.commit(batch_id, run.parts(first, first + 20, 2, rng), run.gaps.between)
            run.writer.maintain()
            lag = sum(i["lag_messages"] for i in tables.info(run.writer.table_view()))
            if batch_id:
                assert lag > 0, "a table took rows within its interval"
                held += 1
        assert held and len(commits) == len(set(commits)), f"a table committed twice within the interval: {commits}"
        tables.settings = replace(tables.settings, commit_interval_s=0.0)
        run.writer.maintain()
        assert tables.synced_seq == run.writer.head.seq
        assert sum(i["lag_messages"] for i in tables.info(run.writer.table_view())) == 0
        for _ in range(5):  # a commit may make a replacement possible: one more round takes it
            before = len(commits)
            run.writer.maintain()
            if len(commits) == before:
                break
        for _ in range(3):
            run.writer.maintain()  # nothing new: no commit
        assert len(commits) == before
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


def test_the_request_budget_bounds_commits_and_the_longest_waiting_table_goes_first(tmp_path, monkeypatch):
    """``commits_per_minute`` 1: of the tables with new rows, one commits a round (the one that waited
    longest), the others wait their turn, and every table catches up as the budget allows."""
    now = [1000.0]
    monkeypatch.setattr(tables_module.time, "monotonic", lambda: now[0])
    commits = count_commits(monkeypatch)
    run = TablesRun(tmp_path, messages=120, seed=12, faults=tw.Faults())
    tables = run.writer.tables
    tables.settings = replace(tables.settings, commits_per_minute=1)
    rng = random.Random(12)
    try:
        run.writer.commit(0, run.parts(0, 120, 2, rng), run.gaps.between)
        topics = sorted({k[0] for k in run.writer.head.queues})
        assert len(topics) >= 2
        for round_ in range(len(topics)):
            run.writer.maintain()
            assert len(commits) == round_ + 1, commits
            now[0] += 61  # the budget's minute passes
        assert sorted(commits) == topics, "every table took its turn, once"
        assert assert_tables_equal_ledger(run) > 0
    finally:
        run.close()


@pytest.mark.timeout(600)
def test_tierlog_run_commits_to_a_rest_catalog(spark, tmp_path):
    """``tables.catalog_uri`` naming a REST catalog (Apache Iceberg's own REST server, over its JDBC
    catalog): both kinds of table, read back through that catalog by pyiceberg and from their
    metadata files by DuckDB, equal the ledger."""
    from streaming import config as cfg
    from streaming.service import Service
    from tests.iceberg_rest import IcebergRest
    from tests.test_tables_latest import assert_latest_tables_equal_ledger
    from tests.tiering_helpers import make_conf, produce

    tier = str(tmp_path / "tier")
    with IcebergRest(tmp_path / "rest", warehouse=str(tmp_path / "tier" / "_tables")) as rest:
        conf = make_conf(tmp_path, tier, segment_messages=150, compaction=cfg.CompactionConfig(snapshot_interval_s=0.01))
        conf = replace(conf, tables=cfg.TablesConfig(enabled=True, catalog_uri=rest.uri))
        produce(conf, 1200)
        assert Service(conf).run(until_caught_up=True, spark=spark) == 0
        assert assert_message_tables_equal_ledger(conf) > 400
        assert assert_latest_tables_equal_ledger(conf) > 20
    assert (tmp_path / "rest" / "catalog.db").exists() and not (tmp_path / "state" / "tables.db").exists()
