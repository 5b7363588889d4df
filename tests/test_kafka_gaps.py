"""A Kafka outage must not leave a gap in a partition that a sink's read-back then hides.

The sinks' exactly-once protocol (``connectors.kafka.sink``) resends, after a
failure, from each partition's last record as read back: it holds only if what
reached a partition is always a prefix of what was sent to it.  A client that
gives up on records by itself breaks that: librdkafka documents that records
timing out in its queue are skipped (it bumps the producer epoch and sends the
later ones), and kafka-python resets its producer id for expired batches.  The
chaos run found it as a changelog that differed from the KV view after a
15-second outage with a 10-second delivery timeout.

Here a producer sends records to one partition in two groups a few seconds
apart while the broker is cut off; it comes back after the first group's
``kafka.delivery_timeout_s`` has passed but before the second's.  The
partition must then hold every record, once, in order: the client waits, and
only the sink's own deadline gives a producer up, whole.
"""

from __future__ import annotations

import threading
import time

import pytest

from connectors.brokers import DEFAULT_BROKER
from connectors.kafka.producers import open_producer
from connectors.kafka.records import source_headers
from connectors.kafka.settings import PRODUCERS, KafkaSettings
from connectors.kafka.sink import ensure_topic
from tests.chaos.tcpproxy import proxied_broker
from tests.kafka_helpers import read_topic

DELIVERY_TIMEOUT_S = 4.0
SECOND_GROUP_AT_S = 2.5  # after the cut; the first group's old timeout passed at 4-5 s, the second's at 6.5-7.5 s
UP_AT_S = 5.2


@pytest.fixture(scope="module")
def cut_off_broker(tmp_path_factory):
    broker, proxy = proxied_broker(tmp_path_factory.mktemp("kafka_gaps"))
    try:
        yield broker, proxy
    finally:
        proxy.down()
        broker.stop(kill=True)


def send(producer, topic: str, position: int) -> None:
    producer.send(topic, 0, b"k%d" % position, b"v%d" % position,
                  source_headers(position, "t", 0, position, 0, DEFAULT_BROKER), None, position)


@pytest.mark.parametrize("library", PRODUCERS)
def test_records_that_outlive_their_delivery_timeout_in_an_outage_leave_no_gap(cut_off_broker, library):
    broker, proxy = cut_off_broker
    topic = f"gaps-{library}"
    settings = KafkaSettings(client={"bootstrap_servers": broker.bootstrap}, partitions=1,
                             delivery_timeout_s=DELIVERY_TIMEOUT_S, producer=library)
    ensure_topic(settings, topic, compacted=False)
    producer = open_producer(settings)
    send(producer, topic, 0)
    assert producer.flush(30), "the broker did not take a record before the cut"
    proxy.down()
    cut_at = time.monotonic()
    threading.Timer(UP_AT_S, proxy.up).start()
    for position in range(1, 101):
        send(producer, topic, position)
    time.sleep(SECOND_GROUP_AT_S)
    for position in range(101, 201):
        send(producer, topic, position)
    deadline = time.monotonic() + 60
    while not producer.flush(1.0):
        assert time.monotonic() < deadline, "records not delivered 60 s after the outage"
    failed = producer.failure()  # a client that gave up by itself fails here or below
    producer.close(5)
    time.sleep(max(0.0, cut_at + UP_AT_S + 1 - time.monotonic()))
    positions = [int(dict(r.headers)["tierlog.phy"]) for r in read_topic(broker.bootstrap, topic)[0]]
    # A prefix, in order, once each: what the sink's read-back can resume from.  The client's own
    # timeouts made it 0, 101..200 (librdkafka), the first group skipped.
    assert positions == list(range(len(positions))), (
        f"{len(positions)} records, first {positions[:3]}; missing {sorted(set(range(201)) - set(positions))[:5]}...")
    assert failed is None and len(positions) == 201, f"{failed}, {len(positions)} records"
