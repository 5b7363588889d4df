"""The two Kafka producers a sink can send with: kafka-python, and librdkafka through confluent-kafka.

Both are idempotent with ``acks=all``, so the broker refuses a batch that would land after a
gap: what ``connectors.kafka.sink``'s exactly-once protocol builds on.  Neither may give up on a
record by itself: librdkafka skips records that time out in its queue and sends the later ones
(a new epoch), and kafka-python resets its producer id for expired batches, so a partition
would hold 1, 4, 5 and the read-back would then skip 2 and 3 (the chaos run lost changelog
records so in a Kafka outage).  Their own timeouts are off; the sink's flush gives up after
``kafka.delivery_timeout_s`` and discards the whole producer, whose records that arrived are a
prefix of each partition's.  They differ only in
the client library; every error reaches the sink as a :class:`SendError` or a
``KafkaSinkError``, never as a library's own type.

Why two (``kafka.producer``): kafka-python's ``send`` is pure Python, about 47 µs of CPU per
1 KB record under the GIL, measured against a bare Apache Kafka; librdkafka's ``produce``
takes about 10 µs including tierlog's own 3 µs of routing and headers, and does its
batching and I/O on threads of its own (16k against 64k records/s from one Python thread,
three rounds, alternating).  On the driver the changelog's sends were most of the
compaction apply thread's time (``docs/benchmarks.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from kafka import KafkaProducer
from kafka import errors as kerr

from connectors.kafka.errors import KafkaSinkError, KafkaUnavailable
from connectors.kafka.settings import KafkaSettings

log = logging.getLogger("tierlog.kafka")

@dataclass(frozen=True)
class SendError:
    """Why a record was not taken: ``too_large`` records may be skipped (``kafka.on_too_large``);
    a ``retriable`` one is sent again by a new producer after the positions are read back."""

    text: str
    retriable: bool
    too_large: bool = False


class TooLarge(Exception):
    """``send`` refused a record before queueing it: it is larger than ``kafka.max_request_size``."""


class Producer:
    """One idempotent producer of one sink; one thread calls it."""

    def __init__(self):
        self._failed: tuple[SendError, int] | None = None
        self._failed_lock = threading.Lock()  # kafka-python reports on its own sender thread

    def send(self, topic: str, partition: int, key: bytes | None, value: bytes | None, headers: list,
             timestamp_ms: int | None, position: int) -> None:
        """Queue the record of source ``position``; one not taken is reported by ``failure``.
        Raises ``TooLarge``, or ``KafkaSinkError`` when the producer cannot queue at all."""
        raise NotImplementedError

    def failure(self) -> tuple[SendError, int] | None:
        """The first record not taken since the last call (after a ``flush``): why, and its position
        (-1 where the library does not say which record it was: librdkafka)."""
        with self._failed_lock:
            failed, self._failed = self._failed, None
        return failed

    def _fail(self, position: int, error: SendError) -> None:
        with self._failed_lock:
            if self._failed is None:
                self._failed = (error, position)

    def send_records(self, records, rows) -> tuple[int, str | None]:
        """Queue the records ``rows`` (indexes, in order) of ``records`` (a
        ``connectors.kafka.columns.Records``) as ``send`` queues one; returns how many were queued,
        and, where that is fewer than asked, why the next one was refused as too large (``TooLarge``'s
        text): the caller skips or fails it, and asks again from the one after.  This one turns
        each row into Python objects for ``send``; the native producer reads the columns."""
        for n, (topic, partition, key, value, headers, position, ts) in enumerate(records.python_rows(rows)):
            try:
                self.send(topic, partition, key, value, headers, ts, position)
            except TooLarge as exc:
                return n, str(exc)
        return len(rows), None

    def flush(self, timeout_s: float, leave: int = 0) -> bool:
        """Wait until every queued record is taken or failed, or all but ``leave`` of them (a
        producer whose queue bounds itself may return at once then); False if ``timeout_s`` passed
        first."""
        raise NotImplementedError

    def close(self, timeout_s: float) -> None:
        """Flush for up to ``timeout_s``, then stop."""
        raise NotImplementedError

    def discard(self) -> None:
        """Stop now: nothing still queued is sent after this returns (records already on the wire
        may land; the sink's read-back waits for them to settle)."""
        raise NotImplementedError


def open_producer(settings: KafkaSettings, *, records: bool = False) -> Producer:
    """The producer ``kafka.producer`` names.  ``records``: the caller sends ``Records`` batches
    (the mirror), so librdkafka is called through ctypes where the library can be loaded so
    (``connectors.kafka.native_producer``), else through its binding, one call a record."""
    if settings.producer == "librdkafka":
        if records:
            from connectors.kafka.native_producer import open_native

            native = open_native(settings)
            if native is not None:
                return native
        return RdKafkaProducer(settings)
    return KafkaPythonProducer(settings)


NEVER_MS = 2**31 - 1  # a client's own delivery timeout, off: see the module docstring


def _request_timeout_ms(s: KafkaSettings) -> int:
    return max(1000, min(30000, int(s.delivery_timeout_s * 1000) - s.linger_ms - 1))


# ---------------------------------------------------------------- kafka-python

# The idempotent producer's own errors: the broker lost or doubts the producer's sequence (after a
# restart, or tansu under load).  Starting over with a new producer is safe: positions are read back
# and what arrived is skipped, and the broker refuses a batch after a gap, so none can hide behind it.
SEQUENCE_ERRORS = tuple(getattr(kerr, name) for name in (
    "OutOfOrderSequenceNumberError", "UnknownProducerIdError", "InvalidProducerEpochError",
    "DuplicateSequenceNumberError") if hasattr(kerr, name))


def retriable(exc: BaseException) -> bool:
    """Can a kafka-python error pass if tried again with a new client?  A response that cannot be
    decoded (``KafkaProtocolError``: tansu, under concurrent requests) counts as a lost connection."""
    return bool(getattr(exc, "retriable", False)) or isinstance(
        exc, (kerr.KafkaConnectionError, kerr.KafkaTimeoutError, kerr.KafkaProtocolError, *SEQUENCE_ERRORS)
    )


def describe(exc: BaseException) -> str:
    return str(exc) if str(exc).startswith(type(exc).__name__) else f"{type(exc).__name__}: {exc}"


def kafka_python_options(s: KafkaSettings) -> dict:
    """kafka-python's ``KafkaProducer`` options for the sinks' settings (and their benchmark's
    bare producer, so the baseline sends as the sink does)."""
    return {**s.client, "acks": "all", "enable_idempotence": True,
            "compression_type": None if s.compression == "none" else s.compression,
            "linger_ms": s.linger_ms, "batch_size": s.batch_bytes, "max_request_size": s.max_request_size,
            "delivery_timeout_ms": NEVER_MS, "request_timeout_ms": _request_timeout_ms(s),
            "max_block_ms": int(s.delivery_timeout_s * 1000)}


class KafkaPythonProducer(Producer):
    def __init__(self, settings: KafkaSettings):
        super().__init__()
        try:
            self._producer = KafkaProducer(**kafka_python_options(settings))
        except kerr.KafkaTimeoutError:
            raise KafkaUnavailable(f"no Kafka broker reachable at kafka.bootstrap = {settings.bootstrap!r}") from None

    def send(self, topic, partition, key, value, headers, timestamp_ms, position) -> None:
        try:
            future = self._producer.send(topic, key=key, value=value, headers=headers, partition=partition,
                                         timestamp_ms=timestamp_ms)
        except kerr.MessageSizeTooLargeError as exc:
            raise TooLarge(str(exc)) from None
        except kerr.KafkaError as exc:
            raise (KafkaUnavailable if retriable(exc) else KafkaSinkError)(describe(exc)) from None
        # kafka-python calls an errback as fn(exception)
        future.add_errback(lambda exc: self._fail(position, _send_error(exc)))

    def flush(self, timeout_s: float, leave: int = 0) -> bool:
        if leave:  # its buffer (buffer_memory, 32 MB) bounds what it queues: send blocks when full
            return True
        try:
            self._producer.flush(timeout=timeout_s)
            return True
        except kerr.KafkaTimeoutError:
            return False

    def close(self, timeout_s: float) -> None:
        try:
            self._producer.close(timeout=timeout_s)
        finally:
            self._stop_sender()

    def discard(self) -> None:
        try:
            self._producer.close(timeout=0)
        except Exception:  # noqa: BLE001 - it is being thrown away
            pass
        self._stop_sender()

    def _stop_sender(self) -> None:
        """kafka-python's ``close`` flushes first, and when records are still pending that flush
        raises before the sender thread is stopped: the old producer would go on retrying in the
        background and, once the broker is back, deliver records that the new producer (after
        reading positions back) sends again.  Found by the outage test."""
        sender = getattr(self._producer, "_sender", None)
        if sender is None or not sender.is_alive():
            return
        sender.force_close()  # fails its pending batches; it stops at its next loop
        while sender.is_alive():
            sender.join(1.0)
            if sender.is_alive():
                log.warning("waiting for a discarded Kafka producer to stop sending")


def _send_error(exc: BaseException) -> SendError:
    too_large = isinstance(exc, kerr.MessageSizeTooLargeError) or "TooLarge" in type(exc).__name__
    return SendError(describe(exc), retriable(exc), too_large)


# ---------------------------------------------------------------- librdkafka

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
            "message.timeout.ms": 0, "request.timeout.ms": _request_timeout_ms(s),
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
    until its report.  Those cost about 2.0 of the 6.0 µs the sending thread spent on a 1 KiB
    mirror record against a real Apache Kafka broker (``./dev bench producer``; docs/benchmarks.md,
    "librdkafka reports only the records that fail").  What a position was needed for, a record
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
