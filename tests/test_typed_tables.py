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
    finally:
        run.close()


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
