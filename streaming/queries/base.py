"""What every streaming query of ``tierlog run`` is, to the runner (``streaming.service``).

A query reads the ``commitlog`` source and hands each micro-batch to its
outputs (the tier, the KV view, a Kafka topic).  The runner knows queries only
through :class:`Query`: it starts each one's stream with its own checkpoint,
hands every batch its offset range, calls ``tick`` between batches, and on a
stop waits for the batch in flight (by taking ``lock``), then calls ``flush``
and ``close``.  Nothing in the runner branches on a query's name, so a new
query is one new module and one line in ``streaming.plan.QUERIES``.

Contract of a query:

- ``name``: its checkpoint directory under ``checkpoint.dir``, its ``query``
  label in metrics and log lines.  Changing it abandons its checkpoint.
- ``sinks(conf)``: the sinks (outputs) it feeds, by the names the metadata
  store records their progress under (``tier``, ``kv``, ``changelog``,
  ``mirror``); each sink's applied offset bounds the safepoint, and so does
  this query's last committed batch, if the query ``reads_commitlog``.  A query
  that does not consumes the tier's committed batches instead (``state.tier_feed``),
  which the tier keeps for it; under ``--until-caught-up`` it runs on its
  trigger and is stopped once the commitlog's readers are done and it is
  ``caught_up()``.
- ``guarded_settings(conf, spark)``: the settings its checkpoint depends on;
  a start with other values is refused (``streaming.runtime.checkpoints``).
- ``start(committed_end)`` runs before the stream starts (catch up what Spark committed
  but an output has not applied); ``process(batch)`` runs on Spark's
  foreachBatch thread, under ``lock``, and must be idempotent for a batch
  Spark runs again after a crash; ``tick()`` and ``poll_metrics()`` run on the
  runner's thread about once per trigger interval (``poll_metrics`` also once
  after the streams stopped); ``flush()`` after the streams stopped, unless a
  query failed; ``close()`` always, last.
- Each query writes its own batch log line and metrics (``ctx.metrics``).

A query with ``spark_stream`` off has no Spark stream and no checkpoint: the runner calls its
``step(spark)`` on a thread of its own (``streaming.runtime.follower``), under ``lock``, as soon as a query
that reads the commitlog has processed a batch and at least once a trigger interval.  Its progress
is its sinks' records in the metadata store, and ``step`` applies what the tier committed past
them (or nothing: a step may find nothing to do, or hold a small batch back).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, ClassVar

from streaming import config as cfg
from streaming.runtime.checkpoints import Batch

log = logging.getLogger("tierlog.service")


@dataclass
class RunContext:
    """What a query is built with: the settings, the open stores, and the run's plumbing."""

    conf: cfg.Config
    settings: object  # streaming.settings.Settings: conf's settings, parsed
    metadata: object  # state.metadata.MetadataStore
    kv: object | None  # state.kv.KVView, when the compaction query runs
    metrics: object  # streaming.runtime.metrics.Metrics
    should_stop: Callable[[], bool]
    source_options: dict  # the commitlog source's options
    kafka: object | None  # connectors.kafka.settings.KafkaSettings, None when Kafka is off
    until_caught_up: bool = False  # `tierlog run --until-caught-up`: no query holds a batch back
    # compaction.nice where this run started the process's JVM; 0 in a caller's session, whose
    # process is the caller's to prioritise (streaming.runtime.priority)
    compaction_nice: int = 0


class Query:
    name: ClassVar[str]
    output_mode: ClassVar[str] = "append"
    reads_commitlog: ClassVar[bool] = True
    spark_stream: ClassVar[bool] = True  # False: run by ``step``, without a Spark stream (see above)

    @classmethod
    def enabled(cls, conf: cfg.Config) -> bool:
        return True

    @classmethod
    def sinks(cls, conf: cfg.Config) -> list[str]:
        return []

    @classmethod
    def guarded_settings(cls, conf: cfg.Config, spark) -> dict[str, str]:
        """Every query's offsets point into one broker's commitlog; subclasses add their own."""
        return {"broker.name": conf.broker.name, "commitlog.dir": os.path.abspath(conf.commitlog.dir)}

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.lock = threading.RLock()

    def stream(self, spark):
        """The streaming DataFrame the runner writes with ``foreachBatch``."""
        raise NotImplementedError

    def start(self, committed_end: int | None) -> None:
        """Before the stream starts; ``committed_end``: where Spark's last committed batch ends."""

    def process(self, batch: Batch) -> None:
        raise NotImplementedError

    def step(self, spark) -> bool:
        """A query without a Spark stream: apply what is there (``spark`` for the jobs it may run);
        whether it applied a batch."""
        raise NotImplementedError

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
