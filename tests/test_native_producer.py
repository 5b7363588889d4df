"""The native producer (librdkafka through ctypes, ``connectors.kafka.native_producer``) against a
real Apache Kafka: the records it sends from ``Records``' Arrow buffers, read back, equal record
for record what kafka-python sends of the same rows as Python objects (``Records.python_rows``),
on the shapes where an address or a size could go wrong; and its reports, queue and discard
behave as the binding's producer's do."""

from __future__ import annotations

import random
import time

import numpy as np
import pyarrow as pa
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from connectors.kafka import native
from connectors.kafka.columns import Records, constant, digits
from connectors.kafka.embedded import free_port
from connectors.kafka.errors import KafkaSinkError
from connectors.kafka.native_producer import CHUNK_ROWS, NativeProducer
from connectors.kafka.kafka_python import KafkaPythonProducer
from connectors.kafka.producers import open_producer
from connectors.kafka.settings import KafkaSettings
from tests.kafka_helpers import poll_partitions, read_with_librdkafka

# No skip: confluent-kafka is a dependency, so a wheel whose librdkafka moved, or changed its
# version or layout, fails here (test_the_library_the_binding_loaded_is_found_and_passes_its_self_test)
# rather than leaving the path untested while the service quietly falls back to the binding.

PARTITIONS = 3


def make_topic(bootstrap: str, name: str, partitions: int = PARTITIONS) -> str:
    """Topic ``name``, once the broker names a leader of each of its partitions: as the service's
    topics are made before any record is sent to them."""
    import confluent_kafka.admin

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, partitions, 1)])
    admin.close()
    lister = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 60
    while True:
        topic = lister.list_topics(name, timeout=10).topics.get(name)
        if topic is not None and topic.error is None and len(topic.partitions) == partitions and \
                all(p.leader >= 0 and p.error is None for p in topic.partitions.values()):
            return name
        assert time.monotonic() < deadline, f"topic {name}: no leader of every partition in 60 s"
        time.sleep(0.1)


