"""Latest-per-key tables (``connectors.tables.latest``): each compacted snapshot of a topic is a
commit of its table.  Compared with the latest value of each key in what the writer appended
(``tests.ledger``) below the snapshot's offset, read by pyiceberg, DuckDB's ``iceberg_scan`` and
polars; older table snapshots give the earlier snapshots' values (time travel); no table snapshot
ever names a file the tier deleted, through a crash inside a commit and a catalog that is away."""

from __future__ import annotations

import os
import threading

import pytest

from connectors.commitlog.reader import CommitLogReader
from connectors.tables import latest as latest_module
from connectors.tables.catalog import data_location, default_settings
from connectors.tables.base import data_files
from connectors.tables.latest import LatestTables
from connectors.tier import snapshots
from connectors.tier.location import open_backend
from state.kv import KVView
from state.replay import replay_messages
from streaming import config as cfg
from state.kv_writer import write_snapshot
from tests.kv_helpers import append, kv_messages
from tests.oracle import view_fields, written_messages
from tests.test_tables import duckdb_rows

# polars plans Iceberg scans through pyiceberg unless polars_iceberg is installed; said, not warned.
os.environ.setdefault("POLARS_ICEBERG_PLANNER", "pyiceberg")
BROKER = "broker-a"
FIELDS = ("body", "phy_offset", "queue_id", "queue_offset", "store_ts")


class Killed(BaseException):
    """A crash as a kill is: no ``except Exception`` of the code under test sees it."""


def ledger_latest(directory: str, below: int) -> dict:
    """(topic, key) -> the fields of the key's latest message below physical offset ``below``, from
    the writer's ledger; deleted keys absent."""
    latest: dict = {}
    for m in written_messages(directory):
        key = m.key("KEYS")
        if key is not None and m.dispatched and m.phy_offset < below:
            latest[(m.topic, key)] = view_fields(m)
    return {k: tuple(v[f] for f in FIELDS) for k, v in latest.items() if not v["deleted"]}


def table_contents(rows, topic: str, broker: str) -> dict:
    out = {}
    for r in rows:
        ts = r["store_ts"]
        ms = ts if isinstance(ts, int) else round(ts.timestamp() * 1000)
        assert r["broker"] == broker
        assert (topic, r["key"]) not in out, f"key {r['key']!r} twice in the table of {topic}"
        out[(topic, r["key"])] = (bytes(r["body"]), r["phy_offset"], r["queue_id"], r["queue_offset"], ms)
    return out


def read_all_ways(tables: LatestTables, snapshot_id: int | None = None) -> dict:
    """Every topic's table as pyiceberg reads it (at ``snapshot_id`` of each, if given: a dict by
    topic); the current snapshot is also read by DuckDB from the metadata file and by polars."""
    import polars as pl

    got = {}
    for topic in tables.topics():
        table = tables.catalog.load_table(tables._identifier(topic))
        at = snapshot_id[topic] if isinstance(snapshot_id, dict) else None
        pyice = table_contents(table.scan(snapshot_id=at).to_arrow().to_pylist(), topic, tables.broker)
        if at is None:
            s3 = tables.tier_location.startswith("s3://")
            duck = duckdb_rows(table.metadata_location, s3=s3, columns=("*",))
            assert table_contents(duck, topic, tables.broker) == pyice, topic
            polars = pl.scan_iceberg(table).collect().to_dicts()
            assert table_contents(polars, topic, tables.broker) == pyice, topic
        got.update(pyice)
    return got


def assert_no_snapshot_names_a_missing_file(tables: LatestTables) -> int:
    """Every snapshot of every table (time travel included) lists only files the tier holds."""
    listed = 0
    for topic in tables.topics():
        table = tables.catalog.load_table(tables._identifier(topic))
        for snap in table.metadata.snapshots:
            for path in (f.file_path for f in data_files(table, snap)):
                assert os.path.exists(path.removeprefix("file://")), f"{topic}: snapshot {snap.snapshot_id} names {path}"
                listed += 1
    return listed


