"""A commitlog shaped like a real broker's: business topics, delayed and timer messages, transactions,
retries and dead letters, POP revive logs and traces, interleaved as a broker writes them.

The oracle is the writer's own ledger: the messages ``append_many`` returned, each with its
physical and queue offsets, and the class the test gave its topic by hand (not the product's
``topic_class``).  The defaults must tier business and retry messages once each, keep only
business keys in the KV view and the changelog, mirror only business messages, stop nowhere, and
count in ``status`` what each sink left out.
"""

from __future__ import annotations

import dataclasses

import pytest

from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from connectors.errors import TierlogError
from connectors.tier.reader import TierReader
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming.service import Service
from streaming.settings import derive
from tests.cli_runner import sink_offsets
from tests.kafka_helpers import changelog_records, compacted, kafka_conf, mirrored_bodies, read_topic
from tests.kv_helpers import view_contents
from tests.tiering_helpers import make_conf

FILE = 1 << 20
COMPACTION = cfg.CompactionConfig(enabled=True, snapshot_interval_s=0)
BUSINESS = ["orders", "users"]


def broker_log(n: int, seed: int = 0) -> list[tuple[str, Message]]:
    """``n`` rounds of what a broker writes, as (the class the test says, message)."""
    import random

    rng = random.Random(seed)
    out: list[tuple[str, Message]] = []
    delayed: list[Message] = []
    for i in range(n):
        topic = BUSINESS[i % 2]
        key = f"k{rng.randrange(40)}"
        props = {"KEYS": key, "UNIQ_KEY": f"U{i:08d}"}
        if rng.random() < 0.1:
            props["KV_OP"] = "DELETE"
        out.append(("business", Message(topic=topic, queue_id=i % 4, body=b"m%d" % i, properties=props)))
        kind = i % 7
        if kind == 0:  # a delayed message: stored in the schedule topic now, in its real topic when due
            real = Message(topic="orders", queue_id=i % 4, body=b"delayed%d" % i,
                           properties={"KEYS": f"d{i}", "DELAY": "3", "REAL_TOPIC": "orders", "REAL_QID": str(i % 4)})
            out.append(("system", Message(topic="SCHEDULE_TOPIC_XXXX", queue_id=2, body=real.body,
                                          properties=dict(real.properties))))
            delayed.append(real)
        elif kind == 1 and delayed:  # a delayed message comes due
            out.append(("business", delayed.pop(0)))
        elif kind == 2:  # a transaction: the half, then its commit (a COMMIT-typed record) and the op record
            half = {"KEYS": f"tx{i}", "TRAN_MSG": "true", "REAL_TOPIC": "users", "REAL_QID": "1", "PGROUP": "pg"}
            out.append(("system", Message(topic="RMQ_SYS_TRANS_HALF_TOPIC", queue_id=0, body=b"tx%d" % i,
                                          properties=half)))
            out.append(("business", Message(topic="users", queue_id=1, body=b"tx%d" % i,
                                            properties={"KEYS": f"tx{i}"}, sysflag=0x8)))
            out.append(("system", Message(topic="RMQ_SYS_TRANS_OP_HALF_TOPIC", queue_id=0, body=b"%d" % i,
                                          properties={"TAGS": "d"})))
        elif kind == 3:  # a rolled-back half: its op record only; and an old-style PREPARED record
            out.append(("system", Message(topic="RMQ_SYS_TRANS_HALF_TOPIC", queue_id=0, body=b"rb%d" % i,
                                          properties={"KEYS": f"rb{i}", "TRAN_MSG": "true", "REAL_TOPIC": "users"})))
            out.append(("system", Message(topic="RMQ_SYS_TRANS_OP_HALF_TOPIC", queue_id=0, body=b"%d" % i,
                                          properties={"TAGS": "d"})))
            out.append(("business", Message(topic="orders", queue_id=0, body=b"prepared%d" % i,
                                            properties={"KEYS": "never"}, sysflag=0x4)))
        elif kind == 4:  # a consumer failed a message: its retry, and now and then a dead letter
            out.append(("retry", Message(topic="%RETRY%group-1", queue_id=0, body=b"m%d" % i,
                                         properties={"KEYS": key, "RETRY_TOPIC": topic}, reconsume_times=1)))
            if i % 3 == 0:
                out.append(("retry", Message(topic="%DLQ%group-1", queue_id=0, body=b"m%d" % i,
                                             properties={"KEYS": key})))
        elif kind == 5:  # POP revive log, a trace, a timer message
            out.append(("system", Message(topic="rmq_sys_REVIVE_LOG_DefaultCluster", queue_id=i % 2, body=b"{}")))
            out.append(("system", Message(topic="RMQ_SYS_TRACE_TOPIC", queue_id=0, body=b"trace")))
            out.append(("system", Message(topic="rmq_sys_wheel_timer", queue_id=0, body=b"t%d" % i,
                                          properties={"KEYS": f"w{i}", "TIMER_OUT_MS": "1000"})))
    return out


