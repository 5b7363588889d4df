"""tierlog on a real Apache RocketMQ broker's ``store/commitlog``, while the broker runs.

RocketMQ's own Java client sends normal, keyed, batch, delayed (delay level and RocketMQ 5 timer),
transactional (commit and rollback) and large (compressed) messages, and a consumer group fails
some so the broker makes ``%RETRY%`` and ``%DLQ%`` topics.  The broker is killed and restarted
in between, and its 1 MiB files roll.  Two oracles, neither of them tierlog's reader:

* the sender's ledger: each message the broker acknowledged, with its queue and queue offset;
* the broker's own view: every message it serves, read back through its consume path.

The tier must hold exactly the broker's business and retry messages with every field; the KV
view and the changelog the latest of each business key; the mirror each business message once.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import socket
import threading
import time

import pytest

from connectors.tier.reader import TierReader
from streaming import config as cfg
from streaming.service import Service
from tests.kafka_helpers import changelog_records, compacted, kafka_conf, mirrored_bodies
from tests.kv_helpers import view_contents
from tests.rocketmq import Broker, Client, NameServer
from tests.tiering_helpers import make_conf

pytestmark = pytest.mark.timeout(900)

BUSINESS = {"orders": 4, "payments": 3}
GROUP = "tierlog-it"
RETRY = [f"%RETRY%{GROUP}", f"%DLQ%{GROUP}"]
# Fields of the broker's view that are the consumer client's own, not the stored message's.
CLIENT_PROPERTIES = {"MIN_OFFSET", "MAX_OFFSET"}


@pytest.fixture(scope="module")
def rocketmq(tmp_path_factory):
    root = tmp_path_factory.mktemp("rocketmq")
    namesrv = NameServer(root / "namesrv").start()
    broker = Broker(root, namesrv)
    try:
        broker.start()
        client = Client(namesrv, root / "client")
        # The retry and dead-letter topics exist up front, so the failing consumer routes them at once.
        client.create_topics(broker, {**BUSINESS, RETRY[0]: 1, RETRY[1]: 1})
        yield broker, client
    finally:
        broker.stop(kill=True)
        namesrv.stop()


def run(spark, conf) -> None:
    assert Service(conf).run(until_caught_up=True, spark=spark) == 0


def broker_view(client: Client, ledger: list[dict]) -> list[dict]:
    """The broker's messages of every tiered topic, once every acknowledged one is served (delayed
    and timer messages reach their topic later) and two reads agree (retries have settled)."""
    wanted = {e["msg_id"] for e in ledger if e["kind"] != "tx_rollback"}
    deadline = time.monotonic() + 120
    previous = None
    while True:
        rows = client.read(*BUSINESS, *RETRY)
        served = {r["msg_id"] for r in rows if r["topic"] in BUSINESS}
        if wanted <= served and previous is not None and len(rows) == len(previous):
            return rows
        assert time.monotonic() < deadline, f"the broker never served {sorted(wanted - served)[:5]}"
        previous = rows
        time.sleep(1)


def stored(row: dict) -> tuple:
    """One message as both sides can say it: the broker's view row, or a tier row."""
    props = row["properties"]
    props = {k: v for k, v in (props.items() if isinstance(props, dict) else props) if k not in CLIENT_PROPERTIES}
    body = base64.b64decode(row["body"]) if isinstance(row["body"], str) else bytes(row["body"])
    ts = [row[c] if isinstance(row[c], int) else round(row[c].timestamp() * 1000) for c in ("born_ts", "store_ts")]
    return (row["topic"], row["queue_id"], row["queue_offset"], row["phy_offset"], row["msg_id"], row["key"],
            row["tags"], body, *ts, row["sysflag"], row["reconsume_times"], tuple(sorted(props.items())))


