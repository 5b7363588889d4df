"""Synthetic workloads for the embedded producer (``tierlog produce``, tests, benchmarks).

Deterministic for a seed: the same arguments always produce the same messages
(store timestamps aside), so a benchmark or a failing test can be replayed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Iterator

from connectors.commitlog.format import Message


@dataclass(frozen=True)
class Workload:
    """What to produce: ``messages`` spread over ``topics`` × ``queues``, keys drawn from ``keys``."""

    messages: int
    topics: int = 1
    queues: int = 4
    keys: int = 1000
    body_size: int = 1024
    delete_ratio: float = 0.0
    seed: int = 0
    topic_prefix: str = "topic"

    def __post_init__(self):
        for name in ("messages", "topics", "queues", "keys", "body_size"):
            if getattr(self, name) < (0 if name in ("messages", "body_size") else 1):
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.delete_ratio <= 1.0:
            raise ValueError(f"delete ratio must be between 0 and 1, got {self.delete_ratio}")

    def generate(self, start: int = 0) -> Iterator[Message]:
        """Messages ``start`` .. ``messages - 1`` of this workload."""
        rng = random.Random(self.seed * 1_000_003 + start)
        for i in range(start, self.messages):
            topic = f"{self.topic_prefix}-{i % self.topics}"
            key = f"key-{rng.randrange(self.keys):08d}"
            props = {"KEYS": key, "TAGS": f"tag-{i % 3}", "UNIQ_KEY": f"{self.seed:08X}{i:024X}"}
            if self.delete_ratio and rng.random() < self.delete_ratio:
                props["KV_OP"] = "DELETE"
                body = b""
            else:
                prefix = b"%d:" % i
                body = prefix + rng.randbytes(max(0, self.body_size - len(prefix)))
            yield Message(topic=topic, queue_id=rng.randrange(self.queues), body=body, properties=props)


def append_in_chunks(writer, messages: Iterable[Message], chunk: int = 2000) -> int:
    """Append ``messages`` through ``writer`` ``chunk`` at a time (one write each); returns the count."""
    pending: list[Message] = []
    count = 0
    for m in messages:
        pending.append(m)
        if len(pending) == chunk:
            writer.append_many(pending)
            count += len(pending)
            pending = []
    writer.append_many(pending)
    return count + len(pending)
