"""Retention: which of a queue's oldest segments are past their topic's time, bytes or message limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from connectors.tier.manifest import QueueState, Segment


def _limit(limits: dict | None, topic: str):
    return None if not limits else limits.get(topic, limits.get("*"))


@dataclass(frozen=True)
class Retention:
    """Per-topic limits (``"*"``: every other topic); None keeps forever.

    ``check_s``: every queue is looked at once per this many seconds (time passes for all of them);
    limits by bytes and messages are crossed only by a seal, so sealed queues are checked at once.
    """

    seconds: dict | None = None  # topic -> time to live of a segment, after its newest message
    bytes: dict | None = None  # topic -> bytes of segments each queue keeps
    messages: dict | None = None  # topic -> messages each queue keeps
    check_s: float = 30.0

    def __bool__(self) -> bool:
        return bool(self.seconds or self.bytes or self.messages)

    def keeps_forever(self, topic: str) -> bool:
        """Whether no limit ever drops a segment of ``topic``."""
        return all(_limit(limits, topic) is None for limits in (self.seconds, self.bytes, self.messages))

    def expired(self, topic: str, state: QueueState, oldest: Iterable[Segment], now_ms: int) -> list[Segment]:
        """The segments to drop from ``oldest`` (a queue's, oldest first, read lazily): Kafka's rule,
        drop the oldest while what stays still meets the limit, so retained offsets stay contiguous."""
        ttl, max_bytes, max_messages = (_limit(self.seconds, topic), _limit(self.bytes, topic),
                                        _limit(self.messages, topic))
        if ttl is None and max_bytes is None and max_messages is None:
            return []
        out, kept_bytes = [], state.bytes
        for seg in oldest:
            too_old = ttl is not None and now_ms - seg.max_ts > ttl * 1000
            too_big = max_bytes is not None and kept_bytes - seg.size >= max_bytes
            too_many = max_messages is not None and state.commit - (seg.end + 1) >= max_messages
            if not (too_old or too_big or too_many):
                break
            out.append(seg)
            kept_bytes -= seg.size
        return out
