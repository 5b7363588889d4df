"""The mirror and changelog sinks through the service, against a real Kafka-protocol broker.

Topics are read back with assign() and seek and compared with plain replays of
the commitlog: the mirror record for record (per partition order, keys,
values, headers), the changelog as a compacted view (tombstones included).
"""

from __future__ import annotations

import pytest

from connectors.commitlog.format import Message
from streaming import config as cfg
from streaming.service import Service
from tests.cli_runner import sink_offsets
from tests.kafka_helpers import (
    assert_mirror_equals_oracle,
    changelog_oracle,
    changelog_records,
    compacted,
    kafka_conf,
)
from tests.kv_helpers import append, kv_messages, stored_kinds
from tests.oracle import latest_per_key
from tests.tiering_helpers import make_conf

COMPACTION = cfg.CompactionConfig(enabled=True, snapshot_interval_s=0)
TOPICS = ["t0", "t1"]


def run(spark, conf) -> None:
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0


def assert_kafka_equals_oracle(conf) -> list[tuple]:
    assert_mirror_equals_oracle(conf, TOPICS)
    records = changelog_records(conf, TOPICS)
    assert compacted(records) == changelog_oracle(conf)
    positions = [(topic, key, pos) for topic, key, _v, pos, _p in records]
    assert len(positions) == len(set(positions)), "a change was sent twice"
    return records


def test_mirror_and_changelog_equal_the_oracle_across_restarts(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), compaction=COMPACTION), kafka_bootstrap, kafka_prefix)
    for round_ in range(3):
        append(conf, kv_messages(1200, keys=200, seed=round_, topics=2))
        run(spark, conf)
        records = assert_kafka_equals_oracle(conf)
    assert any(value is None for _t, _k, value, _pos, _p in records), "no tombstone was exercised"
    run(spark, conf)  # nothing new: nothing sent
    assert_kafka_equals_oracle(conf)
    sinks = sink_offsets(conf)
    assert sinks["mirror"] == sinks["tier"] == sinks["kv"] == sinks["changelog"]


def test_transactions_never_reach_kafka_until_committed(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), compaction=COMPACTION), kafka_bootstrap, kafka_prefix)
    append(conf, [Message(topic="t0", body=b"prepared", properties={"KEYS": "a"}, sysflag=0x4),
                  Message(topic="t0", body=b"rolled back", properties={"KEYS": "a"}, sysflag=0xC),
                  Message(topic="t0", body=b"committed", properties={"KEYS": "b"}, sysflag=0x8),
                  Message(topic="t1", body=b"plain", properties={"KEYS": "c"})])
    run(spark, conf)
    records = assert_kafka_equals_oracle(conf)
    assert sorted((t, k, v) for t, k, v, _pos, _p in records) == [("t0", "b", b"committed"), ("t1", "c", b"plain")]


def test_expired_keys_become_tombstones_in_the_changelog(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    import time

    ttl = cfg.CompactionConfig(enabled=True, ttl="t0=10m", snapshot_interval_s=0)
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), compaction=ttl), kafka_bootstrap, kafka_prefix)
    now = int(time.time() * 1000)
    append(conf, kv_messages(600, keys=100, seed=1, store_ts=now - 3_600_000))  # an hour ago
    append(conf, kv_messages(200, keys=100, seed=2))
    run(spark, conf)
    records = changelog_records(conf, TOPICS)
    alive = latest_per_key(conf.commitlog.dir, ttl={"t0": 600.0}, now_ms=int(time.time() * 1000))  # t0=10m
    got = compacted(records)
    assert {k: v for k, v in got.items() if v is not None} == {k: v["body"] for k, v in alive.items()}
    expired = {k for k, v in got.items() if v is None} - {k for k, v in changelog_oracle(conf).items() if v is None}
    assert expired and all(topic == "t0" for topic, _ in expired)  # only t0 has a TTL


