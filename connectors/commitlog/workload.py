"""Synthetic workloads for the embedded producer (``tierlog produce``, tests, benchmarks).

Deterministic for a seed: the same arguments always produce the same messages
(store timestamps aside), so a benchmark or a failing test can be replayed.
"""

from __future__ import annotations

import json
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
    # "json": each body an order as a JSON object whose shape changes as a producer's would (see
    # ``json_body``); "json-steady": orders of one shape all along; "bytes": a counter, then random bytes
    body_format: str = "bytes"

    def __post_init__(self):
        for name in ("messages", "topics", "queues", "keys", "body_size"):
            if getattr(self, name) < (0 if name in ("messages", "body_size") else 1):
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.body_format not in ("bytes", "json", "json-steady"):
            raise ValueError(f"body format must be bytes, json or json-steady, got {self.body_format!r}")
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
            elif self.body_format != "bytes":
                body = json_body(i, self.messages, key, self.body_size, steady=self.body_format == "json-steady")
            else:
                prefix = b"%d:" % i
                body = prefix + rng.randbytes(max(0, self.body_size - len(prefix)))
            yield Message(topic=topic, queue_id=rng.randrange(self.queues), body=body, properties=props)


def json_body(i: int, n: int, key: str, size: int, steady: bool = False) -> bytes:
    """Message ``i`` of ``n`` as an order in JSON, about ``size`` bytes, shaped as producers' bodies
    change over a topic's life: a field added a third of the way in, an integer amount that starts
    to carry cents halfway, a customer sometimes sent as a number, a body now and then not JSON at
    all.  ``steady``: none of that, one shape all along."""
    if i % 97 == 13 and not steady:
        return b"not json: order %d" % i
    order = {"order_id": i, "customer": 4200 + i % 7 if i % 31 == 5 and not steady else f"c-{key[-4:]}",
             "amount": (i % 500) + (0.25 if i >= n // 2 or steady else 0), "paid": i % 3 == 0,
             "placed_at": f"2026-12-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00.{i % 1000:03d}Z",
             "address": {"city": ("Berlin", "Lyon", "Köln")[i % 3], "zip": f"{10000 + i % 90000}"},
             "items": [{"sku": f"s-{(i + j) % 50}", "qty": 1 + j} for j in range(1 + i % 3)]}
    if i >= n // 3 or steady:
        order["coupon"] = f"WINTER{i % 5}"
    body = json.dumps(order, ensure_ascii=False).encode()
    pad = size - len(body) - len(',"note":""')
    if pad > 0:
        body = body[:-1] + b',"note":"' + b"x" * pad + b'"}'
    return body


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
