"""Several brokers into one tier: one tierlog per broker, writing one tier location (posix and S3)
without coordinating, and readers that answer per broker and across brokers.

The oracle is the writers' own ledger: the messages ``CommitLogWriter.append_many`` stored, with
their positions, per broker.  Every broker's log has the same topics and queue ids, so a tier
that mixed two brokers' queues, or lost a broker's rows, shows up as a difference.
"""

from __future__ import annotations

import dataclasses

import pytest

from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.location import open_backend
from connectors.tier.reader import AmbiguousBrokerError, GetStatus, TierReader
from streaming import config as cfg
from streaming.service import Service
from tests.cli_runner import tierlog, write_config
from tests.oracle import message_row, normalize_arrow_row
from tests.tiering_helpers import FILE, make_conf

BROKERS = ["broker-a", "broker-b", "broker-c"]


def broker_conf(root, location: str, broker: str, compaction: cfg.CompactionConfig | None = None,
                **tier) -> cfg.Config:
    """One broker's deployment: its own commitlog, state and checkpoints, the shared tier."""
    conf = make_conf(root / broker, location, compaction=compaction, **tier)
    return dataclasses.replace(conf, broker=cfg.BrokerConfig(name=broker))


def append(conf: cfg.Config, ledger: dict, n: int, start: int, seed: int) -> None:
    """``n`` messages over topic-0/topic-1, queues 0-2 (the same on every broker), into the
    ledger of what the writer stored."""
    w = Workload(messages=start + n, topics=2, queues=3, keys=40, body_size=200, delete_ratio=0.1, seed=seed)
    with CommitLogWriter(conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
        stored = writer.append_many(list(w.generate(start)))
    ledger.setdefault(conf.broker.name, []).extend(message_row(m, broker=conf.broker.name) for m in stored)


def run(spark, conf: cfg.Config) -> None:
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0


def rows(table) -> list[dict]:
    return sorted((normalize_arrow_row(r) for r in table.to_pylist()), key=lambda r: (r["broker"], r["phy_offset"]))


def test_three_brokers_write_one_tier_and_readers_see_each_and_all(spark, tmp_path, tier_location):
    confs = {b: broker_conf(tmp_path, tier_location, b, segment_messages=40) for b in BROKERS}
    ledger: dict[str, list[dict]] = {}
    for i, b in enumerate(BROKERS):
        append(confs[b], ledger, 300 + 50 * i, 0, seed=i + 1)
    # Interleaved, as independent instances would be: each commits while the others' records exist.
    run(spark, confs["broker-a"])
    run(spark, confs["broker-b"])
    append(confs["broker-a"], ledger, 200, 300, seed=1)
    run(spark, confs["broker-c"])
    run(spark, confs["broker-a"])
    assert len(ledger["broker-a"]) == 500

    everything = sorted((r for b in BROKERS for r in ledger[b]), key=lambda r: (r["broker"], r["phy_offset"]))
    reader = TierReader(tier_location)
    assert reader.brokers() == BROKERS
    assert rows(reader.read_all()) == everything
    for b in BROKERS:
        assert rows(TierReader(tier_location, broker=b).read_all()) == ledger[b]

    # Segments keep the topic first, then the broker; every broker sealed some.
    state = TierReader(tier_location, broker="broker-b").committed()
    assert state.segments and all(n.startswith(f"topic={s.topic}/broker=broker-b/queue={s.queue_id}/")
                                  for n, s in state.segments.items())

    # A queue every broker has is ambiguous without a broker, and each broker's is its own.
    with pytest.raises(AmbiguousBrokerError, match="broker-a, broker-b, broker-c"):
        reader.get("topic-0", 1, 0)
    for b in BROKERS:
        mine = [r for r in ledger[b] if (r["topic"], r["queue_id"]) == ("topic-0", 1)]
        got = TierReader(tier_location, broker=b).get("topic-0", 1, 0, max_messages=10_000)
        assert got.status is GetStatus.FOUND and rows(got.messages) == mine

    infos = {(i.broker, i.topic, i.queue_id): i.commit for i in reader.queue_infos()}
    want: dict = {}
    for r in everything:
        key = (r["broker"], r["topic"], r["queue_id"])
        want[key] = max(want.get(key, 0), r["queue_offset"] + 1)
    assert infos == want

    key = next(r["key"] for r in ledger["broker-c"] if r["key"] and r["topic"] == "topic-1")
    assert rows(reader.by_key("topic-1", key)) == [r for r in everything if r["topic"] == "topic-1" and r["key"] == key]

    # The Spark `tier` source reads every broker, and prunes by broker.
    df = spark.read.format("tier").load(tier_location)
    assert df.count() == len(everything)
    assert df.filter("broker = 'broker-b'").count() == len(ledger["broker-b"])


def test_the_cli_answers_per_broker_and_names_the_brokers_of_an_ambiguous_queue(spark, tmp_path):
    location = str(tmp_path / "tier")
    ledger: dict[str, list[dict]] = {}
    for i, b in enumerate(BROKERS[:2]):
        conf = broker_conf(tmp_path, location, b)
        append(conf, ledger, 90, 0, seed=10 + i)
        run(spark, conf)
    config = write_config(tmp_path, tier={"location": location})
    ambiguous = tierlog("get", "topic-0", "0", "0", "--config", str(config))
    assert ambiguous.returncode == 1 and "broker-a, broker-b" in ambiguous.stderr and "--broker" in ambiguous.stderr
    one = tierlog("get", "topic-0", "0", "0", "--max", "1000", "--broker", "broker-b", "--format", "json",
                  "--config", str(config))
    assert one.returncode == 0, one.stderr
    want = [r for r in ledger["broker-b"] if (r["topic"], r["queue_id"]) == ("topic-0", 0)]
    assert [__import__("json").loads(line)["phy_offset"] for line in one.stdout.splitlines()] == \
        [r["phy_offset"] for r in want]
    queues = tierlog("queues", "--format", "json", "--config", str(config))
    listed = [__import__("json").loads(line) for line in queues.stdout.splitlines()]
    assert {q["broker"] for q in listed} == {"broker-a", "broker-b"} and len(listed) == 12


def test_a_tier_from_before_brokers_is_refused_with_what_to_do_and_upgraded(spark, tmp_path):
    """A tier written before tierlog knew brokers (built here by moving a fresh tier's objects back
    to the old names) is refused by `tierlog run` and by readers, naming `tierlog tier upgrade`;
    after it, the tier holds the same messages under broker-a and `tierlog run` goes on."""
    conf = broker_conf(tmp_path, str(tmp_path / "tier"), "broker-a", segment_messages=50)
    ledger: dict[str, list[dict]] = {}
    append(conf, ledger, 200, 0, seed=3)
    run(spark, conf)
    backend = open_backend(conf.tier.location)
    for info in list(backend.list()):  # the layout before brokers: no broker level anywhere
        old = info.name.replace("broker=broker-a/", "")
        if old != info.name:
            backend.put(old, backend.read(info.name))
            backend.delete(info.name)
    _rewrite_names(backend)
    config = write_config(tmp_path / "broker-a", tier={"location": conf.tier.location},
                          commitlog={"dir": conf.commitlog.dir})
    refused = tierlog("queues", "--config", str(config))
    assert refused.returncode != 0 and "tierlog tier upgrade" in refused.stderr
    upgraded = tierlog("tier", "upgrade", "--format", "json", "--config", str(config))
    assert upgraded.returncode == 0, upgraded.stderr
    assert not [i.name for i in backend.list() if i.name.startswith("topic=") and "/broker=" not in i.name]
    assert rows(TierReader(conf.tier.location).read_all()) == ledger["broker-a"]
    append(conf, ledger, 100, 200, seed=3)
    run(spark, conf)
    assert rows(TierReader(conf.tier.location).read_all()) == ledger["broker-a"]


def _rewrite_names(backend) -> None:
    """Rewrite the moved metadata's object names to the layout before brokers."""
    for info in list(backend.list()):
        if info.name.endswith(".json"):
            text = backend.read(info.name).decode()
            if "broker=broker-a/" in text:
                backend.put(info.name, text.replace("broker=broker-a/", "").encode())


# ---------------------------------------------------------------- one set of Kafka topics


def kafka_ledger_append(conf: cfg.Config, ledger: dict, n: int, seed: int) -> None:
    """Keyed puts and deletes into the writers' ledger: broker-a writes keys 0-59, broker-b
    30-89, so half the keys change on both brokers and half on one only."""
    from tests.kv_helpers import kv_messages

    shift = 30 * BROKERS.index(conf.broker.name)
    messages = list(kv_messages(n, keys=60, seed=seed))
    for m in messages:
        if "KEYS" in m.properties:
            m.properties["KEYS"] = f"k{int(m.properties['KEYS'][1:]) + shift:07d}"
    with CommitLogWriter(conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
        stored = writer.append_many(messages)
    ledger.setdefault(conf.broker.name, []).extend(message_row(m, broker=conf.broker.name) for m in stored)


def assert_kafka_holds_each_broker_once(confs: dict, ledger: dict) -> None:
    """Per Kafka partition, each broker's mirror records are its ledger's, once, in order.  The
    changelog holds only changes a broker made, none twice, and each key's surviving record is its
    sender's latest value of the key (one view per broker, merged by arrival)."""
    from connectors.kafka.sink import broker_of, position_of
    from tests.kafka_helpers import changelog_records, mirror_place, mirror_record, read_topic

    conf = next(iter(confs.values()))
    want: dict = {}
    for b, rows_ in ledger.items():
        for r in rows_:
            want.setdefault((*mirror_place(conf.kafka, r), b), []).append(mirror_record(r))
    got: dict = {}
    for topic in ("t0", "t1"):
        kafka_topic = conf.kafka.mirror_topic.replace("{topic}", topic)
        for p, records in read_topic(conf.kafka.bootstrap, kafka_topic).items():
            for r in records:
                got.setdefault((kafka_topic, p, broker_of(r.headers)), []).append((r.key, r.value, list(r.headers)))
    assert sorted(got) == sorted(want)
    for place in want:
        assert [int(dict(h)["tierlog.phy"]) for _k, _v, h in got[place]] == \
            [int(dict(h)["tierlog.phy"]) for _k, _v, h in want[place]], place
        assert got[place] == want[place], place
    shared = [(t, p) for t, p, b in got if b == "broker-a" and (t, p, "broker-b") in got]
    assert shared, "no partition holds both brokers' records: the per-broker read-back went untested"

    changelog_records(conf, ["t0", "t1"])  # asserts every key is in its default-partitioner partition
    # What each broker's changes are, from its ledger: (topic, key) -> [(position, value)] in order.
    changes: dict = {}
    for b, rows_ in ledger.items():
        for r in rows_:
            if r["key"] is not None:
                value = None if r["properties"].get("KV_OP") == "DELETE" else r["body"]
                changes.setdefault(b, {}).setdefault((r["topic"], r["key"]), []).append((r["phy_offset"], value))
    final: dict = {}
    seen = set()
    for topic in ("t0", "t1"):
        for p, recs in read_topic(conf.kafka.bootstrap, conf.kafka.changelog_topic.replace("{topic}", topic)).items():
            for r in recs:
                b, pos, key = broker_of(r.headers), position_of(r.headers), (topic, r.key.decode())
                assert (b, pos) not in seen, f"{b}'s change at {pos} is in the changelog twice"
                seen.add((b, pos))
                assert (pos, r.value) in changes[b][key], f"{b}: {key} at {pos} is not a change it made"
                final[key] = (b, r.value)
    # Kafka keeps the last record of a key, of whichever broker sent it last (one view per broker,
    # merged by arrival): it is that broker's latest value of the key, never an older one; and a key
    # only one broker ever wrote is that broker's latest.
    for key, (b, value) in final.items():
        assert changes[b][key][-1][1] == value, (key, b)
    for b, keys in changes.items():
        for key, history in keys.items():
            if not any(key in other for o, other in changes.items() if o != b):
                assert final.get(key) == (b, history[-1][1]), (b, key)


@pytest.mark.timeout(1200)
def test_two_brokers_one_set_of_kafka_topics_exactly_once(spark, tmp_path, kafka_bootstrap, kafka_prefix):
    """Two brokers' tierlogs send into the same mirror and changelog topics (2 partitions, so they
    share them), alternately, each resuming after the other wrote last: nothing lost or doubled."""
    from tests.kafka_helpers import kafka_conf

    compaction = cfg.CompactionConfig(snapshot_interval_s=0)
    confs = {b: kafka_conf(broker_conf(tmp_path, str(tmp_path / "tier"), b, compaction), kafka_bootstrap,
                           kafka_prefix, partitions=2) for b in BROKERS[:2]}
    ledger: dict = {}
    for round_ in range(3):
        for i, b in enumerate(confs):
            kafka_ledger_append(confs[b], ledger, 300, seed=10 * round_ + i)
            run(spark, confs[b])
    assert_kafka_holds_each_broker_once(confs, ledger)
    assert rows(TierReader(str(tmp_path / "tier")).read_all()) == sorted(
        (r for b in ledger for r in ledger[b]), key=lambda r: (r["broker"], r["phy_offset"]))


@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_kill_one_brokers_instance_mid_send_while_the_other_runs(tmp_path, kafka_bootstrap, kafka_prefix):
    """broker-b's `tierlog run` keeps running (and its log growing) while broker-a's instance is
    SIGKILLed in the middle of sending to Kafka, twice, and restarted: one tier, one set of
    topics, and nothing lost or doubled in either."""
    import signal
    import subprocess
    import time as time_

    from tests.cli_runner import cli_command, cli_env, run_killed_at, sink_offsets

    tier = str(tmp_path / "tier")
    kafka = {"bootstrap": kafka_bootstrap, "mirror_topic": f"{kafka_prefix}.{{topic}}",
             "changelog_topic": f"{kafka_prefix}.{{topic}}.changelog", "partitions": 2, "linger_ms": 2}
    configs, confs = {}, {}
    for b in BROKERS[:2]:
        (tmp_path / b).mkdir()
        configs[b] = write_config(tmp_path / b, broker={"name": b}, tier={"location": tier, "delete_grace_s": 0},
                                  source={"max_bytes_per_trigger": 60000}, compaction={"snapshot_interval_s": 0},
                                  kafka=kafka)
        confs[b] = cfg.load(str(configs[b]), env={})
    ledger: dict = {}
    kafka_ledger_append(confs["broker-b"], ledger, 500, seed=100)
    other = subprocess.Popen(cli_command("run", "--config", str(configs["broker-b"])), env=cli_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        kills = 0
        for i in range(2):
            kafka_ledger_append(confs["broker-a"], ledger, 1500, seed=200 + i)
            kafka_ledger_append(confs["broker-b"], ledger, 300, seed=300 + i)
            kills += run_killed_at(configs["broker-a"], "kafka_sending", 2, tmp_path / f"fault-{i}")
        assert kills == 2, "broker-a's instance was not killed mid-send"
        final = tierlog("run", "--until-caught-up", "--config", str(configs["broker-a"]))
        assert final.returncode == 0, final.stderr[-3000:]
        end_b = max(r["phy_offset"] + r["size"] for r in ledger["broker-b"])
        deadline = time_.monotonic() + 300
        while min(sink_offsets_safe(confs["broker-b"], sink_offsets).values() or [0]) < end_b:
            assert other.poll() is None, other.stderr.read()[-3000:]
            assert time_.monotonic() < deadline, "broker-b's instance did not catch up"
            time_.sleep(1)
        assert other.poll() is None  # it ran the whole time
    finally:
        other.send_signal(signal.SIGTERM)
        assert other.wait(timeout=120) == 0
    assert_kafka_holds_each_broker_once(confs, ledger)
    assert rows(TierReader(tier).read_all()) == sorted(
        (r for b in ledger for r in ledger[b]), key=lambda r: (r["broker"], r["phy_offset"]))


def sink_offsets_safe(conf, sink_offsets) -> dict:
    """Each sink's applied offset, or nothing while the running instance holds the store."""
    try:
        return sink_offsets(conf)
    except Exception:  # noqa: BLE001 - RocksDB's lock while the service writes; asked again
        return {}


# ---------------------------------------------------------------- failover to a replica


def copy_log(source: str, target: str, cut_at: int | None = None) -> None:
    """A replica of ``source``: the same files, byte for byte; with ``cut_at``, everything from
    that physical offset on is zeros (a replica that has not received it yet)."""
    import os
    import shutil

    shutil.copytree(source, target)
    if cut_at is None:
        return
    for name in sorted(os.listdir(target)):
        if not name.isdigit():
            os.remove(os.path.join(target, name))  # the writer's queue-offset checkpoint: the log decides
            continue
        base, path = int(name), os.path.join(target, name)
        size = os.path.getsize(path)
        if base + size <= cut_at:
            continue
        if base >= cut_at:
            os.remove(path)
            continue
        with open(path, "r+b") as fh:
            fh.seek(cut_at - base)
            fh.write(bytes(size - (cut_at - base)))


@pytest.mark.timeout(1200)
def test_failover_to_a_replica_goes_on_exactly_once_and_a_wrong_one_is_refused(spark, tmp_path, kafka_bootstrap,
                                                                                kafka_prefix):
    from streaming.runtime.failover import ReplicaMismatchError
    from tests.kafka_helpers import kafka_conf

    master = kafka_conf(broker_conf(tmp_path, str(tmp_path / "tier"), "broker-a", segment_messages=50),
                        kafka_bootstrap, kafka_prefix, partitions=2)
    ledger: dict = {}
    append(master, ledger, 400, 0, seed=7)
    run(spark, master)
    seq = TierReader(master.tier.location).committed().seq
    last = TierReader(master.tier.location).committed().last_record
    assert last["phy"] == ledger["broker-a"][-1]["phy_offset"]

    def at(conf: cfg.Config, directory: str) -> cfg.Config:
        return dataclasses.replace(conf, commitlog=dataclasses.replace(conf.commitlog, dir=directory))

    # Behind: the replica has not received the last 50 messages yet.
    behind = str(tmp_path / "behind")
    copy_log(master.commitlog.dir, behind, cut_at=ledger["broker-a"][-50]["phy_offset"])
    with pytest.raises(ReplicaMismatchError, match=f"ends at physical offset {ledger['broker-a'][-50]['phy_offset']}.*behind"):
        run(spark, at(master, behind))
    # A lost tail: it missed the last 50, then took over and wrote messages of its own there.
    lost = str(tmp_path / "lost-tail")
    copy_log(master.commitlog.dir, lost, cut_at=ledger["broker-a"][-50]["phy_offset"])
    append(at(master, lost), {}, 120, 350, seed=99)
    with pytest.raises(ReplicaMismatchError, match=f"other bytes at physical offset {last['phy']}"):
        run(spark, at(master, lost))
    assert TierReader(master.tier.location).committed().seq == seq  # nothing was written

    # A true replica takes over: the same bytes, then messages the new master takes.
    replica = at(master, str(tmp_path / "replica"))
    copy_log(master.commitlog.dir, replica.commitlog.dir)
    append(replica, ledger, 300, 400, seed=7)
    run(spark, replica)
    assert rows(TierReader(master.tier.location).read_all()) == ledger["broker-a"]
    from tests.kafka_helpers import mirror_place, mirror_record, read_topic

    want: dict = {}
    for r in ledger["broker-a"]:
        if r["sysflag"] & 0xC not in (0x4, 0xC):
            want.setdefault(mirror_place(replica.kafka, r), []).append(mirror_record(r))
    got = {}
    for topic in ("topic-0", "topic-1"):
        kafka_topic = replica.kafka.mirror_topic.replace("{topic}", topic)
        for p, records in read_topic(kafka_bootstrap, kafka_topic).items():
            got[(kafka_topic, p)] = [(r.key, r.value, list(r.headers)) for r in records]
    assert got == want
