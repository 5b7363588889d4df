"""Does kafka-python's producer lose a record it had acknowledged (``acks=all``, idempotence on), or
did the clean-clone runs' misses come from the read-back?

Round after round, beside load (another producer sending without pause, and a thread keeping a
core busy), kafka-python's producer with the sinks' own options sends records of a fresh topic and
keeps what each future was told: the partition and offset the broker acknowledged.  Then an
independent client, librdkafka (confluent-kafka), reads every partition from its start to its high
watermark.  Every acknowledged record must be at its offset with its key and value, and nothing
else may be there.  The read-back that missed records was kafka-python's own consumer, which can
stop fetching an assigned partition (dpkp/kafka-python#3131, #2575); it is not used here.
"""

from __future__ import annotations

import threading
import time

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from connectors.kafka.kafka_python import kafka_python_options
from streaming.settings import kafka_settings
from tests.kafka_helpers import kafka_conf, read_with_librdkafka
from tests.tiering_helpers import make_conf

ROUNDS, RECORDS, PARTITIONS = 6, 4000, 3


def test_every_record_kafka_python_acknowledged_is_at_its_offset(kafka_bootstrap, kafka_prefix, tmp_path):
    settings = kafka_settings(kafka_conf(make_conf(tmp_path, str(tmp_path / "tier")), kafka_bootstrap, kafka_prefix))
    options = kafka_python_options(settings)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    topics = [f"{kafka_prefix}.acks-{r}" for r in range(ROUNDS)] + [f"{kafka_prefix}.load"]
    admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in topics])
    admin.close()
    stop, loaded = threading.Event(), {"records": 0, "spins": 0}

    def load() -> None:  # another producer on the same broker, without pause
        producer = KafkaProducer(**options)
        while not stop.is_set():
            for _ in range(200):
                producer.send(topics[-1], key=b"load", value=b"x" * 1024)
            loaded["records"] += 200
        producer.close(timeout=30)

    def spin() -> None:  # a busy core, as the service's own threads and Spark make one
        while not stop.is_set():
            sum(range(10_000))
            loaded["spins"] += 1

    threads = [threading.Thread(target=load, daemon=True), threading.Thread(target=spin, daemon=True)]
    for t in threads:
        t.start()
    try:
        for r in range(ROUNDS):
            producer = KafkaProducer(**options)
            futures = [(producer.send(topics[r], key=b"k%d" % i, value=b"round %d record %d " % (r, i) + b"v" * (i % 900)),
                        i) for i in range(RECORDS)]
            producer.flush(timeout=60)
            acknowledged = {}
            for future, i in futures:
                meta = future.get(timeout=60)  # raises if the send failed: none may
                acknowledged[(meta.partition, meta.offset)] = (b"k%d" % i, b"round %d record %d " % (r, i) + b"v" * (i % 900))
            producer.close(timeout=30)
            assert len(acknowledged) == RECORDS, "two records acknowledged at one offset"
            read = read_with_librdkafka(kafka_bootstrap, [(topics[r], p) for p in range(PARTITIONS)], RECORDS)
            got = {(p, m.offset()): (m.key(), m.value()) for (_, p), records in read.items() for m in records}
            missing = sorted(set(acknowledged) - set(got))
            assert not missing, f"round {r}: {len(missing)} acknowledged record(s) not in Kafka, first {missing[:5]}"
            assert got == acknowledged, f"round {r}: the topic holds other records than were acknowledged"
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert loaded["records"] > RECORDS and loaded["spins"] > 0, "the load did no work"