def write(conf, entries) -> list[tuple[str, Message]]:
    """Append ``entries``; the ledger: (class, the stored message with its offsets)."""
    with CommitLogWriter(conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
        stored = writer.append_many([m for _, m in entries])
    return [(cls, m) for (cls, _), m in zip(entries, stored)]


def entered(m: Message) -> bool:
    return m.sysflag & 0xC in (0x0, 0x8)


def run(spark, conf) -> None:
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0


@pytest.mark.timeout(600)
def test_a_broker_log_is_tiered_viewed_and_mirrored_by_topic_class(spark, tmp_path, tier_location, kafka_bootstrap,
                                                                  kafka_prefix):
    conf = kafka_conf(make_conf(tmp_path, tier_location, compaction=COMPACTION, segment_messages=50), kafka_bootstrap,
                      kafka_prefix)
    ledger = write(conf, broker_log(300))
    assert {c for c, _ in ledger} == {"business", "retry", "system"}
    run(spark, conf)
    ledger += write(conf, broker_log(150, seed=1))
    ledger += write(conf, [("system", Message(topic="RMQ_SYS_TRACE_TOPIC", body=b"last"))])  # no sink takes it
    run(spark, conf)
    # A message no sink takes still moves every sink's applied offset: nothing waits on it.
    end = ledger[-1][1].phy_offset + ledger[-1][1].size
    sinks = sink_offsets(conf)
    assert sinks["tier"] == sinks["kv"] == sinks["mirror"] == sinks["changelog"] == end, sinks

    # The tier: business and retry messages that entered a queue, each exactly once.
    tiered = TierReader(conf.tier.location).read_all().to_pylist()
    got = sorted((r["phy_offset"], r["topic"], r["queue_id"], r["queue_offset"], r["body"]) for r in tiered)
    want = sorted((m.phy_offset, m.topic, m.queue_id, m.queue_offset, m.body) for c, m in ledger
                  if c in ("business", "retry") and entered(m))
    assert got == want

    # The KV view: the latest change of each key of the business topics.
    latest: dict = {}
    for c, m in ledger:
        if c == "business" and entered(m) and m.properties.get("KEYS"):
            latest[(m.topic, m.properties["KEYS"])] = m
    live = {k: m.body for k, m in latest.items() if m.properties.get("KV_OP") != "DELETE"}
    assert {k: v["body"] for k, v in view_contents(conf).items()} == live
    # The changelog, read as a compacted topic: the same, deletes as tombstones.
    changes = changelog_records(conf, BUSINESS)
    assert compacted(changes) == {k: live.get(k) for k in latest}
    assert not read_topic(conf.kafka.bootstrap, f"{kafka_prefix}._RETRY_group-1.changelog", timeout_s=5)

    # The mirror: each business message once; no retry or system topic reached Kafka.
    assert mirrored_bodies(conf, BUSINESS) == {m.phy_offset: m.body for c, m in ledger if c == "business" and entered(m)}
    for name in ("%RETRY%group-1", "_RETRY_group-1", "SCHEDULE_TOPIC_XXXX"):
        assert not read_topic(conf.kafka.bootstrap, f"{kafka_prefix}.{name}", timeout_s=5)

    # status: what each sink left out, by class.
    store = MetadataStore(derive(conf).paths.metadata, read_only=True)
    try:
        filtered = store.filtered()
    finally:
        store.close()
    count = lambda cls: sum(1 for c, m in ledger if c == cls and entered(m))  # noqa: E731
    assert filtered == {"tier": {"system": count("system")},
                        "compaction": {"system": count("system"), "retry": count("retry")},
                        "mirror": {"system": count("system"), "retry": count("retry")}}


@pytest.mark.timeout(600)
def test_a_filter_changed_between_runs_applies_from_then_on(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), kafka_bootstrap, kafka_prefix)
    before = write(conf, broker_log(60))
    run(spark, conf)
    conf = dataclasses.replace(conf, topics=cfg.TopicsConfig(mirror="business,retry", tier_exclude="users",
                                                             mirror_exclude="users", compaction_exclude="users"))
    # (within the tier's: compaction and the mirror read the tier)
    after = write(conf, broker_log(60, seed=2))
    run(spark, conf)
    retried = {int(dict(r.headers)["tierlog.phy"]) for records in
               read_topic(conf.kafka.bootstrap, f"{kafka_prefix}._RETRY_group-1").values() for r in records}
    assert retried == {m.phy_offset for c, m in after if m.topic == "%RETRY%group-1"}  # sanitized, from then on
    users = [r for r in TierReader(conf.tier.location).read_all().to_pylist() if r["topic"] == "users"]
    assert sorted(r["phy_offset"] for r in users) == sorted(
        m.phy_offset for c, m in before if m.topic == "users" and entered(m))