def test_the_tier_kv_view_and_mirror_equal_what_the_broker_serves(rocketmq, spark, tmp_path, kafka_bootstrap,
                                                                   kafka_prefix):
    broker, client = rocketmq
    conf = kafka_conf(make_conf(tmp_path, str(tmp_path / "tier"), segment_messages=40,
                                compaction=cfg.CompactionConfig(enabled=True, snapshot_interval_s=0)),
                      kafka_bootstrap, kafka_prefix)
    conf = dataclasses.replace(conf, commitlog=dataclasses.replace(conf.commitlog, dir=broker.commitlog))

    ledger = client.send(seed=1, topics=list(BUSINESS), messages=300, batches=3, delayed=3, large=2, transactions=6)
    # The consumer group fails messages while tierlog reads the log the broker is appending to.
    failures: list = []
    consumer = threading.Thread(target=lambda: failures.append(client.fail(GROUP, "orders", 4, max_reconsume=1)))
    consumer.start()
    run(spark, conf)
    consumer.join()
    assert failures and len(failures[0]) == 8, "the consumer group did not fail 4 messages twice each"

    broker.stop(kill=True)  # a crash: the broker recovers its log on start
    broker.start()
    ledger += client.send(seed=2, topics=list(BUSINESS), messages=200, large=2, transactions=2)
    view = broker_view(client, ledger)
    run(spark, conf)

    # The broker rolled its 1 MiB files, and made the retry and DLQ topics.
    # (Whether a third, pre-allocated file exists yet is the broker's timing: the second file
    # holding a record is what shows the roll.)
    with open(os.path.join(broker.commitlog, f"{1 << 20:020d}"), "rb") as second:
        assert any(second.read(8)), "the broker wrote nothing past its first 1 MiB file"
    assert {r["topic"] for r in view} == {*BUSINESS, *RETRY}

    # The tier equals the broker's view, field by field, and holds nothing else.
    tiered = TierReader(conf.tier.location).read_all().to_pylist()
    assert sorted(map(stored, tiered)) == sorted(map(stored, view))

    # The sender's ledger: every acknowledged message where the broker said it put it, with its body.
    by_place = {(r["topic"], r["queue_id"], r["queue_offset"]): r for r in tiered}
    by_id = {r["msg_id"]: r for r in tiered}
    for e in ledger:
        if "queue_offset" in e:
            row = by_place[(e["topic"], e["queue_id"], e["queue_offset"])]
            assert (row["msg_id"], row["key"], hashlib.sha256(row["body"]).hexdigest()) == \
                (e["msg_id"], e["key"], e["body_sha256"]), e
        elif e["kind"] == "tx_rollback":
            assert e["msg_id"] not in by_id, e
        else:  # delayed, timer and committed transactional messages: in their topic, by id
            assert hashlib.sha256(by_id[e["msg_id"]]["body"]).hexdigest() == e["body_sha256"], e
    kinds = {e["kind"] for e in ledger}
    assert kinds == {"normal", "batch", "delay_level", "timer", "large", "tx_commit", "tx_rollback"}

    # The KV view and the changelog: the latest message of each business key, by physical order.
    latest = {}
    for r in sorted(view, key=lambda r: r["phy_offset"]):
        if r["topic"] in BUSINESS and r["key"]:
            latest[(r["topic"], r["key"])] = base64.b64decode(r["body"])
    assert {k: v["body"] for k, v in view_contents(conf).items()} == latest
    assert compacted(changelog_records(conf, list(BUSINESS))) == latest

    # The mirror: each business message once, its body as the producer sent it.
    assert mirrored_bodies(conf, BUSINESS) == {r["phy_offset"]: base64.b64decode(r["body"]) for r in view if r["topic"] in BUSINESS}


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """A master and its replica (classic async replication) of one broker, on loopback."""
    root = tmp_path_factory.mktemp("rocketmq-ha")
    namesrv = NameServer(root / "namesrv").start()
    master, replica = Broker(root, namesrv), Broker(root, namesrv, broker_id=1)
    try:
        master.start()
        replica.start()
        client = Client(namesrv, root / "client")
        client.create_topics(master, BUSINESS)
        yield master, replica, client
    finally:
        for broker in (replica, master):
            broker.stop(kill=True)
        namesrv.stop()


