"""The sinks' producer through librdkafka's Python binding (confluent-kafka), a record a call, and
what both librdkafka paths share: its options for the sinks' settings and how its errors are judged."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from connectors.kafka.errors import KafkaSinkError, KafkaUnavailable
from connectors.kafka.producer import Producer, SendError, TooLarge, request_timeout_ms
from connectors.kafka.settings import KafkaSettings

log = logging.getLogger("tierlog.kafka")

# kafka-python's option names (``KafkaSettings.client``) as librdkafka's.
_RD_NAMES = {
    "bootstrap_servers": "bootstrap.servers", "client_id": "client.id", "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism", "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password", "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location", "ssl_keyfile": "ssl.key.location",
}
_DISCARD_WAIT_S = 5.0  # a purge's reports come at once; this only bounds a stuck client
_POLL_EVERY = 1000  # sends between serving delivery reports, so failures surface during a long batch


def rdkafka_options(s: KafkaSettings) -> dict:
    """librdkafka's configuration for the sinks' settings (and their benchmark's bare producer)."""
    conf = {}
    for name, value in s.client.items():
        if name not in _RD_NAMES:
            raise KafkaSinkError(f"Kafka client option {name!r} has no librdkafka equivalent known to tierlog; "
                                 "set kafka.producer = \"kafka-python\"")
        conf[_RD_NAMES[name]] = ",".join(value) if isinstance(value, (list, tuple)) else value
    return {**conf, "acks": "all", "enable.idempotence": True, "compression.type": s.compression,
            "linger.ms": s.linger_ms, "batch.size": s.batch_bytes, "message.max.bytes": s.max_request_size,
            # 0: no timeout.  Not enable.gapless.guarantee: it makes the discard's purge of records
            # in flight a fatal error, which the binding raises out of the next flush.
            "message.timeout.ms": 0, "request.timeout.ms": request_timeout_ms(s),
            # Its log lines go to Python logging under "kafka", silenced with kafka-python's unless
            # --log-level DEBUG, instead of librdkafka's own lines on stderr; the sink reports.
            "logger": logging.getLogger("kafka.librdkafka"), "log.connection.close": False}


# librdkafka's error codes (rdkafka.h; confluent_kafka.KafkaError has them by name).
QUEUE_FULL, MSG_SIZE_TOO_LARGE, RECORD_LIST_TOO_LARGE = -184, 10, 18
_RD_RETRIABLE = frozenset((
    -192, -195, -187, -185,  # _MSG_TIMED_OUT, _TRANSPORT, _ALL_BROKERS_DOWN, _TIMED_OUT
    7, 19, 6,  # REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS, NOT_LEADER_FOR_PARTITION
    45, 59, 47,  # OUT_OF_ORDER_SEQUENCE_NUMBER, UNKNOWN_PRODUCER_ID, INVALID_PRODUCER_EPOCH
))


def rd_send_error(code: int, text: str, *, fatal: bool = False, retriable: bool = False) -> SendError:
    """A librdkafka error as the sinks judge it.  A fatal one (the idempotent producer's sequence
    lost) is cured by a new producer, so it counts as retriable."""
    too_large = code in (MSG_SIZE_TOO_LARGE, RECORD_LIST_TOO_LARGE)
    return SendError(text, bool(retriable or fatal or code in _RD_RETRIABLE), too_large)


class RdKafkaProducer(Producer):
    """librdkafka's producer.  Only a record that fails is reported (``delivery.report.only.error``),
    with its topic and partition but not its position (-1): the binding gives a report no headers.

    Why no report for a record delivered: each was a call of Python from ``poll`` with a message
    object built for it, and to find a failed record's position every record's was kept in flight
    until its report: a third of the sending thread's time a record (``./dev bench producer``;
    docs/benchmarks.md, "librdkafka reports only the records that fail").  What a position was needed for, a record
    the broker refuses as too large, is refused by the sink itself first: ``message.max.bytes`` is
    ``kafka.max_request_size``, and a record over it fails ``send`` with its position
    (``TooLarge``)."""

    def __init__(self, settings: KafkaSettings):
        super().__init__()
        try:
            import confluent_kafka
        except ImportError:
            raise KafkaSinkError("kafka.producer = \"librdkafka\" needs the confluent-kafka package: "
                                 "pip install confluent-kafka, or set kafka.producer = \"kafka-python\"") from None
        self._ck = confluent_kafka
        self._producer = confluent_kafka.Producer({**rdkafka_options(settings), "error_cb": self._client_error,
                                                   "on_delivery": self._report,
                                                   "delivery.report.only.error": True})
        self._sent = 0
        self._discarded = False

    def _client_error(self, err) -> None:
        # Connection trouble is reported here and retried by librdkafka itself; records it cannot
        # deliver wait for the sink's deadline (KafkaSink.flush), never time out by themselves.
        log.debug("librdkafka: %s", err)

    def send(self, topic, partition, key, value, headers, timestamp_ms, position) -> None:
        while True:
            try:  # a timestamp of 0 is librdkafka's "now"
                self._producer.produce(topic, value=value, key=key, partition=partition, headers=headers,
                                       timestamp=timestamp_ms or 0)
                break
            except BufferError:  # its queue is full: let it send
                self._producer.poll(0.05)
            except self._ck.KafkaException as exc:
                err = exc.args[0]
                if err.code() == self._ck.KafkaError.MSG_SIZE_TOO_LARGE:
                    raise TooLarge(err.str()) from None
                failure = self._send_error(err)
                raise (KafkaUnavailable if failure.retriable else KafkaSinkError)(failure.text) from None
        # Queued: a failure is reported from a poll or flush on this thread, never before this line.
        self._sent += 1
        if self._sent % _POLL_EVERY == 0:
            self._producer.poll(0)

    def _report(self, err, msg) -> None:
        if err is not None and not self._discarded:
            failure = self._send_error(err)
            where = f" (topic {msg.topic()!r}, partition {msg.partition()})"
            self._fail(-1, replace(failure, text=failure.text + where))

    def _send_error(self, err) -> SendError:
        return rd_send_error(err.code(), f"{err.name()}: {err.str()}", fatal=err.fatal(), retriable=err.retriable())

    def flush(self, timeout_s: float, leave: int = 0) -> bool:
        if not leave:
            return self._producer.flush(timeout_s) == 0
        # Its queue holds up to a GiB by default (queue.buffering.max.kbytes): a caller that sends
        # a large batch in slices waits here so that no more than a slice or two is queued.
        deadline = time.monotonic() + timeout_s
        while len(self._producer) > leave:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._producer.poll(min(0.05, left))
        return True

    def close(self, timeout_s: float) -> None:
        self._producer.flush(timeout_s)
        self.discard()

    def discard(self) -> None:
        self._discarded = True
        # purge(blocking=True) does not wait: the binding passes librdkafka's NON_BLOCKING flag for
        # it (confluent-kafka-python's Producer.c, still in 2.16), so a queued record could go out
        # after this returned.  The flush waits until every purged record is reported (ignored),
        # whichever way the flag works.
        try:
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.flush(_DISCARD_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - it is being thrown away; a fatal error surfaces here
            log.debug("discarding a librdkafka producer: %s", exc)
