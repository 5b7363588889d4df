"""What the Kafka sinks need to know, separate from tierlog's configuration file."""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass, field

from connectors.brokers import DEFAULT_BROKER
from connectors.kafka.errors import TopicNameError

log = logging.getLogger("tierlog.kafka")

PRODUCERS = ("kafka-python", "librdkafka")  # kafka.producer: the client libraries (connectors.kafka.producers)

# Kafka's own rule for topic names (kafka.common.internals.Topic).
_LEGAL_TOPIC = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")


@dataclass(frozen=True)
class KafkaSettings:
    """``client`` holds the connection options (bootstrap, security) in kafka-python's names
    (``connectors.kafka.producers`` gives librdkafka its own); it may carry a
    password, so it is left out of ``repr`` and never logged."""

    client: dict = field(repr=False)
    broker: str = DEFAULT_BROKER  # whose positions the records carry, and the read-back looks for
    mirror_topic: str = "{topic}"
    mirror_topic_map: dict = field(default_factory=dict)
    changelog_topic: str = "{topic}.changelog"
    changelog_topic_map: dict = field(default_factory=dict)
    auto_create_topics: bool = True
    partitions: int = 8
    replication_factor: int = 1
    compression: str = "none"
    linger_ms: int = 20  # streaming.config's kafka.linger_ms says why
    batch_bytes: int = 1 << 20  # streaming.config's kafka.batch_bytes says why
    max_request_size: int = 1 << 20
    delivery_timeout_s: float = 120.0
    on_too_large: str = "fail"  # or "skip": log it and record it in the metadata store
    producer: str = "librdkafka"  # or "kafka-python" (connectors.kafka.producers)
    native_send: bool = True  # librdkafka through ctypes for Records batches, where it passes its self-test

    @property
    def bootstrap(self) -> str:
        return self.client["bootstrap_servers"]


class TopicRouter:
    """A RocketMQ topic's Kafka topic: the explicit map first, else the template (``{topic}``).

    A template name Kafka would refuse (``%RETRY%group``: ``%`` is not allowed) is made legal as
    Debezium does: every other character becomes ``_``, and a name past 249 characters is cut
    and given a hash of the whole, with one warning per topic.  Two RocketMQ topics that end up
    on one Kafka topic that way stop the sink with both named: their messages would mix and the
    restart read-back could not tell them apart.  An explicit map wins, and must be legal itself.
    """

    def __init__(self, template: str, mapping: dict[str, str], setting: str):
        self.template, self.mapping, self.setting = template, mapping, setting
        self._cache: dict[str, str] = {}
        self._owner: dict[str, str] = {}  # Kafka topic -> the RocketMQ topic routed to it

    def __call__(self, topic: str) -> str:
        name = self._cache.get(topic)
        if name is None:
            name = self._route(topic)
            other = self._owner.setdefault(name, topic)
            if other != topic and not (topic in self.mapping and other in self.mapping):
                raise TopicNameError(
                    f"RocketMQ topics {other!r} and {topic!r} both map to Kafka topic {name!r}: map one of them "
                    f"to another name in {self.setting}_map, e.g. {self.setting}_map = \"{topic}=<name>\""
                )
            self._cache[topic] = name
        return name

    def _route(self, topic: str) -> str:
        if topic in self.mapping:
            name = self.mapping[topic]
            if not legal_topic(name):
                raise TopicNameError(f"{self.setting}_map maps RocketMQ topic {topic!r} to {name!r}, which Kafka "
                                     "refuses (1-249 of letters, digits, '.', '_', '-')")
            return name
        wanted = self.template.replace("{topic}", topic)
        name = kafka_safe(wanted)
        if name != wanted:
            log.warning("RocketMQ topic %r would be Kafka topic %r, which Kafka refuses: using %r (set %s_map to "
                        "choose another name)", topic, wanted, name, self.setting)
        return name


def legal_topic(name: str) -> bool:
    return bool(_LEGAL_TOPIC.match(name)) and name not in (".", "..")


def kafka_safe(name: str) -> str:
    """``name`` as a legal Kafka topic: other characters as ``_``; past 249, cut with a hash of the whole."""
    safe = re.sub(r"[^a-zA-Z0-9._-]", "_", name) or "_"
    if safe in (".", ".."):
        safe = safe.replace(".", "_")
    if len(safe) > 249:
        safe = f"{safe[:240]}-{zlib.crc32(name.encode()):08x}"
    return safe


def parse_topic_map(text: str, setting: str) -> dict[str, str]:
    """``orders=orders-mirror,%DLQ%g=dlq-g`` to a dict; ``setting`` names it in errors."""
    from connectors.errors import ConfigError

    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        source, sep, target = item.rpartition("=")
        if not sep or not source or not target:
            raise ConfigError(f"setting {setting}: {item!r} is not ROCKETMQ_TOPIC=KAFKA_TOPIC")
        out[source] = target
    return out
