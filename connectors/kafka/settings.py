"""What the Kafka sinks need to know, separate from tierlog's configuration file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from connectors.kafka.errors import TopicNameError

# Kafka's own rule for topic names (kafka.common.internals.Topic).
_LEGAL_TOPIC = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")


@dataclass(frozen=True)
class KafkaSettings:
    """``client`` holds kafka-python's connection options (bootstrap, security); it may carry a
    password, so it is left out of ``repr`` and never logged."""

    client: dict = field(repr=False)
    mirror_topic: str = "{topic}"
    mirror_topic_map: dict = field(default_factory=dict)
    changelog_topic: str = "{topic}.changelog"
    changelog_topic_map: dict = field(default_factory=dict)
    auto_create_topics: bool = True
    partitions: int = 8
    replication_factor: int = 1
    compression: str = "none"
    linger_ms: int = 5
    batch_bytes: int = 256 << 10
    max_request_size: int = 1 << 20
    delivery_timeout_s: float = 120.0
    on_too_large: str = "fail"  # or "skip": log it and record it in the metadata store

    @property
    def bootstrap(self) -> str:
        return self.client["bootstrap_servers"]


class TopicRouter:
    """A RocketMQ topic's Kafka topic: the explicit map first, else the template (``{topic}``)."""

    def __init__(self, template: str, mapping: dict[str, str], setting: str):
        self.template, self.mapping, self.setting = template, mapping, setting
        self._cache: dict[str, str] = {}

    def __call__(self, topic: str) -> str:
        name = self._cache.get(topic)
        if name is None:
            name = self.mapping.get(topic) or self.template.replace("{topic}", topic)
            if not _LEGAL_TOPIC.match(name) or name in (".", ".."):
                raise TopicNameError(
                    f"RocketMQ topic {topic!r} maps to Kafka topic {name!r}, which Kafka refuses (1-249 of "
                    f"letters, digits, '.', '_', '-'): map it to a legal name in {self.setting}_map, "
                    f"e.g. {self.setting}_map = \"{topic}=<name>\""
                )
            self._cache[topic] = name
        return name


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
