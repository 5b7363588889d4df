"""The two Kafka producers a sink can send with: kafka-python, and librdkafka through confluent-kafka.

Both are idempotent with ``acks=all``, so the broker refuses a batch that would land after a
gap: what ``connectors.kafka.sink``'s exactly-once protocol builds on.  Neither may give up on a
record by itself: librdkafka skips records that time out in its queue and sends the later ones
(a new epoch), and kafka-python resets its producer id for expired batches, so a partition
would hold 1, 4, 5 and the read-back would then skip 2 and 3 (the chaos run lost changelog
records so in a Kafka outage).  Their own timeouts are off; the sink's flush gives up after
``kafka.delivery_timeout_s`` and discards the whole producer, whose records that arrived are a
prefix of each partition's.  They differ only in
the client library (the contract: ``connectors.kafka.producer``); every error reaches the sink as a :class:`SendError` or a
``KafkaSinkError``, never as a library's own type.

Why two (``kafka.producer``): kafka-python's ``send`` is pure Python under the GIL, several times
librdkafka's ``produce`` a record, which does its batching and I/O on threads of its own; on the
driver the changelog's sends through kafka-python were most of the compaction apply thread's time
(``docs/benchmarks.md``).  kafka-python stays for hosts where confluent-kafka cannot be installed.
"""

from __future__ import annotations

from connectors.kafka.kafka_python import KafkaPythonProducer
from connectors.kafka.native_producer import open_native
from connectors.kafka.producer import Producer
from connectors.kafka.rdkafka import RdKafkaProducer
from connectors.kafka.settings import KafkaSettings


def open_producer(settings: KafkaSettings, *, records: bool = False) -> Producer:
    """The producer ``kafka.producer`` names.  ``records``: the caller sends ``Records`` batches
    (the mirror), so librdkafka is called through ctypes where the library can be loaded so
    (``connectors.kafka.native_producer``), else through its binding, one call a record."""
    if settings.producer == "librdkafka":
        if records and settings.native_send:
            native = open_native(settings)
            if native is not None:
                return native
        return RdKafkaProducer(settings)
    return KafkaPythonProducer(settings)
