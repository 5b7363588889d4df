"""Holding a small micro-batch back: the ``minBytesPerTrigger`` and ``maxTriggerDelayMs`` options of
the ``commitlog`` and ``tierfeed`` sources (as Spark's Kafka source's ``minOffsetsPerTrigger`` and
``maxTriggerDelay``), and the mirror's ``kafka.mirror_min_batch_bytes``.  A micro-batch costs Spark several hundred ms of CPU whatever it holds, so a
quiet stream's consumer may rather run one every few seconds."""

from __future__ import annotations

import time


class BatchHold:
    def __init__(self, min_bytes: int = 0, max_delay_s: float = 0.0):
        self.min_bytes = min_bytes  # 0: never hold
        self.max_delay_s = max_delay_s
        self._waiting_since: float | None = None  # when a batch below min_bytes first found data

    def held_back(self, begin: int, end: int, draining: bool = False) -> bool:
        """Whether a batch of ``[begin, end)`` waits for more; never while ``draining`` (availableNow
        drains what is there)."""
        if not self.min_bytes or draining or end - begin >= self.min_bytes:
            self._waiting_since = None
            return False
        if end == begin:
            return False  # nothing there: no batch anyway
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._waiting_since < self.max_delay_s:
            return True
        self._waiting_since = None
        return False


def hold_options(min_bytes: int, max_delay_s: float, draining: bool) -> dict[str, str]:
    """The source options that hold a batch below ``min_bytes`` back for up to ``max_delay_s``
    (compaction's settings; the mirror, with no source, holds with ``BatchHold`` itself); none
    while ``draining`` (``--until-caught-up`` drains what is there) or when either setting is 0."""
    if draining or not min_bytes or not max_delay_s:
        return {}
    return {"minBytesPerTrigger": str(min_bytes), "maxTriggerDelayMs": str(int(max_delay_s * 1000))}
