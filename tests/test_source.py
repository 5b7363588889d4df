"""The ``commitlog`` Spark source: admission control, restarts, a concurrent writer."""

from __future__ import annotations

import threading
import time

import pytest

from connectors.commitlog import CommitLogReader, CommitLogWriter, Message
from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.errors import ConfigError
from streaming.sources.commitlog import SourceOptions, plan_partitions
from tests import ledger
from tests.oracle import normalize_arrow_row, written_rows

FILE = 64 * 1024


def produce(directory: str, n: int, start: int = 0, pause_every: int = 0, pause_s: float = 0.0) -> None:
    with CommitLogWriter(directory, file_size=FILE, fsync="never") as w:
        for i in range(start, start + n):
            ledger.append(w, [Message(topic=f"t{i % 2}", queue_id=i % 3, body=b"%d" % i * 20,
                                      properties={"KEYS": f"k{i % 50}"})])
            if pause_every and i % pause_every == 0:
                time.sleep(pause_s)


def table_rows(spark, name: str) -> list[dict]:
    return [normalize_arrow_row(r) for r in spark.table(name).toArrow().to_pylist()]


def stream(spark, directory: str, **options):
    reader = spark.readStream.format("commitlog").option("path", directory)
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def test_schema_matches_the_arrow_batches(spark, log_dir):
    from pyspark.sql.pandas.types import to_arrow_schema

    df = spark.read.format("commitlog").load(log_dir)
    assert to_arrow_schema(df.schema, timezone="UTC").equals(MESSAGE_SCHEMA)


def test_batch_read_equals_the_oracle(spark, log_dir):
    produce(log_dir, 700)
    df = spark.read.format("commitlog").option("partitionBytes", 8192).load(log_dir)
    assert df.rdd.getNumPartitions() > 10  # split at files and by size
    got = sorted((normalize_arrow_row(r) for r in df.toArrow().to_pylist()), key=lambda r: r["phy_offset"])
    assert got == written_rows(log_dir)


def test_memory_sink_reads_a_concurrent_writer_in_order(spark, log_dir, tmp_path):
    produce(log_dir, 10)
    writer = threading.Thread(target=produce, args=(log_dir, 2000, 10, 100, 0.1))
    writer.start()
    q = (
        stream(spark, log_dir, maxRecordsPerTrigger=300)
        .writeStream.format("memory").queryName("tail_run")
        .option("checkpointLocation", str(tmp_path / "c")).trigger(processingTime="200 milliseconds").start()
    )
    writer.join(120)
    q.processAllAvailable()
    q.stop()
    batches = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert len(batches) > 3 and max(batches) <= 300, "the query must have read while the writer appended"
    assert table_rows(spark, "tail_run") == written_rows(log_dir)


def test_restarts_on_one_checkpoint_read_nothing_twice(spark, log_dir, tmp_path):
    """Memory sinks cannot recover from a checkpoint, so restarts are checked through foreachBatch."""
    produce(log_dir, 10)
    writer = threading.Thread(target=produce, args=(log_dir, 3000, 10, 100, 0.15))
    writer.start()
    checkpoint = str(tmp_path / "ckpt")
    seen: list[tuple[int, list[dict]]] = []

    def collect(df, batch_id):
        seen.append((batch_id, [normalize_arrow_row(r) for r in df.toArrow().to_pylist()]))

    def run(**trigger):
        return (
            stream(spark, log_dir, maxRecordsPerTrigger=400)
            .writeStream.foreachBatch(collect)
            .option("checkpointLocation", checkpoint).trigger(**trigger).start()
        )

    q = run(availableNow=True)  # drains what is there when it starts, while the writer writes
    q.awaitTermination(120)
    assert q.exception() is None
    first_run = len(seen)
    q = run(processingTime="300 milliseconds")
    deadline = time.monotonic() + 120
    while len(seen) < first_run + 2 and time.monotonic() < deadline:  # two batches in, the writer still writing
        time.sleep(0.05)
    q.stop()  # mid-stream, possibly mid-batch
    second_run = len(seen)
    writer.join(120)
    produce(log_dir, 500, start=3010)  # something certainly left for the last run
    q = run(availableNow=True)
    q.awaitTermination(120)

    assert 0 < first_run < second_run < len(seen), "every run must have read something"
    assert all(0 < len(rows) <= 400 for _, rows in seen)
    # A batch stopped before its commit is replayed with the same id: it must hold the same rows.
    by_id: dict[int, list[dict]] = {}
    for batch_id, rows in seen:
        assert by_id.setdefault(batch_id, rows) == rows, f"batch {batch_id} was replayed with other rows"
    assert list(by_id) == sorted(by_id)
    got = [row for rows in by_id.values() for row in rows]
    oracle = written_rows(log_dir)
    assert len(oracle) == 3510
    assert [r["phy_offset"] for r in got] == [r["phy_offset"] for r in oracle]  # in order, none twice
    assert got == oracle


def test_max_bytes_per_trigger(spark, log_dir, tmp_path):
    produce(log_dir, 300)
    q = (
        stream(spark, log_dir, maxBytesPerTrigger=5000)
        .writeStream.format("noop").option("checkpointLocation", str(tmp_path / "c"))
        .trigger(availableNow=True).start()
    )
    q.awaitTermination(120)
    rows = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    size = written_rows(log_dir)[0]["size"]
    assert sum(rows) == 300 and max(rows) <= 5000 // size and len(rows) >= 300 * size // 5000


