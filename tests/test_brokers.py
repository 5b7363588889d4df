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
from connectors.tier.backend import open_backend
from connectors.tier.reader import AmbiguousQueueError, GetStatus, TierReader
from streaming import config as cfg
from streaming.service import Service
from tests.cli_runner import tierlog, write_config
from tests.oracle import message_row, normalize_arrow_row
from tests.tiering_helpers import FILE, make_conf

BROKERS = ["broker-a", "broker-b", "broker-c"]


def broker_conf(root, location: str, broker: str, **tier) -> cfg.Config:
    """One broker's deployment: its own commitlog, state and checkpoints, the shared tier."""
    conf = make_conf(root / broker, location, **tier)
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
    state = TierReader(tier_location, broker="broker-b").state()
    assert state.segments and all(n.startswith(f"topic={s.topic}/broker=broker-b/queue={s.queue_id}/")
                                  for n, s in state.segments.items())

    # A queue every broker has is ambiguous without a broker, and each broker's is its own.
    with pytest.raises(AmbiguousQueueError, match="broker-a, broker-b, broker-c"):
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
