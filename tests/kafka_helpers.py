"""Helpers for the Kafka tests: reading topics back with assign() and seek, and the oracles."""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Iterator

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from connectors.kafka.records import key_partition
from connectors.kafka.sink import position_of
from streaming import config as cfg
from tests.oracle import latest_per_key, written_rows


def kafka_conf(conf: cfg.Config, bootstrap: str, prefix: str, **kafka) -> cfg.Config:
    """``conf`` with both Kafka sinks on, into topics of this test's own."""
    # Two sender slots (the default picks one on these 2 cores with librdkafka), and Spark's tasks
    # sending even the small batches the driver would send itself: the hand-over of positions
    # between slots and batches is what the crash, outage and chaos tests must cross.
    settings = {"bootstrap": bootstrap, "mirror_topic": f"{prefix}.{{topic}}",
                "changelog_topic": f"{prefix}.{{topic}}.changelog", "partitions": 4, "linger_ms": 2,
                "delivery_timeout_s": 20.0, "mirror_tasks": 2, "mirror_driver_bytes": 0, **kafka}
    return dataclasses.replace(conf, kafka=cfg.KafkaConfig(**settings))


def read_topic(bootstrap: str, topic: str, timeout_s: float = 60.0) -> dict[int, list]:
    """Every record of every partition of ``topic``, in offset order (assign + seek, no group)."""
    out: dict[int, list] = {}
    for partition, record in iter_topic(bootstrap, topic, timeout_s, on_partition=lambda p: out.setdefault(p, [])):
        out[partition].append(record)
    return out


def topic_partitions(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[int]:
    """The partition numbers of ``topic``, or [] when the broker says it does not exist or cannot.

    A broker's own answer for the one topic, not a consumer's metadata cache: a consumer new to a
    topic just made can fail its first refresh ('Metadata refresh: failed Cancelled') and report no
    partitions, which a read would take for an empty topic, so read nothing of records that are there.
    """
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                (described,) = admin.describe_topics([topic])
                code = described["error_code"]
            except KafkaError as e:
                code = e
            if code == 0:
                return sorted(p["partition_index"] for p in described["partitions"])
            if code in (3, 17):  # UNKNOWN_TOPIC_OR_PARTITION; INVALID_TOPIC_EXCEPTION, a name no topic can have
                return []
            assert time.monotonic() < deadline, f"could not describe {topic} in {timeout_s} s: {code!r}"
            time.sleep(0.2)
    finally:
        admin.close()


def read_with_librdkafka(bootstrap: str, partitions: list[tuple[str, int]], expected: int = 0,
                         timeout_s: float = 120.0) -> dict[tuple[str, int], list]:
    """Every record of ``partitions`` ((topic, partition) pairs), each from offset 0 to the high
    watermark the broker gives once at least ``expected`` records are in, read by librdkafka
    (confluent-kafka's consumer): a client independent of kafka-python, whose consumer can stop
    fetching an assigned partition (``poll_partitions``).  Each record as
    ``confluent_kafka.Message``, by partition, in offset order."""
    import confluent_kafka

    # A fetch the broker answers "offset not available" resets to the log's start, not its end: with
    # librdkafka's default (the end) one such answer at offset 0, on a topic a moment old, left a
    # read-back with none of the records a producer had acknowledged (CI, test_native_producer).
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "tierlog-tests-read-back",
                                         "enable.auto.commit": False, "enable.partition.eof": False,
                                         "auto.offset.reset": "earliest"})
    got: dict[tuple[str, int], list] = {tp: [] for tp in partitions}
    deadline = time.monotonic() + timeout_s
    try:
        consumer.assign([confluent_kafka.TopicPartition(t, p, 0) for t, p in partitions])
        ends: dict | None = None
        while True:
            have = sum(map(len, got.values()))
            if ends is None and have >= expected:
                ends = {tp: consumer.get_watermark_offsets(confluent_kafka.TopicPartition(*tp), timeout=30)[1]
                        for tp in partitions}
            if ends is not None and all((got[tp][-1].offset() + 1 if got[tp] else 0) >= ends[tp] for tp in partitions):
                return got
            if time.monotonic() >= deadline:  # what the broker holds tells a loss from a stalled read
                marks = {f"{t}[{p}]": (len(got[(t, p)]), consumer.get_watermark_offsets(
                    confluent_kafka.TopicPartition(t, p), timeout=10)) for t, p in partitions}
                raise AssertionError(f"librdkafka read {have} records of {expected} in {timeout_s} s; "
                                     f"partition: (read, (low, high) watermarks): {marks}")
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                got[(message.topic(), message.partition())].append(message)
    finally:
        consumer.close()


