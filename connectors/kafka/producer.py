"""What every Kafka producer of the sinks is: the contract ``connectors.kafka.sink`` sends through.

A producer is idempotent with ``acks=all`` and never gives up on a record by itself (its client's
own delivery timeout is off, ``NEVER_MS``): the sink's flush gives up after
``kafka.delivery_timeout_s`` and discards the whole producer, so what reached each partition is a
prefix of what was sent to it.  Every error reaches the sink as a ``SendError`` or a
``KafkaSinkError``, never as a client library's own type.  The implementations differ only in the
client library: ``kafka_python``, ``rdkafka`` (librdkafka through its binding) and
``native_producer`` (librdkafka through ctypes); ``producers.open_producer`` picks one.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from connectors.kafka.settings import KafkaSettings


@dataclass(frozen=True)
class SendError:
    """Why a record was not taken: ``too_large`` records may be skipped (``kafka.on_too_large``);
    a ``retriable`` one is sent again by a new producer after the positions are read back."""

    text: str
    retriable: bool
    too_large: bool = False


class TooLarge(Exception):
    """``send`` refused a record before queueing it: it is larger than ``kafka.max_request_size``."""


class Producer(ABC):
    """One idempotent producer of one sink; one thread calls it."""

    def __init__(self):
        self._failed: tuple[SendError, int] | None = None
        self._failed_lock = threading.Lock()  # kafka-python reports on its own sender thread

    @abstractmethod
    def send(self, topic: str, partition: int, key: bytes | None, value: bytes | None, headers: list,
             timestamp_ms: int | None, position: int) -> None:
        """Queue the record of source ``position``; one not taken is reported by ``failure``.
        Raises ``TooLarge``, or ``KafkaSinkError`` when the producer cannot queue at all."""

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

    @abstractmethod
    def flush(self, timeout_s: float, leave: int = 0) -> bool:
        """Wait until every queued record is taken or failed, or all but ``leave`` of them (a
        producer whose queue bounds itself may return at once then); False if ``timeout_s`` passed
        first."""

    @abstractmethod
    def close(self, timeout_s: float) -> None:
        """Flush for up to ``timeout_s``, then stop."""

    @abstractmethod
    def discard(self) -> None:
        """Stop now: nothing still queued is sent after this returns (records already on the wire
        may land; the sink's read-back waits for them to settle)."""


NEVER_MS = 2**31 - 1  # a client's own delivery timeout, off: see the module docstring


def request_timeout_ms(s: KafkaSettings) -> int:
    return max(1000, min(30000, int(s.delivery_timeout_s * 1000) - s.linger_ms - 1))