def assert_latest_tables_equal_ledger(conf: cfg.Config) -> int:
    """After ``tierlog run``: each latest-per-key table, read three ways, holds the ledger's latest
    value of every live key below the offset its snapshot reflects (each topic's own: a snapshot
    round writes only the topics that changed since their last); returns the keys."""
    from streaming.settings import tables as table_settings

    tables = LatestTables(table_settings(conf), conf.tier.location, conf.broker.name)
    through = {i["topic"]: i["through_phy"] for i in tables.info()}
    want = {}
    for topic, below in through.items():
        want.update((k, v) for k, v in ledger_latest(conf.commitlog.dir, below).items() if k[0] == topic)
    assert read_all_ways(tables) == want
    assert {t for t, _ in ledger_latest(conf.commitlog.dir, max(through.values()))} <= set(through)
    return len(want)


@pytest.mark.timeout(600)
def test_latest_tables_are_the_ledgers_latest_values_at_each_snapshot(tmp_path, monkeypatch):
    """Eight rounds of appends, each replayed into a KV view and snapshotted (keep = 2): after
    each, the tables equal the ledger's latest values below the snapshot's offset, the previous
    table snapshot equals the previous round's (time travel), and no snapshot names a deleted file;
    round 3's table commit is killed midway and round 5's catalog is away; the next round repairs."""
    tier = str(tmp_path / "tier")
    conf = cfg.Config(commitlog=cfg.CommitlogConfig(dir=str(tmp_path / "commitlog")))
    settings = default_settings(tier, str(tmp_path / "state"))
    backend = open_backend(tier)
    kills, away = {"armed": False, "fired": 0}, {"on": False, "refused": 0}

    def crash_point(name):
        if name == "latest_table_committing" and kills["armed"]:
            kills["armed"], kills["fired"] = False, kills["fired"] + 1
            raise Killed(name)
    monkeypatch.setattr(latest_module, "crash_point", crash_point)
    real = LatestTables._commit_once

    def commit_once(self, *args):
        if away["on"]:
            away["refused"] += 1
            raise ConnectionError("the catalog is unreachable")
        return real(self, *args)
    monkeypatch.setattr(LatestTables, "_commit_once", commit_once)

    history: list[tuple[dict, dict]] = []  # (expected, table snapshot id by topic) per committed round
    tables = LatestTables(settings, tier, BROKER)
    start = 0
    for round_ in range(8):
        append(conf, kv_messages(400, keys=150, seed=round_, topics=3, delete_ratio=0.2))
        with CommitLogReader(conf.commitlog.dir) as reader, KVView(str(tmp_path / "kv")) as kv:
            end = reader.end_offset(start)
            replay_messages(kv, reader, start, end)
            kv.apply([], applied_through=end)
            start = end
            kills["armed"], away["on"] = round_ == 3, round_ == 5
            try:
                write_snapshot(kv, tier, BROKER, end, keep=2, tables=tables)
            except Killed:
                tables = LatestTables(settings, tier, BROKER)  # the process after the kill
                continue
        assert assert_no_snapshot_names_a_missing_file(tables) > 0
        if round_ == 5:
            kept = snapshots.list_snapshots(backend, BROKER)
            assert max(len([s for s in kept if s.topic == t]) for t in {s.topic for s in kept}) >= 3, \
                "a snapshot was pruned while its table commit failed"
            continue
        expected = ledger_latest(conf.commitlog.dir, end)
        assert len(expected) > 100, "too few live keys to tell"
        assert read_all_ways(tables) == expected, f"round {round_}"
        ids = {t: tables.catalog.load_table(tables._identifier(t)).current_snapshot().snapshot_id
               for t in tables.topics()}
        if history and round_ not in (4, 6):  # the previous committed snapshot is still on file
            previous_expected, previous_ids = history[-1]
            assert read_all_ways(tables, previous_ids) == previous_expected, f"time travel from round {round_}"
        history.append((expected, ids))
    assert kills["fired"] == 1 and away["refused"] > 0
    assert {i["kind"] for i in tables.info()} == {"latest"}
    assert all(i["through_phy"] == start for i in tables.info())
    backend.close()