STALL_S = 15.0  # no record for this long while more are wanted: a new consumer takes over


def poll_partitions(bootstrap: str, tps: list[TopicPartition], more: Callable[[KafkaConsumer], bool],
                    timeout_s: float, what) -> Iterator[tuple[TopicPartition, object]]:
    """``(partition, record)`` of ``tps`` from their starts, each in offset order, while
    ``more(consumer)`` holds (``what``, a text or a function giving one, names it if time runs
    out).  A consumer that returns nothing for ``STALL_S`` while more is wanted
    is closed and a new one seeks to the offsets reached: kafka-python 3.0's consumer can stop
    fetching a partition it was assigned (dpkp/kafka-python#3131, #2575), which a loaded CI run
    met here (1,488 of 3,996 records read in 120 s, all of them acknowledged with acks=all).  Its
    incremental fetch sessions, the workaround #2575 names, are off too."""
    reached: dict[TopicPartition, int] = {}  # the next offset of each partition read from
    deadline = time.monotonic() + timeout_s
    while True:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, allow_auto_create_topics=False,
                                 enable_incremental_fetch_sessions=False)
        try:
            consumer.assign(tps)
            for tp in tps:
                if tp in reached:
                    consumer.seek(tp, reached[tp])
                else:
                    consumer.seek_to_beginning(tp)
            last = time.monotonic()
            while more(consumer):
                assert time.monotonic() < deadline, (  # the message, with what() in it, only on failure
                    f"could not read {what() if callable(what) else what} in {timeout_s} s")
                if time.monotonic() - last > STALL_S:
                    break  # a new consumer
                for tp, records in consumer.poll(timeout_ms=300).items():
                    for record in records:
                        reached[tp] = record.offset + 1
                        last = time.monotonic()
                        yield tp, record
            else:
                return
        finally:
            consumer.close()


def iter_topic(bootstrap: str, topic: str, timeout_s: float = 60.0, on_partition=None) -> Iterator[tuple[int, object]]:
    """``(partition, record)`` for every record of ``topic``, each partition in offset order, without
    holding them (the soak reads millions); ``on_partition(p)`` is called for each partition first."""
    tps = [TopicPartition(topic, p) for p in topic_partitions(bootstrap, topic)]
    for tp in tps:
        if on_partition is not None:
            on_partition(tp.partition)
    if not tps:
        return

    def short_of_the_end(consumer: KafkaConsumer) -> bool:
        # To the high watermark of the fetch responses: tansu's listed end offsets lag far behind.
        return any(consumer.highwater(tp) is None or consumer.position(tp) < consumer.highwater(tp) for tp in tps)

    for tp, record in poll_partitions(bootstrap, tps, short_of_the_end, timeout_s, f"{topic} to its end"):
        yield tp.partition, record


def mirrored_bodies(conf: cfg.Config, topics) -> dict[int, bytes]:
    """The mirror topics of RocketMQ ``topics``: physical offset -> value, each asserted sent once."""
    mirrored: dict[int, bytes] = {}
    for topic in topics:
        for records in read_topic(conf.kafka.bootstrap, conf.kafka.mirror_topic.replace("{topic}", topic)).values():
            for r in records:
                phy = int(dict(r.headers)["tierlog.phy"])
                assert phy not in mirrored, f"message at {phy} mirrored twice"
                mirrored[phy] = r.value
    return mirrored