def test_two_topics_on_one_kafka_name_stop_the_mirror_naming_both(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), kafka_bootstrap, kafka_prefix,
                      mirror_topic="{topic}", changelog_topic=f"{kafka_prefix}.{{topic}}.changelog")
    conf = dataclasses.replace(conf, topics=cfg.TopicsConfig(mirror="business,retry"))
    retry, plain = f"%RETRY%{kafka_prefix}", f"_RETRY_{kafka_prefix}"
    write(conf, [("retry", Message(topic=retry, body=b"a")), ("business", Message(topic=plain, body=b"b"))])
    with pytest.raises(TierlogError) as caught:
        Service(conf).run(until_caught_up=True, spark=spark)
    text = str(caught.value)
    assert repr(retry) in text and repr(plain) in text and "kafka.mirror_topic_map" in text
    assert not read_topic(conf.kafka.bootstrap, plain, timeout_s=5)


# Every sysflag bit the format defines, in combination: compression flag and type (bits 0, 8-10),
# multi-tags (1), transaction type (2-3), IPv6 hosts (4-5), NEED_UNWRAP (6) and INNER_BATCH (7).
SYSFLAGS = sorted({c | t | tx | h | b for c in (0, 0x1) for t in (0, 0x100, 0x200, 0x300) for tx in (0, 0x4, 0x8, 0xC)
                   for h in (0, 0x10, 0x20, 0x30) for b in (0, 0x2, 0x40, 0x80, 0xC2)})


def test_every_sysflag_combination_decodes_the_same_on_both_paths_and_enters_a_queue_by_its_tx_type(tmp_path):
    """An INNER_BATCH record is one row: its body is the encoded inner batch, as stored; its queue
    offset is the first of the batch.  Both decoders agree, and only NOT_TYPE and COMMIT enter a queue."""
    from connectors.commitlog.arrow import dispatched_mask
    from connectors.commitlog.compression import compress
    from connectors.commitlog.reader import CommitLogReader

    messages = []
    for i, flag in enumerate(SYSFLAGS):
        v6 = {"born_host": "[::1]:1234" if flag & 0x10 else "127.0.0.1:1234",
              "store_host": "[::2]:10911" if flag & 0x20 else "127.0.0.1:10911"}
        props = {"KEYS": f"k{i}"} | ({"INNER_NUM": "3", "INNER_BASE": "0"} if flag & 0x80 else {})
        body = b"b%d" % i
        if flag & 0x1:  # stored as the Java client stores it: compressed by the codec bits 8-10 name
            body = compress(body, {0: "zlib", 0x100: "lz4", 0x200: "zstd", 0x300: "zlib"}[flag & 0x700])
        messages.append(Message(topic=f"t{i % 3}", queue_id=i % 2, body=body, properties=props, sysflag=flag, **v6))
    with CommitLogWriter(str(tmp_path), file_size=FILE, fsync="never") as writer:
        stored = writer.append_many(messages)
    with CommitLogReader(str(tmp_path)) as reader:
        decoded = list(reader.messages(0))
        table = __import__("pyarrow").Table.from_batches(list(reader.record_batches(0, reader.end_offset())))
    # Read as a consumer's client reads: the body inflated and the compressed flag cleared.
    expected = [(m.phy_offset, m.sysflag & ~0x1, b"b%d" % i, m.topic) for i, m in enumerate(stored)]
    assert [(m.phy_offset, m.sysflag, m.body, m.topic) for m in decoded] == expected
    assert table["sysflag"].to_pylist() == [e[1] for e in expected]
    assert table["body"].to_pylist() == [e[2] for e in expected]
    assert table["born_host"].to_pylist() == [m.born_host for m in decoded]
    assert dispatched_mask(table["sysflag"]).to_pylist() == [m.sysflag & 0xC in (0, 0x8) for m in stored]


def test_inspect_summary_says_per_topic_its_class_counts_and_which_sinks_take_it(tmp_path):
    import json

    from tests.cli_runner import tierlog, write_config

    config = write_config(tmp_path, topics={"mirror": "business,retry", "tier_exclude": "users",
                                            "compaction_exclude": "users"})
    conf = cfg.load(str(config), env={})
    ledger = write(conf, broker_log(80))
    result = tierlog("inspect", "--summary", "--format", "json", "--config", str(config))
    assert result.returncode == 0, result.stderr
    rows = {r["topic"]: r for r in map(json.loads, result.stdout.splitlines())}
    for topic in {m.topic for _, m in ledger}:
        mine = [(c, m) for c, m in ledger if m.topic == topic]
        cls = mine[0][0]
        assert rows[topic]["class"] == cls, topic
        assert rows[topic]["messages"] == sum(1 for _, m in mine if entered(m))
        assert rows[topic]["not_dispatched"] == sum(1 for _, m in mine if not entered(m))
        assert rows[topic]["bytes"] == sum(m.size for _, m in mine)
        assert rows[topic]["tier"] == ("yes" if cls != "system" and topic != "users" else "no")
        assert rows[topic]["compaction"] == ("yes" if cls == "business" and topic != "users" else "no")
        assert rows[topic]["mirror"] == ("yes" if cls != "system" else "no")
