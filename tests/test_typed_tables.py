"""Typed columns in the message tables (``topics.body_format``): through the tier writer's random
commits, seals, expirations, restarts and crashes (``test_tables``' harness), every row of a JSON
topic's table, read by pyiceberg and by DuckDB, carries the typed values an oracle of its own
(``test_json_bodies.oracle``: the standard library's parse of the body, conformed to the table's
final schema) says, beside the raw body the ledger wrote."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pyarrow as pa
import pytest

from connectors.commitlog.arrow import MESSAGE_SCHEMA

from connectors.commitlog.workload import Workload
from connectors.tables.catalog import default_settings
from tests import test_tables as tt
from tests import test_tier_writer as tw
from tests.test_json_bodies import oracle


@pytest.fixture(autouse=True)
def json_topics(monkeypatch):
    """The harness's log holds JSON orders, and every topic's table types them."""
    monkeypatch.setattr(tw, "Workload", partial(Workload, body_format="json"))
    monkeypatch.setattr(tt, "default_settings",
                        lambda *a, **k: replace(default_settings(*a, **k), body_formats="topic-*=json"))


# the harness's fixtures, for this module's tests too
whole_reconciliations = tt.whole_reconciliations
table_faults = tt.table_faults


def assert_typed_columns_equal_oracle(run) -> pa.Schema:
    """Every row's typed values and markers, through pyiceberg and DuckDB, are the oracle's."""
    tables = run.writer.tables
    schemas = []
    for topic in tables.topics():
        table = tables.catalog.load_table(tables._identifier(topic))
        schema = table.schema().as_arrow()
        typed = pa.schema([f for f in schema if f.name not in MESSAGE_SCHEMA.names])
        pyice = table.scan().to_arrow().to_pylist()
        duck = tt.duckdb_rows(table.metadata_location, columns=("*",))
        # pyiceberg 0.12 reads a null list of structs as an empty one (apache/iceberg-python
        # issue 3833, open); the files hold the null, as DuckDB shows
        struct_lists = {f.name for f in typed if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
                        if pa.types.is_struct(f.type.value_type)}
        for rows in (pyice, duck):
            assert len(rows) == len(pyice)
            for row in sorted(rows, key=lambda r: (r["queue_id"], r["queue_offset"])):
                want = oracle([row["body"]], pa.schema([f for f in typed if f.name != "_body_errors"]))[0]
                got = {k: (None if rows is pyice and k in struct_lists and row[k] == [] and want[k] is None else row[k])
                       for k in want}
                assert got == want, (topic, row["queue_id"], row["queue_offset"], "duckdb" if rows is duck else "pyiceberg")
        # the bodies counted as not JSON objects: every one the table lists (retention drops rows
        # of topic-1, never the count)
        counted = sum(int(v) for k, v in table.properties.items() if k.startswith("tierlog.unreadable-bodies."))
        listed = sum(1 for row in pyice if row["_body_errors"] == ["$"])
        assert counted == listed if topic == "topic-0" else counted >= listed, (topic, counted, listed)
        schemas.append(typed)
    return schemas[0] if schemas else pa.schema([])


def test_typed_tables_follow_random_commits_seals_expirations_and_restarts(tmp_path, caplog):
    caplog.set_level("INFO", logger="connectors.tables.messages")
    run, did = tt.drive(tmp_path, 1)
    try:
        tw.assert_tier_equals_ledger(run)
        assert tt.assert_tables_equal_ledger(run) > 0
        typed = assert_typed_columns_equal_oracle(run)
        # the workload's shape changes over its life: each of the evolution rules was taken
        assert typed.field("amount").type == pa.float64()  # started as whole numbers, widened
        assert "coupon" in typed.names  # added a third of the way in
        assert pa.types.is_timestamp(typed.field("placed_at").type)
        assert pa.types.is_struct(typed.field("address").type)
        assert did["restart"] and did["fold"], did
        assert sum(run.writer.tables.unreadable.values()) > 0
        assert any("widened from long to double" in r.getMessage() for r in caplog.records)
        # a filter on a typed column skips the files its statistics rule out (order_id grows with time)
        table = run.writer.tables.table("topic-0")
        top = max(r["order_id"] for r in table.scan(selected_fields=("order_id",)).to_arrow().to_pylist()
                  if r["order_id"] is not None)
        every, read = len(list(table.scan().plan_files())), len(list(table.scan(row_filter=f"order_id >= {top - 5}").plan_files()))
        assert 0 < read < every, (read, every)
        assert_spark_reads_the_typed_columns(table, tables_settings=run.writer.tables.settings,
                                             tmp_path=tmp_path)
    finally:
        run.close()


def assert_spark_reads_the_typed_columns(table, tables_settings, tmp_path) -> None:
    """A downstream Spark (Iceberg's runtime, the jdbc catalog reading.md configures) reads every
    row's typed values as pyiceberg does, and a filter on typed columns counts the rows pyiceberg's does."""
    import base64

    from tests.test_tables import run_spark_sql

    name = "tierlog." + ".".join(table.name())
    typed = [f.name for f in table.schema().as_arrow() if f.name not in MESSAGE_SCHEMA.names]
    times = {f.name for f in table.schema().as_arrow() if f.name in typed and pa.types.is_timestamp(f.type)}
    columns = ", ".join(f"unix_micros(`{c}`) as `{c}`" if c in times else f"`{c}`" for c in typed)
    got = run_spark_sql(tables_settings.catalog_uri, tables_settings.warehouse, {
        "rows": f"select queue_id, queue_offset, body, {columns} from {name}",
        "filtered": f"select count(*) as n from {name} where amount > 100 and paid"}, tmp_path)
    def empty_as_null(row: dict) -> dict:
        # pyiceberg's null list of structs, read as empty (issue 3833, above): Spark reads the null
        return {c: None if v == [] and c in typed else v for c, v in row.items()}

    want = table.scan(selected_fields=("queue_id", "queue_offset", "body", *typed)).to_arrow().to_pylist()
    for row in want:
        row["body"] = base64.b64encode(row["body"]).decode()
        for c in times:
            row[c] = None if row[c] is None else round(row[c].timestamp() * 1_000_000)
    want = [empty_as_null(row) for row in want]

    def key(r):
        return r["queue_id"], r["queue_offset"]
    spark_rows = sorted((empty_as_null(r) for r in got["rows"]), key=key)
    assert len(spark_rows) == len(want)
    assert spark_rows == sorted(want, key=key)
    assert got["filtered"] == [{"n": sum(1 for r in want if r["amount"] is not None and r["amount"] > 100 and r["paid"])}]


class RecordingFaults(tw.Faults):
    """Faults that also keep the name of each write, so a test can crash at the ones it names."""

    def __init__(self, at: int | None = None):
        super().__init__(at)
        self.names: list[str] = []

    def write(self, what: str) -> None:
        self.names.append(what)
        super().write(what)


TYPED_WRITES = ("table_schema_changed", "table_widening", "table_typed_copy_written")


def test_a_crash_at_a_schema_change_a_widening_a_typed_copy_or_every_twelfth_write_leaves_the_typed_table_right(
        tmp_path, monkeypatch):
    monkeypatch.setattr(tw, "Faults", RecordingFaults)
    clean, _ = tt.drive(tmp_path / "clean", 2, messages=120)
    names = clean.faults.names
    clean.close()
    firsts = [names.index(name) + 1 for name in TYPED_WRITES]
    fired = set()
    for at in sorted(set(firsts + list(range(1, len(names) + 1, 12)))):
        run, did = tt.drive(tmp_path / f"crash{at}", 2, crash_at=at, messages=120)
        try:
            fired.add(run.faults.fired)
            run.writer.maintain()  # the process after the crash brings the tables in step
            tt.assert_tables_equal_ledger(run)
            assert_typed_columns_equal_oracle(run)
        finally:
            run.close()
    assert set(TYPED_WRITES) <= fired, fired


def test_a_json_topics_latest_per_key_table_types_each_snapshot_and_widens_in_one_commit(tmp_path):
    """Rounds of JSON orders, each replayed into a KV view and snapshotted into a latest-per-key table
    that types the topic: after each, every live key's row (pyiceberg, DuckDB, polars) is the
    ledger's latest value, and its typed values and markers, through each of the three, are the
    oracle's; the amount that turns
    from whole numbers to cents in the second round widens the column in the commit that lists
    the copy that needs it."""
    import itertools

    import polars as pl

    from connectors.commitlog.reader import CommitLogReader
    from connectors.tables.latest import LatestTables
    from state.kv import KVView
    from state.kv_writer import write_snapshot
    from state.replay import replay_messages
    from streaming import config as cfg
    from tests.kv_helpers import append
    from tests.test_tables_latest import BROKER, assert_no_snapshot_names_a_missing_file, ledger_latest, \
        read_all_ways

    tier = str(tmp_path / "tier")
    conf = cfg.Config(commitlog=cfg.CommitlogConfig(dir=str(tmp_path / "commitlog")))
    settings = replace(default_settings(tier, str(tmp_path / "state")), body_formats="topic-*=json")
    tables = LatestTables(settings, tier, BROKER)
    orders = Workload(messages=1200, topics=2, queues=2, keys=150, body_size=300, delete_ratio=0.1,
                      body_format="json", seed=4).generate()
    start, types = 0, []
    for round_ in range(3):
        append(conf, itertools.islice(orders, 500 if round_ == 0 else 350))  # round 0: whole amounts only
        with CommitLogReader(conf.commitlog.dir) as reader, KVView(str(tmp_path / "kv")) as kv:
            end = reader.end_offset(start)
            replay_messages(kv, reader, start, end)
            kv.apply([], applied_through=end)
            start = end
            write_snapshot(kv, tier, BROKER, end, keep=2, tables=tables)
        assert assert_no_snapshot_names_a_missing_file(tables) > 0
        assert read_all_ways(tables) == ledger_latest(conf.commitlog.dir, end), round_
        for topic in tables.topics():
            table = tables.catalog.load_table(tables._identifier(topic))
            typed = pa.schema([f for f in table.schema().as_arrow()
                               if f.name not in MESSAGE_SCHEMA.names and f.name != "_body_errors"])
            for rows in (table.scan().to_arrow().to_pylist(), tt.duckdb_rows(table.metadata_location, columns=("*",)),
                         pl.scan_iceberg(table).collect().to_dicts()):
                for row in rows:
                    want = oracle([row["body"]], typed)[0]
                    # pyiceberg's null list of structs, read as empty (issue 3833, above)
                    got = {k: None if want[k] is None and row[k] == [] else row[k] for k in want}
                    assert got == want, (round_, topic, row["key"])
            types.append(typed.field("amount").type)
    assert types[0] == pa.int64() and types[-1] == pa.float64()
