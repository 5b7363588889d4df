"""The tiering query against posix and S3: exactly once, sealing, replays, retention, reader safety."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from connectors.errors import TierlogError
from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.errors import ObjectNotFound
from connectors.tier.reader import TierReader
from connectors.tier.writer import TierWriter
from state.metadata import MetadataStore
from streaming.service import Service
from streaming.settings import derive
from tests.oracle import normalize_arrow_row
from tests.tiering_helpers import assert_tier_equals_commitlog, make_conf, oracle_rows, produce, tier_rows
from connectors.brokers import DEFAULT_BROKER

NAMES = layout.Names(DEFAULT_BROKER)  # the names of a one-broker tier


def run_until_caught_up(spark, conf) -> Service:
    service = Service(conf)
    assert service.run(until_caught_up=True, spark=spark) == 0
    return service


def test_the_tier_holds_committed_transactions_only(spark, tmp_path):
    """A log with RocketMQ's transaction records among plain messages: the tier holds the plain
    messages and the COMMIT records, never a PREPARED or ROLLBACK one."""
    from connectors.commitlog.format import Message
    from tests.kv_helpers import append

    conf = make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=40)
    flags = (0x0, 0x4, 0x8, 0x0, 0xC, 0x8)  # plain, PREPARED, COMMIT, plain, ROLLBACK, COMMIT
    append(conf, [Message(topic=f"t{i % 2}", queue_id=i % 3, body=b"m%d" % i, properties={"KEYS": f"k{i % 7}"},
                          sysflag=flags[i % len(flags)]) for i in range(600)])
    run_until_caught_up(spark, conf)
    rows = tier_rows(conf.tier.location)
    assert sorted({r["sysflag"] & 0xC for r in rows}) == [0x0, 0x8] and len(rows) == 400
    assert_tier_equals_commitlog(conf)


def test_tier_holds_exactly_the_commitlog_and_seals_segments(spark, tmp_path, tier_location):
    conf = make_conf(tmp_path, tier_location, segment_messages=150)
    produce(conf, 1500)
    service = run_until_caught_up(spark, conf)
    assert service.batches["tiering"] > 3  # admission control cut the backlog into batches
    assert_tier_equals_commitlog(conf)

    state = TierReader(tier_location).committed()
    assert state.segments, "queues past segment_messages must have been sealed"
    for seg in state.segments.values():
        assert seg.name == NAMES.segment(seg.topic, seg.queue_id, seg.base)
        assert seg.rows == seg.end - seg.base + 1
    objects = {o.name for o in open_backend(tier_location).list()}
    assert set(state.segments) <= objects
    assert {s.keys for s in state.segments.values()} <= objects  # every segment has its key index
    # Fully sealed staging objects are retired from the state and deleted (grace 0).
    assert not ({n for n in objects if n.startswith(layout.STAGING_PREFIX)} - set(state.staging))

    # The metadata store mirrors the tier, and is rebuilt from it identically.
    store = MetadataStore(derive(conf).paths.metadata)
    try:
        before = (store.queues(), store.journal.sinks(), store.last_seq())
        store.rebuild(state)
        assert (store.queues(), store.journal.sinks(), store.last_seq()) == before
        for q in before[0]:
            assert q.low <= q.sealed <= q.commit <= q.dispatch  # invariant 2
            assert q.segments == len(state.segments_for((q.topic, q.queue_id)))
    finally:
        store.close()


def test_batches_are_staged_by_the_driver_its_processes_or_spark_and_the_tier_is_the_same(spark, tmp_path, caplog):
    """``tier.stage_on_driver``: a batch no larger than ``source.partition_bytes`` is staged by the
    driver from its offset range; a larger one by the driver's staging processes
    (``tier.stage_in_processes``, the first batch too: its offset entry says where it began), or,
    with them off, by Spark's tasks.  Files roll every 256 KiB, so ranges start on blank tails too.
    The tier equals the writers' ledger whoever staged what."""
    conf = make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=120)
    object.__setattr__(conf.source, "partition_bytes", 150_000)  # batches of 200,000 bytes need more than one
    object.__setattr__(conf.source, "max_bytes_per_trigger", 700_000)
    runs, stopped = [], []
    for start, count, max_bytes, processes in ((0, 2400, None, True), (2400, 900, 100_000, True),
                                               (3300, 2400, 700_000, False)):
        produce(conf, count, start=start)
        if max_bytes:
            object.__setattr__(conf.source, "max_bytes_per_trigger", max_bytes)
        object.__setattr__(conf.tier, "stage_in_processes", processes)
        caplog.clear()
        with caplog.at_level("INFO", logger="tierlog.service"):
            run_until_caught_up(spark, conf)
        runs.append([json.loads(r.getMessage().split("batch ", 1)[1]).get("staged_by") for r in caplog.records
                     if r.getMessage().startswith("batch {") and '"tiering"' in r.getMessage()])
        stopped.append(next(r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped: ")))
    assert_tier_equals_commitlog(conf)
    assert runs[0][0] == "processes" and set(runs[0]) <= {"processes", "driver"}, runs
    # Each batch the processes staged was staged ahead, as the source went on to cut it: the first
    # from the query's start, each next behind the one before; a drain of a still log guesses no wrong range.
    taken = re.search(r"staged ahead, (\d+) were taken and (\d+) dropped", stopped[0])
    assert taken and int(taken[1]) >= runs[0].count("processes") and taken[2] == "0", stopped[0]
    assert len(runs[1]) >= 4 and set(runs[1]) == {"driver"}, runs
    assert runs[2][0] == "spark" and "processes" not in runs[2], runs
    assert TierReader(conf.tier.location).committed().segments, "sealing ran over driver-staged objects"


def test_more_data_later_and_a_new_checkpoint_commit_nothing_twice(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=100)
    produce(conf, 400)
    run_until_caught_up(spark, conf)
    produce(conf, 300, start=400)
    run_until_caught_up(spark, conf)
    assert_tier_equals_commitlog(conf)
    seq = TierReader(conf.tier.location).committed().seq

    # A lost Spark checkpoint starts over at the earliest offset: every batch is below the tier's end.
    fresh = make_conf(tmp_path, conf.tier.location, segment_messages=100)
    object.__setattr__(fresh.checkpoint, "dir", str(tmp_path / "other-checkpoints"))
    run_until_caught_up(spark, fresh)
    assert TierReader(conf.tier.location).committed().seq == seq  # no commit record at all: replays are no-ops
    assert_tier_equals_commitlog(conf)


def test_a_batch_that_would_skip_messages_stops_the_query(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"))
    produce(conf, 200)
    run_until_caught_up(spark, conf)
    produce(conf, 200, start=200)
    skip_to = oracle_rows(conf)[300]["phy_offset"]
    object.__setattr__(conf.checkpoint, "dir", str(tmp_path / "ckpt2"))
    object.__setattr__(conf.source, "starting_offset", str(skip_to))
    with pytest.raises(TierlogError, match=f"from physical offset {skip_to}.*would be skipped"):
        Service(conf).run(until_caught_up=True, spark=spark)


def test_retention_expires_old_segments(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=50, retention="*=1s")
    produce(conf, 300)
    service = run_until_caught_up(spark, conf)
    time.sleep(1.5)
    # A new process's writer, as a restart would open: its first maintain sweeps every queue.  The
    # run's own writer swept less than retention.check_s ago, and on a warm Spark the segments it
    # sealed last were younger than 1 s when sealed, so it would rightly leave them until its next sweep.
    index = MetadataStore(derive(conf).paths.metadata)
    try:
        restarted = TierWriter(service.queries["tiering"].handler.writer.settings, index)
        restarted.maintain()
        restarted.maintain()  # deletes what the first call retired (no grace in these tests)
    finally:
        index.close()
    state = TierReader(conf.tier.location).committed()
    assert not state.segments
    assert all(q.low == q.sealed for q in state.queues.values())
    assert not [o for o in open_backend(conf.tier.location).list() if o.name.startswith(("topic=", layout.KEYS_PREFIX))]


def test_log_compaction_keeps_the_same_state(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=80, fold_every=2)
    produce(conf, 600)
    run_until_caught_up(spark, conf)
    names = [o.name for o in open_backend(conf.tier.location).list(layout.LOG_PREFIX)]
    assert any(n.endswith(".root.json") for n in names)
    assert len(names) < TierReader(conf.tier.location).committed().seq  # old records were deleted
    assert_tier_equals_commitlog(conf)


def test_readers_see_only_committed_data_while_tiering_runs(spark, tmp_path, tier_location):
    conf = make_conf(tmp_path, tier_location, segment_messages=60)
    produce(conf, 1500)
    oracle = {r["phy_offset"]: r for r in oracle_rows(conf)}
    by_queue: dict = {}
    for r in oracle.values():
        by_queue.setdefault((r["topic"], r["queue_id"]), []).append(r)
    stop, problems, reads, errors, seqs = threading.Event(), [], [0], [], set()

    def reader():
        try:
            while not stop.is_set():
                reader_ = TierReader(tier_location)
                state = reader_.committed()
                try:
                    for key, q in state.queues.items():
                        rows = [normalize_arrow_row(r) for r in reader_.read_queue(*key, state).to_pylist()]
                        expected = by_queue[key][q.low : q.commit]
                        if rows != expected:
                            problems.append((key, q, len(rows), len(expected)))
                except ObjectNotFound:
                    continue  # delete_grace_s = 0: an object the view named was retired meanwhile; read afresh
                reads[0] += 1
                seqs.add(state.seq)
        except Exception as exc:  # noqa: BLE001 - raised in the test below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        run_until_caught_up(spark, conf)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert not problems, problems[:3]
    # The reader ran all along: it read the tier at several commits, not only before or after the run.
    assert reads[0] > 2 and len(seqs) >= 3, (reads[0], sorted(seqs))
    assert_tier_equals_commitlog(conf)


def test_spark_reads_sealed_segments_as_a_table(spark, tmp_path):
    conf = make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=20)
    produce(conf, 400, topics=1, queues=2)
    run_until_caught_up(spark, conf)
    state = TierReader(conf.tier.location).committed()
    sealed = {(s.topic, s.queue_id, o) for s in state.segments.values() for o in range(s.base, s.end + 1)}
    df = spark.read.parquet(conf.tier.location)
    got = {(r["topic"], r["queue_id"], r["queue_offset"]) for r in df.select("topic", "queue_id", "queue_offset").collect()}
    assert got == sealed and "queue" in df.columns