def test_a_rebuild_commits_the_newest_snapshots_and_a_repeat_changes_nothing(tmp_path):
    tier = str(tmp_path / "tier")
    conf = cfg.Config(commitlog=cfg.CommitlogConfig(dir=str(tmp_path / "commitlog")))
    append(conf, kv_messages(600, keys=200, seed=7, topics=2))
    with CommitLogReader(conf.commitlog.dir) as reader, KVView(str(tmp_path / "kv")) as kv:
        end = reader.end_offset(0)
        replay_messages(kv, reader, 0, end)
        write_snapshot(kv, tier, BROKER, end, keep=2)  # no tables yet
    tables = LatestTables(default_settings(tier, str(tmp_path / "state")), tier, BROKER)
    backend = open_backend(tier)
    assert tables.rebuild(backend) == 2
    first = tables.info()
    assert tables.rebuild(backend) == 2
    assert tables.info() == first, "a rebuild of tables equal to the tier committed again"
    assert read_all_ways(tables) == ledger_latest(conf.commitlog.dir, end)
    assert all(i["metadata_location"].startswith(data_location(tier, "_tables")) for i in first)
    backend.close()


@pytest.mark.timeout(600)
def test_two_brokers_commit_into_one_latest_table_at_once(tmp_path):
    """Two brokers' tierlogs, each with its own commitlog and KV view, open one new catalog and
    snapshot into one tier from two threads at once, five rounds each: each topic's table ends
    with exactly one file per broker, whose rows are that broker's latest values by its own
    ledger.  (Run here, about ten commits lost a race and were recomputed; the two openers of the
    new SQLite catalog raced to create its tables, which failed before open_catalog retried.)"""
    tier = str(tmp_path / "tier")
    settings = default_settings(tier, str(tmp_path / "state"))
    done: dict[str, int] = {}
    ends: dict[str, int] = {}
    errors: list[BaseException] = []

    def broker_run(broker: str, seed: int) -> None:
        try:
            conf = cfg.Config(commitlog=cfg.CommitlogConfig(dir=str(tmp_path / broker / "commitlog")))
            tables, start = LatestTables(settings, tier, broker), 0
            for round_ in range(5):
                append(conf, kv_messages(300, keys=120, seed=seed + round_, topics=3, delete_ratio=0.2))
                with CommitLogReader(conf.commitlog.dir) as reader, KVView(str(tmp_path / broker / "kv")) as kv:
                    end = reader.end_offset(start)
                    replay_messages(kv, reader, start, end)
                    kv.apply([], applied_through=end)
                    start = end
                    write_snapshot(kv, tier, broker, end, keep=2, tables=tables)
                done[broker] = done.get(broker, 0) + 1
            ends[broker] = start
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=broker_run, args=(b, s)) for b, s in (("broker-a", 0), ("broker-b", 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert done == {"broker-a": 5, "broker-b": 5}, done
    reader_tables = LatestTables(settings, tier, "broker-a")
    assert len(reader_tables.topics()) == 3
    for topic in reader_tables.topics():
        table = reader_tables.catalog.load_table(reader_tables._identifier(topic))
        files = data_files(table, table.current_snapshot())
        assert sorted(f.partition[0] for f in files) == ["broker-a", "broker-b"], [f.file_path for f in files]
        rows = table.scan().to_arrow().to_pylist()
        for broker in ("broker-a", "broker-b"):
            mine = table_contents([r for r in rows if r["broker"] == broker], topic, broker)
            want = {k: v for k, v in ledger_latest(str(tmp_path / broker / "commitlog"), ends[broker]).items()
                    if k[0] == topic}
            assert mine == want and want, (topic, broker)