@pytest.mark.parametrize("reference_min_bytes", [0, 175], ids=["copies", "half of them references"])
def test_a_changelog_turned_on_later_starts_from_the_view(spark, tmp_path, kafka_bootstrap, kafka_prefix,
                                                          reference_min_bytes):
    """The view's values, copies or read back from the tier where it keeps references (``175``:
    about half of this workload's), fill the new changelog whole."""
    compaction = cfg.CompactionConfig(enabled=True, snapshot_interval_s=0, reference_min_bytes=reference_min_bytes)
    plain = make_conf(tmp_path, str(tmp_path / "tier"), compaction=compaction)
    append(plain, kv_messages(1000, keys=150, seed=5))
    run(spark, plain)  # no Kafka yet
    conf = kafka_conf(plain, kafka_bootstrap, kafka_prefix)
    append(conf, kv_messages(300, keys=150, seed=6))
    run(spark, conf)
    if reference_min_bytes:
        kinds = stored_kinds(conf)
        assert kinds["reference"] > 20 and kinds["copy"] > 20, kinds
    got = compacted(changelog_records(conf, TOPICS))
    expected = changelog_oracle(conf)
    assert {k: v for k, v in got.items() if v is not None} == {k: v for k, v in expected.items() if v is not None}
    assert all(expected[k] is None for k, v in got.items() if v is None)
    assert_mirror_equals_oracle(conf, TOPICS)  # the mirror starts from the log's beginning


@pytest.mark.parametrize("off_for", ["one batch", "many batches"])
def test_a_changelog_on_again_after_a_while_off_sends_the_deletes_and_expiries_it_missed(
        spark, tmp_path, kafka_bootstrap, kafka_prefix, caplog, off_for):
    """Kafka off for a while.  Back on, the changelog replays what it missed from the tier's listed
    batches ("one batch"), or, when they no longer reach back to its last record ("many
    batches"), starts again from the KV view.  Either way, keys deleted meanwhile and keys whose
    time to live passed meanwhile get their tombstones: before, the view's start sent live keys
    only, and neither sent the expiries (an expiry has no message to replay), so the compacted
    topic kept the old values."""
    import dataclasses
    import time

    ttl = dataclasses.replace(COMPACTION, ttl="t0=10m")
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), compaction=COMPACTION), kafka_bootstrap, kafka_prefix)
    hour_ago = int(time.time() * 1000) - 3_600_000
    append(conf, kv_messages(600, keys=60, seed=1, store_ts=hour_ago, delete_ratio=0.0))
    run(spark, conf)
    sent = {k for k, v in compacted(changelog_records(conf, TOPICS)).items() if v is not None}
    assert any(t == "t0" for t, _ in sent) and any(t == "t1" for t, _ in sent)

    off = dataclasses.replace(conf, kafka=cfg.KafkaConfig(), compaction=ttl)  # t0's keys of an hour ago expire
    if off_for == "many batches":  # 600 KB: batches of 200 KB (make_conf), so the feed moves past the changelog
        append(off, [Message(topic="t1", body=b"%d" % i * 100, properties={"KEYS": f"n{i % 200}"}) for i in range(2000)])
    deleted = sorted(k for k in sent if k[0] == "t1")[:10]
    append(off, [Message(topic=t, body=b"", properties={"KEYS": k, "KV_OP": "DELETE"}) for t, k in deleted])
    again = sorted(k for k in sent if k[0] == "t0")[:5]  # put again while off, as old: they expire at once
    append(off, [Message(topic=t, body=b"again", properties={"KEYS": k}, store_ts=hour_ago) for t, k in again])
    fresh = sorted(k for k in sent if k[0] == "t0")[5:15]  # put again while off, live: sent after all
    append(off, [Message(topic=t, body=b"fresh", properties={"KEYS": k}) for t, k in fresh])
    run(spark, off)

    on = dataclasses.replace(conf, compaction=ttl)
    append(on, kv_messages(50, keys=60, seed=2, delete_ratio=0.0))  # some keys come back
    with caplog.at_level("INFO", logger="tierlog.compaction"):
        run(spark, on)
    assert ("starts again from the KV view" in caplog.text) == (off_for == "many batches")
    assert "that expired while it was off" in caplog.text
    got = compacted(changelog_records(on, TOPICS))
    alive = latest_per_key(on.commitlog.dir, ttl={"t0": 600.0}, now_ms=int(time.time() * 1000))
    assert {k: v for k, v in got.items() if v is not None} == {k: v["body"] for k, v in alive.items()}
    assert all(got[k] is None for k in [*deleted, *again] if k not in alive)
    assert all(got[k] is not None for k in fresh)