def varied_records(topics: tuple[str, ...], n: int, seed: int) -> Records:
    """Rows of every shape a sink hands over: null, empty and long keys and values (never both
    null, which Kafka refuses), null and empty property maps, names outside ASCII, values in
    several chunks taken out of order (``value_rows``), a sliced key column, and
    dictionary-encoded headers."""
    rng = random.Random(seed)

    def blob(i: int):
        kind = i % 7
        return (b"x" if i % 5 == 0 else None) if kind == 0 else b"" if kind == 1 else bytes(rng.randrange(256) for _ in range(rng.choice([1, 9, 300, 5000])))

    keys = pa.array([None if i % 5 == 0 else "" if i % 5 == 1 else f"key-{i}-ü" for i in range(-3, n)]).slice(3)
    values = [blob(i) for i in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    chunked = pa.chunked_array([pa.array(values[:n // 3], pa.binary()), pa.array([], pa.binary()),
                                pa.array(values[n // 3:], pa.binary())])
    stored = pa.chunked_array([chunked.take(pa.array(order))])  # the bodies as read, out of order
    value_rows = np.argsort(order)  # row i's value is stored at value_rows[i]
    maps = [None if i % 6 == 0 else [] if i % 6 == 1 else
            [("KEYS", f"k{i}"), ("UNIQ_KEY", "7F00%012d" % i), ("TAGS", "" if i % 4 == 0 else "t"), ("ñame", "v")]
            for i in range(n)]
    return Records(
        topics=topics, topic=np.array([i % len(topics) for i in range(n)], np.int64),
        partition=np.array([i % PARTITIONS for i in range(n)], np.int64), key=keys, value=stored,
        value_rows=value_rows, timestamp=np.array([1764633600000 + i for i in range(n)], np.int64),
        position=np.arange(n, dtype=np.int64) * 100,
        pairs=pa.array(maps, pa.map_(pa.string(), pa.string())),
        headers=(("tierlog.phy", digits(pa.array(np.arange(n) * 100))), ("tierlog.broker", constant(b"broker-a", n)),
                 ("tierlog.op", pa.DictionaryArray.from_arrays(pa.array(np.arange(n, dtype=np.int32) % 2),
                                                             pa.array([b"put", b"delete"]))),
                 ("empty", pa.array([b""] * n, pa.binary()))))


def sent(bootstrap: str, topics, expected: int, partitions: int = PARTITIONS) -> list[tuple]:
    """Every record of ``topics`` (of ``partitions`` each), partition by partition, as kafka-python
    gives a record: at least the ``expected`` records sent, then on to the end offsets the broker
    lists, so none sent twice is missed.  Read by librdkafka, not kafka-python, whose consumer read
    none of 3,996 acknowledged records in 120 s in a loaded run, even replaced every 15 s
    (``tests.test_kafka_python_acks`` shows the records were there)."""
    got = read_with_librdkafka(bootstrap, [(t, p) for t in topics for p in range(partitions)], expected)
    return [(topics.index(t), p, m.key(), m.value(), [(k, v) for k, v in (m.headers() or [])], m.timestamp()[1])
            for (t, p), records in got.items() for m in records]


def read_with_kafka_python(bootstrap: str, topics, expected: int, partitions: int = PARTITIONS) -> list[tuple]:
    """``sent``, read by kafka-python through ``poll_partitions`` (whose stalled consumers it
    replaces): the partitions are assigned by number, and the end offsets asked only once records
    arrive: a consumer new to a topic just made may not learn its partitions in time, and its first
    end offsets may be none."""
    tps = [TopicPartition(topic, p) for topic in topics for p in range(partitions)]
    got: dict = {tp: [] for tp in tps}
    ends: dict = {}

    def more(consumer: KafkaConsumer) -> bool:
        if sum(map(len, got.values())) < expected:
            return True
        if not ends:
            ends.update(consumer.end_offsets(tps))
        return any(consumer.position(tp) < ends[tp] for tp in tps)

    def what() -> str:
        return f"the {expected} records sent (read {sum(map(len, got.values()))})"

    for tp, record in poll_partitions(bootstrap, tps, more, 120, what):
        got[tp].append(record)
    return [(topics.index(tp.topic), tp.partition, r.key, r.value, list(r.headers), r.timestamp)
            for tp in tps for r in got[tp]]


def test_a_read_back_whose_consumer_stops_fetching_is_taken_over(kafka_bootstrap, kafka_prefix, monkeypatch):
    """The fault a loaded CI run met: a kafka-python consumer returned nothing more of partitions
    it was assigned. Injected: the first consumer returns 5 records, then nothing; a new one must
    read the rest from where it stopped, none twice."""
    import tests.kafka_helpers as helpers
    from kafka import KafkaProducer

    topic = make_topic(kafka_bootstrap, f"{kafka_prefix}-stall")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for i in range(60):
        producer.send(topic, value=b"%d" % i, partition=i % PARTITIONS)
    producer.flush()
    producer.close()
    monkeypatch.setattr(helpers, "STALL_S", 1.0)
    consumers: list = []
    poll = KafkaConsumer.poll

    given: list = []

    def stalls_after_five(self, *args, **kwargs):
        if self not in consumers:
            consumers.append(self)
        got = poll(self, *args, **kwargs)
        if self is not consumers[0]:
            return got
        out = {}
        for tp, records in got.items():
            if len(given) < 5:
                out[tp] = records[:5 - len(given)]
                given.extend(out[tp])
        return out

    monkeypatch.setattr(KafkaConsumer, "poll", stalls_after_five)
    records = read_with_kafka_python(kafka_bootstrap, (topic,), 60)
    assert len(consumers) >= 2
    assert sorted(int(r[3]) for r in records) == list(range(60))


def test_records_sent_from_arrow_buffers_equal_those_sent_as_python_objects(kafka_bootstrap, kafka_prefix):
    settings = KafkaSettings(client={"bootstrap_servers": kafka_bootstrap})
    n = CHUNK_ROWS + 300  # two chunks of arguments
    got = {}
    for name, cls in (("native", NativeProducer), ("python", KafkaPythonProducer)):
        topics = tuple(make_topic(kafka_bootstrap, f"{kafka_prefix}-{name}-{t}") for t in range(2))
        records = varied_records(topics, n, seed=5)
        producer = cls(settings) if cls is KafkaPythonProducer else cls(settings, native.library())
        rows = np.flatnonzero(np.arange(n) % 11 != 3)  # rows skipped, as read-back positions do
        done, too_large = producer.send_records(records, rows)
        assert (done, too_large) == (len(rows), None)
        assert producer.flush(60) and producer.failure() is None
        producer.close(5)
        got[name] = sent(kafka_bootstrap, topics, len(rows))
    assert len(got["native"]) == len(rows)
    assert got["native"] == got["python"]
    nulls = [r for r in got["native"] if r[2] is None]
    empties = [r for r in got["native"] if r[2] == b""]
    tombstones = [r for r in got["native"] if r[3] is None]
    assert nulls and empties and tombstones  # each shape was sent, not left out of both


def test_a_record_over_the_size_limit_is_counted_out_and_named(kafka_bootstrap, kafka_prefix):
    """``send_records`` stops before a record librdkafka refuses as too large and says why; the
    caller sends the rest from the next one (``KafkaSink.send_records``)."""
    settings = KafkaSettings(client={"bootstrap_servers": kafka_bootstrap}, max_request_size=8192)
    topic = make_topic(kafka_bootstrap, f"{kafka_prefix}-large", 1)
    values = pa.array([b"a", b"b", b"x" * 20000, b"c"], pa.binary())
    records = Records(topics=(topic,), topic=np.zeros(4, np.int64), partition=np.zeros(4, np.int64),
                      key=pa.nulls(4, pa.binary()), value=values, timestamp=np.zeros(4, np.int64),
                      position=np.arange(4, dtype=np.int64))
    producer = NativeProducer(settings, native.library())
    done, why = producer.send_records(records, np.arange(4))
    assert done == 2 and "MSG_SIZE_TOO_LARGE" in why
    assert producer.send_records(records, np.array([3])) == (1, None)
    assert producer.flush(30) and producer.failure() is None
    producer.close(5)
    assert [r[3] for r in sent(kafka_bootstrap, (topic,), 3, partitions=1)] == [b"a", b"b", b"c"]


def test_with_no_broker_records_wait_until_purged_then_each_is_reported_with_where_it_went():
    """As the binding's producer: no timeout of its own, so nothing leaves the queue; ``flush(leave=)``
    returns at once while enough may stay; a purge fails every record, each reported (only
    failures are) with its topic and partition; ``discard`` ignores those reports."""
    settings = KafkaSettings(client={"bootstrap_servers": f"127.0.0.1:{free_port()}"}, delivery_timeout_s=2.0)
    producer = NativeProducer(settings, native.library())
    reports = []
    producer._handle.on_report = lambda code, topic, partition: reports.append((topic, partition))
    for position in range(40):
        producer.send(f"t{position % 2}", position % 3, b"k", b"v", [("h", b"1")], None, position)
    started = time.monotonic()
    assert producer.flush(5, leave=40) and time.monotonic() - started < 1
    assert not producer.flush(0.5, leave=39)
    producer._handle.purge()
    assert producer.flush(30)
    assert sorted(reports) == sorted((f"t{p % 2}", p % 3) for p in range(40))
    producer._handle.on_report = producer._report
    producer.send("t0", 0, b"k", b"v", [], None, 99)
    producer._handle.purge()
    assert producer.flush(30)
    error, position = producer.failure()
    assert position == -1 and "PURGE" in error.text and "topic 't0', partition 0" in error.text
    producer.discard()
    producer.discard()  # twice: the second finds nothing to do
    with pytest.raises(KafkaSinkError, match="discarded"):  # not a call into a freed client
        producer.send("t0", 0, b"k", b"v", [], None, 100)


def test_the_library_the_binding_loaded_is_found_and_passes_its_self_test():
    """The ctypes path finds the very librdkafka the binding loaded, and one record sent through it
    to librdkafka's mock broker comes back as sent (no Kafka needed)."""
    from connectors.kafka.native_producer import self_test

    lib = native.library()
    assert lib is not None, (f"no librdkafka of the binding's version {native.binding_version():#x} among "
                             f"{native.library_paths()}: the confluent-kafka wheel changed its layout")
    assert lib.version == native.binding_version()
    assert self_test(lib) is None


def test_a_library_that_fails_its_self_test_or_the_setting_sends_through_the_binding(monkeypatch, caplog):
    """`kafka.native_send = false`, or a librdkafka whose delivery report does not give back what was
    sent, and the mirror's producer is the binding's; the second is said once, as a warning."""
    from connectors.kafka import native_producer
    from connectors.kafka.rdkafka import RdKafkaProducer

    off = KafkaSettings(client={"bootstrap_servers": "127.0.0.1:1"}, producer="librdkafka", native_send=False)
    producer = open_producer(off, records=True)
    assert isinstance(producer, RdKafkaProducer)
    producer.discard()
    on = KafkaSettings(client={"bootstrap_servers": "127.0.0.1:1"}, producer="librdkafka")
    monkeypatch.setattr(native_producer, "self_test", lambda lib: "its delivery report said something else")
    native_producer.usable_library.cache_clear()
    try:
        for _ in range(2):
            producer = open_producer(on, records=True)
            assert isinstance(producer, RdKafkaProducer)
            producer.discard()
    finally:
        native_producer.usable_library.cache_clear()
    said = [r for r in caplog.records if "failed tierlog's self-test" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"


def test_both_sinks_send_through_the_native_producer_with_librdkafka(kafka_bootstrap):
    from connectors.kafka.changelog import ChangelogSink
    from connectors.kafka.mirror_sink import MirrorSink

    settings = KafkaSettings(client={"bootstrap_servers": kafka_bootstrap}, producer="librdkafka")
    for cls in (MirrorSink, ChangelogSink):
        sink = cls(settings)
        assert isinstance(sink.producer, NativeProducer)
        sink.close()
    assert not isinstance(open_producer(settings), NativeProducer)  # one record a call: the binding's