def test_starting_offset_latest_skips_history(spark, log_dir, tmp_path):
    produce(log_dir, 50)
    q = (
        stream(spark, log_dir, startingOffset="latest")
        .writeStream.format("memory").queryName("latest_run")
        .option("checkpointLocation", str(tmp_path / "c")).trigger(availableNow=True).start()
    )
    q.awaitTermination(120)
    assert spark.table("latest_run").count() == 0


def test_partitions_cut_at_files_and_by_size(log_dir):
    produce(log_dir, 2000)
    with CommitLogReader(log_dir) as reader:
        end = reader.end_offset()
        parts = plan_partitions(reader, 0, end, 10_000)
    assert parts[0].start == 0 and parts[-1].end == end
    assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
    assert all(p.start // FILE == (p.end - 1) // FILE for p in parts)  # never across a file
    assert all(p.end - p.start <= 10_000 + 200 for p in parts)


@pytest.mark.parametrize(
    "options,match",
    [
        ({}, "needs option `path`"),
        ({"path": "/nonexistent/commitlog"}, "does not exist"),
        ({"maxRecordsPerTrigger": "-3"}, "maxRecordsPerTrigger='-3'"),
        ({"checkCrc": "maybe"}, "checkCrc='maybe'"),
        ({"startingOffset": "soon"}, "startingOffset='soon'"),
    ],
)
def test_bad_options_name_the_option(log_dir, options, match):
    opts = {"path": log_dir, **options} if "path" not in options and options else dict(options)
    with pytest.raises(ConfigError, match=match):
        SourceOptions.parse(opts)


def test_a_small_batch_waits_for_bytes_or_its_delay_and_a_drain_never_waits(log_dir, monkeypatch):
    """minBytesPerTrigger / maxTriggerDelayMs, as Spark's Kafka source's minOffsetsPerTrigger and
    maxTriggerDelay: a quiet stream's batch waits (its start returned: no batch), a big enough one
    or one that waited its delay goes at once, and availableNow drains without waiting."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from streaming.sources.commitlog import CommitLogStreamReader

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    produce(log_dir, 20)  # a few hundred bytes
    opts = SourceOptions.parse({"path": log_dir, "minBytesPerTrigger": "100000", "maxTriggerDelayMs": "5000"})
    reader = CommitLogStreamReader(opts)
    start = reader.initialOffset()
    limit = ReadAllAvailable()
    assert reader.latestOffset(start, limit) == start  # below the bytes: it waits
    clock[0] += 4.9
    assert reader.latestOffset(start, limit) == start
    clock[0] += 0.2  # the first byte has waited 5.1 s
    end = reader.latestOffset(start, limit)
    assert end["phy_offset"] > start["phy_offset"]
    assert reader.latestOffset(end, limit) == end  # nothing new: no batch either way
    produce(log_dir, 2000, start=20)  # past the bytes: no wait
    assert reader.latestOffset(end, limit)["phy_offset"] > end["phy_offset"]

    drain = CommitLogStreamReader(opts)
    drain.prepareForTriggerAvailableNow()
    last = drain.latestOffset(end, limit)
    assert last["phy_offset"] > end["phy_offset"]  # availableNow never holds back
    produce(log_dir, 1, start=2020)  # past what the drain found there: left to the next run, not waited for
    assert drain.latestOffset(last, limit) == last
    reader.stop()
    drain.stop()


def test_a_batch_near_the_head_holds_follow_bytes_and_a_catch_up_takes_max_bytes(log_dir):
    """followBytesPerTrigger: while at most 4 times it is past a batch's start, the batch holds at
    most that many bytes (the driver stages it); a larger backlog is a catch-up, up to
    maxBytesPerTrigger; without a byte cap (ReadAllAvailable), or in a drain, nothing is held."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes

    from streaming.sources.commitlog import CommitLogStreamReader

    produce(log_dir, 2000)
    with CommitLogReader(log_dir) as r:
        first, head = r.first_offset(), r.end_offset()
    backlog = head - first
    follow = backlog // 3  # the whole backlog is within 4x: following the head
    reader = CommitLogStreamReader(SourceOptions.parse(
        {"path": log_dir, "maxBytesPerTrigger": str(backlog), "followBytesPerTrigger": str(follow)}))
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxBytes(backlog))["phy_offset"]
    assert 0 < end - first <= follow + 200, (end - first, follow)

    small = backlog // 10  # the backlog is over 4x: a catch-up, up to maxBytesPerTrigger
    reader = CommitLogStreamReader(SourceOptions.parse(
        {"path": log_dir, "maxBytesPerTrigger": str(backlog), "followBytesPerTrigger": str(small)}))
    assert reader.latestOffset(start, ReadMaxBytes(backlog))["phy_offset"] == head
    # Nearer the head, the same reader holds its batch to followBytesPerTrigger.
    near = head - 3 * small
    with CommitLogReader(log_dir) as r:
        near = r.scan(first, max_bytes=near - first).end
    assert reader.latestOffset({"phy_offset": near}, ReadMaxBytes(backlog))["phy_offset"] - near <= small + 200
    assert reader.latestOffset(start, ReadAllAvailable())["phy_offset"] == head
    # A drain (availableNow: --until-caught-up) follows no head: its last batch is not held either.
    drain = CommitLogStreamReader(SourceOptions.parse(
        {"path": log_dir, "maxBytesPerTrigger": str(backlog), "followBytesPerTrigger": str(small)}))
    drain.prepareForTriggerAvailableNow()
    assert drain.latestOffset({"phy_offset": near}, ReadMaxBytes(backlog))["phy_offset"] == head