def test_kafkas_log_cleaner_compacts_the_changelog_to_the_kv_view(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    """The broker's log cleaner really runs (tests/kafka_broker.py: segments roll after 2 s, 1%
    dirty is enough): it removes superseded changes, and what is left is still the latest per key."""
    import time

    from tests.kafka_helpers import iter_topic

    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), compaction=COMPACTION), kafka_bootstrap, kafka_prefix)
    for round_ in range(3):
        append(conf, kv_messages(800, keys=40, seed=round_, topics=2))
        run(spark, conf)
        time.sleep(2.5)  # past log.roll.ms, so the next append rolls the segment and the cleaner may take it
    topic = conf.kafka.changelog_topic.replace("{topic}", "t0")
    deadline = time.monotonic() + 90
    while True:
        offsets: dict[int, list[int]] = {}
        for partition, record in iter_topic(conf.kafka.bootstrap, topic):
            offsets.setdefault(partition, []).append(record.offset)
        cleaned = sum(o[-1] - o[0] + 1 - len(o) for o in offsets.values())  # offsets the cleaner removed
        if cleaned:
            break
        assert time.monotonic() < deadline, "Kafka's log cleaner removed nothing from the changelog"
        append(conf, kv_messages(50, keys=40, seed=99, topics=2))  # an append rolls the aged segment
        run(spark, conf)
        time.sleep(1)
    assert compacted(changelog_records(conf, TOPICS)) == changelog_oracle(conf)


def test_a_consumer_group_reads_the_mirror(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    """Group subscription on a real broker: a consumer group gets its partitions assigned and reads
    every mirrored message once, then commits its offsets.  The mirror runs with its default sender
    slots (one, on these 2 cores) and sends these small batches from the driver; the other tests
    send with two Spark tasks."""
    import time

    from kafka import KafkaConsumer

    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), kafka_bootstrap, kafka_prefix, mirror_tasks=0,
                      mirror_driver_bytes=cfg.KafkaConfig().mirror_driver_bytes)
    append(conf, kv_messages(600, keys=100, seed=7, topics=2))
    run(spark, conf)
    want = {m["phy_offset"] for m in __import__("tests.oracle", fromlist=["replay"]).replay(conf.commitlog.dir)}
    consumer = KafkaConsumer(*(conf.kafka.mirror_topic.replace("{topic}", t) for t in TOPICS),
                             bootstrap_servers=conf.kafka.bootstrap, group_id=f"{kafka_prefix}-readers",
                             auto_offset_reset="earliest", enable_auto_commit=False)
    got: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(got) < len(want):
            assert time.monotonic() < deadline, f"the group read {len(got)} of {len(want)} records"
            for records in consumer.poll(timeout_ms=500).values():
                got += [int(dict(r.headers)["tierlog.phy"]) for r in records]
        assert consumer.assignment(), "the group was never assigned a partition"
        consumer.commit()
        committed = sum(consumer.committed(tp) or 0 for tp in consumer.assignment())
    finally:
        consumer.close()
    assert sorted(got) == sorted(want)
    assert committed == len(want)


def test_the_driver_and_spark_tasks_send_in_turn_exactly_once(spark, tmp_path, kafka_bootstrap, kafka_prefix, caplog):
    """``kafka.mirror_driver_bytes``: with it, the driver sends every step, one larger than it
    included (a step holds at least one tier batch); with 0, two Spark tasks do.  Runs alternate
    the two, positions pass between them, and the topics equal the commitlog's replay record for
    record (no message twice, none missing)."""
    import dataclasses
    import json

    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), compaction=COMPACTION), kafka_bootstrap,
                      kafka_prefix, mirror_driver_bytes=8_000)
    with caplog.at_level("INFO", logger="tierlog.service"):
        for round_, (messages, driver_bytes) in enumerate([(1500, 0), (40, 8_000), (1500, 8_000), (30, 0)]):
            run_conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, mirror_driver_bytes=driver_bytes))
            append(run_conf, kv_messages(messages, keys=150, seed=10 + round_, topics=2))
            run(spark, run_conf)
            assert_kafka_equals_oracle(run_conf)
    sent_by = [json.loads(r.getMessage().split("batch ", 1)[1]).get("sent_by") for r in caplog.records
               if r.getMessage().startswith("batch {") and '"mirror"' in r.getMessage()]
    assert "driver" in sent_by and "spark" in sent_by, sent_by


