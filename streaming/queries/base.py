"""What every streaming query of ``tierlog run`` is, to the runner (``streaming.service``).

A query reads the commitlog (tiering) or what the tier committed (compaction, the mirror) and
hands each batch to its outputs (the tier, the KV view, a Kafka topic).  The runner knows queries
only through :class:`Query`: it starts each one's stream with its own checkpoint,
hands every batch its offset range, calls ``tick`` between batches, and on a
stop waits for the batch in flight (by taking ``lock``), then calls ``flush``
and ``close``.  Nothing in the runner branches on a query's name, so a new
query is one new module and one line in ``streaming.plan.QUERIES``.

Contract of a query:

- ``name``: its checkpoint directory under ``checkpoint.dir``, its ``query``
  label in metrics and log lines.  Changing it abandons its checkpoint.
- ``enabled(settings)``: whether the configuration runs it.
- ``sinks(settings)``: the sinks (outputs) it feeds, by the names the metadata
  store records their progress under (``tier``, ``kv``, ``changelog``,
  ``mirror``); each sink's applied offset bounds the safepoint, and so does
  this query's last committed batch, if the query ``reads_commitlog``.  A query
  that does not consumes the tier's committed batches instead (``state.tier_feed``),
  which the tier keeps for it; under ``--until-caught-up`` it runs on its
  trigger and is stopped once the commitlog's readers are done and it is
  ``caught_up()``.
- ``guarded_settings(settings, spark)``: the settings its checkpoint depends on;
  a start with other values is refused (``streaming.runtime.checkpoints``).
- ``start(committed_end)`` runs before the stream starts (catch up what Spark committed
  but an output has not applied); ``process(batch)`` runs on Spark's
  foreachBatch thread, under ``lock``, and must be idempotent for a batch
  Spark runs again after a crash; ``tick()`` and ``poll_metrics()`` run on the
  runner's thread about once per trigger interval (``poll_metrics`` also once
  after the streams stopped); ``flush()`` after the streams stopped, unless a
  query failed; ``close()`` always, last.
- Each query writes its own batch log line and metrics (``ctx.metrics``).

A ``StreamedQuery`` runs a Spark stream (``stream``, ``process``).  A ``SteppedQuery``
(``spark_stream`` off) has no Spark stream and no checkpoint: the runner calls its
``step(spark)`` on a thread of its own (``streaming.runtime.follower``), under ``lock``, as soon as a query
that reads the commitlog has processed a batch and at least once a trigger interval.  Its progress
is its sinks' records in the metadata store, and ``step`` applies what the tier committed past
them (or nothing: a step may find nothing to do, or hold a small batch back).
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

from streaming.runtime.checkpoints import Batch
from streaming.settings import Settings

if TYPE_CHECKING:
    from state.kv import KVView
    from state.metadata import MetadataStore
    from streaming.runtime.metrics import Metrics

log = logging.getLogger("tierlog.service")


@dataclass
class RunContext:
    """What a query is built with: the settings, the open stores, and the run's plumbing."""

    settings: Settings
    metadata: MetadataStore
    kv: KVView | None  # when the compaction query runs
    metrics: Metrics
    should_stop: Callable[[], bool]
    until_caught_up: bool = False  # `tierlog run --until-caught-up`: no query holds a batch back
    # compaction.nice where this run started the process's JVM; 0 in a caller's session, whose
    # process is the caller's to prioritise (streaming.runtime.priority)
    compaction_nice: int = 0


class Query(ABC):
    """What the runner knows of every query; a query is a ``StreamedQuery`` or a ``SteppedQuery``."""

    name: ClassVar[str]
    output_mode: ClassVar[str] = "append"
    reads_commitlog: ClassVar[bool] = True
    spark_stream: ClassVar[bool]  # True: a ``StreamedQuery``; False: a ``SteppedQuery``

    @classmethod
    def enabled(cls, settings: Settings) -> bool:
        return True

    @classmethod
    @abstractmethod
    def sinks(cls, settings: Settings) -> list[str]:
        """The sinks it feeds, by the names their progress is kept under."""

    @classmethod
    def guarded_settings(cls, settings: Settings, spark) -> dict[str, str]:
        """Every query's offsets point into one broker's commitlog; subclasses add their own
        (``spark`` None: before the session starts, only those the settings alone give)."""
        return {"broker.name": settings.broker, "commitlog.dir": os.path.abspath(settings.paths.commitlog)}

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.lock = threading.RLock()

    def start(self, committed_end: int | None) -> None:
        """Before the stream starts; ``committed_end``: where Spark's last committed batch ends."""

    def caught_up(self) -> bool:
        """A query over the tier: whether it has applied everything the tier committed."""
        return True

    def tick(self) -> None:
        """Between batches: work a quiet stream still needs (expiring keys, say)."""

    def poll_metrics(self) -> None:
        """Set the gauges no batch report carries; after each ``tick`` and once more at the end."""

    def flush(self) -> None:
        """After the streams stopped cleanly (no query failed): finish what was handed over; an
        error here fails the run."""

    def close(self) -> None:
        """Release what the query holds; always called, last."""


class StreamedQuery(Query):
    """A query that runs a Spark stream with its own checkpoint: the runner writes ``stream`` with
    ``foreachBatch`` and hands each micro-batch to ``process``."""

    spark_stream = True

    @abstractmethod
    def stream(self, spark):
        """The streaming DataFrame the runner writes with ``foreachBatch``."""

    @abstractmethod
    def process(self, batch: Batch) -> None:
        """One micro-batch, under ``lock``; idempotent for a batch Spark runs again after a crash."""


class SteppedQuery(Query):
    """A query without a Spark stream or checkpoint: the runner calls ``step`` on a thread of its own
    (``streaming.runtime.follower``), woken by each tiering batch and once a trigger interval."""

    spark_stream = False
    reads_commitlog = False

    @abstractmethod
    def step(self, spark) -> bool:
        """Apply what the tier committed past this query's sinks' records (``spark`` for the jobs it
        may run), under ``lock``; whether it applied a batch."""


def open_feed(store, consumer: str, applied: int | None, what: str) -> int:
    """List the tier's committed batches for ``consumer`` (a query that reads the tier), whose sink
    has applied through ``applied``; returns its position (``state.tier_feed.TierFeed.open``).  A
    backfill from the tier is said, with what retention already dropped of it."""
    at, backfill = store.feed.open(consumer, store.source_end(), since=applied or 0)
    if backfill is not None:
        expired = sum(1 for q in store.queues() if q.low > 0)
        say = log.warning if expired else log.info
        say("%s what the tier committed from physical offset %d to %d, read from the tier%s", what,
            backfill.start, backfill.end, f"; retention has dropped the oldest messages of {expired} queue(s), "
            "which are not read" if expired else "")
    return at
