"""Typed errors of the Kafka sinks."""

from __future__ import annotations

from connectors.errors import TierlogError


class KafkaSinkError(TierlogError):
    """Base of the Kafka sink errors."""


class KafkaUnavailable(KafkaSinkError):
    """The broker cannot be reached, a topic is missing, or records were not acknowledged in time.

    The sink waits with backoff and tries again; nothing is lost meanwhile."""

    retriable = True


class RecordTooLargeError(KafkaSinkError):
    """A message does not fit in a Kafka record under ``kafka.max_request_size``."""


class TopicNameError(KafkaSinkError):
    """A RocketMQ topic maps to a name Kafka refuses."""


class ForeignRecordError(KafkaSinkError):
    """A partition's last record was not written by tierlog, so its position cannot be read back."""