def test_the_driver_sends_from_a_process_of_its_own_and_one_killed_mid_step_loses_nothing(
        spark, tmp_path, kafka_bootstrap, kafka_prefix, monkeypatch):
    """``kafka.mirror_process``: the driver's mirror steps are sent by a child process.  The child
    is killed at its 300th record (a crash point with the child as the process it kills; a step is
    one tier batch of about 230 records), and again between two steps (a SIGKILL).  Each time the next attempt starts
    a new child, reads the positions back, and the topics equal the commitlog's replay record for
    record: nothing lost, nothing twice.  The sends happened in the children, not here."""
    import os
    import signal

    from state.metadata import MetadataStore
    from streaming.queries.mirror.handler import MirrorHandler
    from streaming.queries.mirror.query import FeedRange, step_end
    from streaming.settings import kafka_settings
    from tests.kafka_helpers import assert_mirror_equals_oracle
    from tests.tiering_helpers import tier_in_batches

    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), kafka_bootstrap, kafka_prefix,
                      mirror_driver_bytes=1)
    append(conf, kv_messages(1500, keys=150, seed=21, topics=2))
    store = MetadataStore(str(tmp_path / "metadata"))
    store.feed.open("mirror", None)
    start = tier_in_batches(conf.commitlog.dir, conf.tier.location, store, 40_000, broker=conf.broker.name)[0]
    monkeypatch.setenv("TIERLOG_FAULT", "kafka_sending:3")
    monkeypatch.setenv("TIERLOG_FAULT_DIR", str(tmp_path))
    monkeypatch.setenv("TIERLOG_DRIVER_PID", "")  # empty: a crash point kills its own process, the child
    reports = []
    handler = MirrorHandler(kafka_settings(conf), conf.tier.location, store, start, driver_bytes=1,
                            process=True, on_batch=reports.append)
    pids = set()
    try:
        while (end := step_end(store.feed, handler.start_at, 0, 1)) > handler.start_at:
            handler.process(FeedRange(len(reports), handler.start_at, end), spark)
            pids.add(handler._sender.pid)
            if len(reports) == 3:
                os.kill(handler._sender.pid, signal.SIGKILL)
                handler._sender._proc.wait(10)  # dead before the next step: started again, not a retry
    finally:
        handler.close()
        store.close()
    assert len(reports) >= 4, [r.sent for r in reports]
    assert all(r.on_driver for r in reports)
    assert sum(r.attempts for r in reports) == len(reports) + 1, ([(r.sent, r.attempts) for r in reports], pids)
    assert len(pids) == 3 and os.getpid() not in pids, pids
    assert (tmp_path / "tierlog-fault-kafka_sending").stat().st_size >= 3
    assert_mirror_equals_oracle(conf, TOPICS)


def test_the_sender_process_raises_the_childs_error_and_ends_on_close(tmp_path):
    """An error the child meets that trying again cannot cure (here a staging object missing from
    the tier) is raised on the driver as a ``TierlogError`` with the child's message and exit
    code, not taken for a dead child and retried for ever; ``close`` ends the child."""
    import os

    from connectors.errors import TierlogError
    from connectors.tier.feed import FeedBatch
    from streaming.queries.mirror.send import SendTask
    from streaming.queries.mirror.sender_process import SenderProcess
    from streaming.settings import kafka_settings

    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), "127.0.0.1:9", "p")
    os.makedirs(conf.tier.location)
    listed = (FeedBatch(0, 100, (("staging/gone.parquet", 10, 0),)),)
    task = SendTask(kafka_settings(conf), conf.tier.location, listed, 0, 100, 1, {}, {})
    sender = SenderProcess()
    try:
        with pytest.raises(TierlogError) as caught:
            sender.send(task)
        assert "staging/gone.parquet" in str(caught.value) and caught.value.exit_code == 1, str(caught.value)
        pid = sender.pid
        assert pid and pid != os.getpid()
    finally:
        sender.close()
    assert not os.path.exists(f"/proc/{pid}")