def log_end(directory: str) -> int:
    from connectors.commitlog.reader import CommitLogReader

    with CommitLogReader(directory) as reader:
        return reader.end_offset()


def test_a_replica_the_broker_replicated_holds_the_same_log_and_tiers_the_same(replicated, spark, tmp_path):
    """The commitlog a RocketMQ replica copied from its master (HA replication, not our copy) is
    byte-identical up to the master's end, and tierlog reads the same tier from either.  This is
    the ground a failover to the replica stands on."""
    master, replica, client = replicated

    def replica_reaches_master() -> int:
        end = log_end(master.commitlog)
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(replica.commitlog, "0" * 20)) or log_end(replica.commitlog) < end:
            assert time.monotonic() < deadline, f"the replica did not reach the master's end {end}"
            time.sleep(0.2)
        return end

    # A replica that connects late copies from the start of the master's last file only (RocketMQ's
    # HAConnection), so it joins on a first message, before the log has rolled.
    ledger = client.send(seed=3, topics=["orders"], messages=1)
    replica_reaches_master()
    ledger += client.send(seed=4, topics=list(BUSINESS), messages=300, batches=2, large=4, transactions=2)
    end = replica_reaches_master()
    assert end > 1 << 20  # across a file roll

    for name in sorted(f for f in os.listdir(master.commitlog) if f.isdigit() and int(f) < end):
        upto = min(end - int(name), 1 << 20)
        with open(os.path.join(master.commitlog, name), "rb") as a, open(os.path.join(replica.commitlog, name), "rb") as b:
            assert a.read(upto) == b.read(upto), f"{name} differs between master and replica"

    tiers, confs = [], {}
    for side, directory in (("master", master.commitlog), ("replica", replica.commitlog)):
        conf = confs[side] = make_conf(tmp_path / side, str(tmp_path / side / "tier"), segment_messages=50)
        conf = confs[side] = dataclasses.replace(conf, commitlog=dataclasses.replace(conf.commitlog, dir=directory))
        run(spark, conf)
        rows = TierReader(conf.tier.location).read_all().to_pylist()
        tiers.append(sorted(map(stored, [r for r in rows if r["phy_offset"] < end])))
    assert tiers[0] == tiers[1]
    assert len(tiers[0]) == sum(1 for e in ledger if e["kind"] != "tx_rollback")

    # Failover: the master takes more messages, its replica copies them, the master dies; the
    # tierlog that tiered the master's log goes on from the replica's, with the same checkpoints.
    ledger += client.send(seed=5, topics=list(BUSINESS), messages=200)
    end = replica_reaches_master()
    master.stop(kill=True)
    failover = dataclasses.replace(confs["master"], commitlog=dataclasses.replace(confs["master"].commitlog,
                                                                                  dir=replica.commitlog))
    run(spark, failover)
    rows = TierReader(failover.tier.location).read_all().to_pylist()
    assert max(r["phy_offset"] for r in rows) < end
    acknowledged = {e["msg_id"] for e in ledger if e["kind"] != "tx_rollback"}
    tiered = [r["msg_id"] for r in rows]
    assert len(tiered) == len(set(tiered)) and set(tiered) == acknowledged  # each once, none missing


def test_a_name_server_whose_port_was_taken_before_it_bound_starts_on_another(tmp_path):
    """The fixtures pick free ports, then the JVM binds them; another process can take one in
    between (CI lost a replica's HA port so).  The JVM's "Address already in use" makes the fixture
    pick again instead of failing the test's setup."""
    namesrv = NameServer(tmp_path / "namesrv")
    taken = namesrv.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # bound, not listening: as an outgoing connection's source port
        namesrv.start()
        try:
            assert namesrv.port != taken
            assert f"listenPort={namesrv.port}" in (tmp_path / "namesrv" / "namesrv.conf").read_text()
            assert "Address already in use" in namesrv.jvm.log.read_text(errors="replace")
        finally:
            namesrv.stop()