def mirror_oracle(conf: cfg.Config) -> dict[tuple[str, int], list[tuple]]:
    """What the mirror topics must hold: per (Kafka topic, partition), (key, value, headers) in order."""
    out: dict[tuple[str, int], list[tuple]] = {}
    for m in written_rows(conf.commitlog.dir):
        if m["sysflag"] & 0xC in (0x4, 0xC):  # PREPARED and ROLLBACK never enter a queue
            continue
        out.setdefault(mirror_place(conf.kafka, m), []).append(mirror_record(m))
    return out


def mirror_place(kafka: cfg.KafkaConfig, row: dict) -> tuple[str, int]:
    """The (Kafka topic, partition) the mirror sends one message row (``tests.oracle.message_row``) to:
    the README's rule, the broker name's CRC-32 plus the queue id, modulo the partitions."""
    partition = (zlib.crc32(row["broker"].encode()) + row["queue_id"]) % kafka.partitions
    return kafka.mirror_topic.replace("{topic}", row["topic"]), partition


def mirror_record(row: dict) -> tuple:
    """The (key, value, headers) the mirror sends for one message row."""
    headers = [(k, v.encode()) for k, v in row["properties"].items()]
    headers += [("tierlog.phy", str(row["phy_offset"]).encode()), ("tierlog.broker", row["broker"].encode()),
                ("tierlog.topic", row["topic"].encode()),
                ("tierlog.queue", str(row["queue_id"]).encode()), ("tierlog.qoff", str(row["queue_offset"]).encode()),
                ("tierlog.ts", str(row["store_ts"]).encode())]
    key = None if row["key"] is None else row["key"].encode()
    return key, row["body"], headers


def mirror_contents(conf: cfg.Config, topics: list[str]) -> dict[tuple[str, int], list[tuple]]:
    out = {}
    for source in topics:
        topic = conf.kafka.mirror_topic.replace("{topic}", source)
        for p, records in read_topic(conf.kafka.bootstrap, topic).items():
            if records:
                out[(topic, p)] = [(r.key, r.value, list(r.headers)) for r in records]
    return out


def changelog_oracle(conf: cfg.Config) -> dict[tuple[str, str], bytes | None]:
    """The changelog read as a compacted topic: (topic, key) -> latest body, None for a tombstone."""
    latest = latest_per_key(conf.commitlog.dir, with_tombstones=True)
    return {k: None if v["deleted"] else v["body"] for k, v in latest.items()}


def changelog_records(conf: cfg.Config, topics: list[str]) -> list[tuple]:
    """Every changelog record: (source topic, key, value, position, partition), per partition in order."""
    out = []
    for source in topics:
        topic = conf.kafka.changelog_topic.replace("{topic}", source)
        for p, records in read_topic(conf.kafka.bootstrap, topic).items():
            for r in records:
                assert key_partition(r.key, conf.kafka.partitions) == p, "a key landed in the wrong partition"
                out.append((source, r.key.decode(), r.value, position_of(r.headers), p))
    return out


def compacted(records: list[tuple]) -> dict[tuple[str, str], bytes | None]:
    """Last value per key, as Kafka's log cleaner would leave it (None: a tombstone)."""
    return {(topic, key): value for topic, key, value, _pos, _p in records}


def assert_mirror_equals_oracle(conf: cfg.Config, topics: list[str]) -> None:
    """The mirror equals the oracle; on a difference, say which positions are missing, extra or out of place."""
    got, expected = mirror_contents(conf, topics), mirror_oracle(conf)
    if got == expected:
        return
    report = []
    for key in sorted(set(got) | set(expected)):
        have = [int(dict(h)["tierlog.phy"]) for _k, _v, h in got.get(key, [])]
        want = [int(dict(h)["tierlog.phy"]) for _k, _v, h in expected.get(key, [])]
        if have != want:
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            twice = sorted({p for p in have if have.count(p) > 1})
            report.append(f"{key}: {len(have)} records, {len(want)} expected; missing {missing[:10]}, "
                          f"extra {extra[:10]}, twice {twice[:10]}, first difference at index "
                          f"{next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))}")
    raise AssertionError("the mirror differs from the oracle:\n" + "\n".join(report or ["(same positions, other fields differ)"]))
