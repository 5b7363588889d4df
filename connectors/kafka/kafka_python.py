"""The sinks' producer through kafka-python (``kafka.producer = "kafka-python"``), and how the
sinks judge kafka-python's errors, which their read-back and topic checks meet whichever producer sends."""

from __future__ import annotations

import logging

from kafka import KafkaProducer
from kafka import errors as kerr

from connectors.kafka.errors import KafkaSinkError, KafkaUnavailable
from connectors.kafka.producer import NEVER_MS, Producer, SendError, TooLarge, request_timeout_ms
from connectors.kafka.settings import KafkaSettings

log = logging.getLogger("tierlog.kafka")

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
            "delivery_timeout_ms": NEVER_MS, "request_timeout_ms": request_timeout_ms(s),
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
