"""The mirror query: the tier's committed batches -> Kafka, one record per message.

    the tier commits a batch -> MirrorQuery.step (streaming.runtime.follower, on the driver)
      -> MirrorHandler.process(the tier's committed batches past the ``mirror`` sink's record)

The mirror never reads the commitlog: the tiering query decoded and CRC-checked each message
once, and the mirror reads it back from the staging objects the tier committed
(``connectors.tier.feed``), which the tier keeps until the mirror has sent them
(``state.tier_feed``).  So the mirror does not hold the commitlog's safepoint: a Kafka outage holds
staging objects in the tier instead of the broker's disk.

The ``mirror`` sink's record in the metadata store is the query's only progress (it has no Spark
checkpoint); the driver sends every batch, Spark's executors only a backfill.  Per batch:

1. take the batch's range (``[start, end)``, whole tier batches), less what the ``mirror`` sink's
   record says was sent, and the tier batches listed in it (``TierFeed.batches``).  The range
   is ``streaming.queries.mirror.query.step_end``'s, in the service and in ``bench/bench_kafka.py``;
2. send it from the driver as one slot, without a Spark job (with ``kafka.mirror_process``, from
   a process of its own, ``streaming.queries.mirror.sender_process``; ``kafka.mirror_driver_bytes`` above 0,
   the default; a quiet broker's batch costs far less to send than a job does, a busy one's reaches
   Kafka sooner without waiting for a job behind compaction's, and a catch-up costs about 0.6 of
   the CPU a message); or, for a backfill or with ``kafka.mirror_driver_bytes`` 0, run one Spark
   task per sender slot (``kafka.mirror_tasks``; see ``default_slots``).  Each task
   reads the listed staging objects (the mirror's columns only) and sends only the Kafka
   partitions its slot owns (``slot_of``), with its own idempotent producer, in queue order.  A
   partition therefore has one sender and keeps its order, while the slots run in parallel: two
   kafka-python producers in two processes send about 1.8 times as fast as one here;
3. the driver collects each task's outcome: the positions it reached (handed
   to the next batch's tasks, so they need not read them back), messages
   skipped as too large (recorded in the metadata store), or a failure.  A
   retriable failure (broker away, topic missing) is reported in the log and
   in ``tierlog status`` and the failed slots run again after a backoff,
   reading their positions back from Kafka, until they succeed or a stop is
   requested;
4. record the batch's end as the ``mirror`` sink's applied offset, and release the tier batches
   before the batch's start, which the tier may then delete (a crash before the record runs the
   batch again; Kafka's positions, read back, keep it from being sent twice).

The changelog sink rides on the compaction query instead (see
``streaming.queries.compaction.handler``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from connectors.commitlog.topics import TopicFilter
from connectors.errors import TierlogError
from connectors.faults import crash_point
from connectors.kafka.errors import KafkaSinkError, KafkaUnavailable
from connectors.kafka.settings import KafkaSettings
from connectors.kafka.sink import Health, backoff, close_shared_producer
from connectors.sinks import MIRROR
from connectors.threads import name_native
from connectors.tier.location import open_backend
from connectors.tier.copies import CopySettings
from connectors.tier.feed import FeedBatch
from streaming.queries.mirror.send import OUTCOME_DDL, SendTask, make_sender, send_slot
from streaming.queries.mirror.sender_process import SenderProcess
from streaming.runtime.checkpoints import Batch

log = logging.getLogger("tierlog.mirror")


@dataclass
class MirrorReport:
    batch_id: int
    sent: int
    skipped: int
    bytes: int
    source_end: int
    seconds: float
    attempts: int = 1
    on_driver: bool = False  # sent by the driver (``kafka.mirror_driver_bytes`` above 0), not by Spark's tasks


def default_slots(kafka: KafkaSettings, parallelism: int) -> int:
    """Sender slots under ``kafka.mirror_tasks = 0``: one a core with kafka-python, one per two
    cores with librdkafka.

    Why: kafka-python's sending is Python on one GIL, so a second process nearly doubles it.  A
    librdkafka sender keeps about a core busy by itself (its Python thread and librdkafka's
    threads), and every slot reads the whole batch to find its own rows, so on two cores a second
    slot only competed with the first, for more CPU (docs/benchmarks.md)."""
    return parallelism if kafka.producer == "kafka-python" else max(1, parallelism // 2)


def driver_sized_end(listed: list[FeedBatch], start: int, end: int, driver_bytes: int) -> int:
    """Where a mirror batch from ``start`` ends, of ``[start, end)``'s ``listed`` tier batches: the
    most whole tier batches whose staging objects fit ``driver_bytes`` (at least one), so the driver
    sends it; ``end`` itself for a backfill (Spark's tasks send it), or when ``driver_bytes`` is 0.

    Why: a mirror that fell one tier batch behind found two batches together over ``driver_bytes``,
    and Spark's tasks sent them: a job whose first run starts a Python worker and a producer takes
    many times what the driver's send of a batch takes.  A catch-up is cut the same way, and the
    follower steps again at once: from the driver it runs faster and at less CPU a message than
    from Spark's tasks (docs/benchmarks.md, the mirror on the driver); and a mirror that fell
    behind, sent by the tasks, spent more a message and fell further behind."""
    if not driver_bytes or any(b.backfill for b in listed):
        return end
    cut, taken = start, 0
    for b in listed:
        size = sum(size for _name, size, _first in b.objects)
        if cut > start and taken + size > driver_bytes:
            break
        cut, taken = min(b.end, end), taken + size
    return cut if cut > start else end


class MirrorHandler:
    """What the mirror query's steps run.  One instance per running query, on the driver.
    ``start_at``: where the next batch starts (the ``mirror`` sink's record at the start)."""

    def __init__(self, kafka: KafkaSettings, location: str, metadata, start_at: int, *, tasks: int = 0,
                 should_stop: Callable[[], bool] = lambda: False,
                 on_batch: Callable[[MirrorReport], None] | None = None,
                 topics: TopicFilter | None = None, copies: CopySettings | None = None, driver_bytes: int = 0,
                 process: bool = False):
        self.kafka = kafka
        self.driver_bytes = driver_bytes  # steps are cut to this many bytes of objects and sent here; 0: never
        self._backend = None  # the tier's, for the batches sent here
        # The driver's batches sent from a process of its own (``kafka.mirror_process``), started
        # now beside the service's start, so the first batch does not wait for its imports.
        self._sender = SenderProcess() if process and driver_bytes else None
        if self._sender is not None:
            threading.Thread(target=self._start_sender, name="mirror-sender-start", daemon=True).start()
        self.copies = copies
        self.topics = topics
        self.location = location
        self.metadata = metadata
        self.start_at = start_at
        self.tasks = tasks
        self.should_stop = should_stop
        self.on_batch = on_batch
        self.lock = threading.RLock()  # held while a batch is sent; a graceful stop waits on it
        self.health = Health(MIRROR, lambda h: metadata.journal.record_health(MIRROR, h))
        # What the last batch's tasks reached: the next batch's tasks start from it.
        self._partitions: dict[str, int] = {}
        self._positions: dict[str, int] = {}
        self.sent = 0  # messages sent since start, all batches

    def process(self, batch: Batch, spark=None) -> None:
        """Send ``batch`` (its ``batch_id``, ``start`` and ``end``); ``spark``: the session for the
        batches Spark's tasks send (else the one of the batch's ``df``)."""
        name_native("mirror")  # the thread that runs it, for the cost ledger
        with self.lock:
            started = time.monotonic()
            batch_id, end = batch.batch_id, batch.end
            start = batch.start if batch.start is not None else self.start_at
            report = MirrorReport(batch_id, 0, 0, 0, end, 0.0, 0)
            # A batch Spark runs again because a stop came between its sending and its commit (as
            # --until-caught-up's stop may) was sent in full: the sink is recorded after the sends.
            # Send only past the record, so a filter changed across the restart applies from there.
            recorded = self.metadata.journal.sinks().get(MIRROR)
            first = start if recorded is None else min(max(start, recorded), end)
            if first < end:
                listed = tuple(self.metadata.feed.batches(first, end))
                if any(b.objects or b.backfill for b in listed):
                    self._send(spark or batch.df.sparkSession, first, end, listed, report)
            crash_point("mirrored")
            # A checkpoint rolled back runs a batch that ends below the record: what Kafka holds
            # stays recorded, or the batches after it would be sent again.
            self.metadata.journal.record_sink(MIRROR, end if recorded is None else max(recorded, end))
            # Up to its end: the mirror runs each range once (its follower, no Spark batch to run it
            # again), and the record above is where a restart starts.
            self.metadata.feed.release(MIRROR, end)
            self.start_at = end
            self.sent += report.sent
            report.seconds = time.monotonic() - started
            if self.on_batch:
                self.on_batch(report)

    def _send(self, spark, start: int, end: int, listed: tuple[FeedBatch, ...], report: MirrorReport) -> None:
        report.on_driver = self._fits_driver(listed)
        # One slot owns every partition: positions handed between batches stay valid whoever sends.
        slots_total = 1 if report.on_driver else self.tasks or default_slots(
            self.kafka, spark.sparkContext.defaultParallelism)
        pending = list(range(slots_total))
        attempt = 0
        while pending:
            task = SendTask(self.kafka, self.location, listed, start, end, slots_total, dict(self._partitions),
                            dict(self._positions), self.topics, self.copies)
            if report.on_driver and self._sender is not None:
                outcomes = [self._sender.send(task)]
            elif report.on_driver:
                if self._backend is None:
                    self._backend = open_backend(self.location, copies=self.copies)
                outcomes = [send_slot(task, 0, self._backend)]
            else:
                outcomes = (spark.range(0, len(pending), 1, len(pending))
                            .mapInArrow(make_sender(task, pending), OUTCOME_DDL).toArrow().to_pylist())
            report.attempts += 1
            failed = self._collect(outcomes, report)
            if not failed:
                self.health.ok()
                return
            pending = sorted(o["slot"] for o in failed)
            fatal = [o for o in failed if not o["retriable"]]
            if fatal:
                raise KafkaSinkError(fatal[0]["error"])
            attempt = backoff(attempt, KafkaUnavailable(failed[0]["error"]), self.health, self.should_stop)

    def _fits_driver(self, listed: tuple[FeedBatch, ...]) -> bool:
        """Whether the driver sends this batch: unless ``driver_bytes`` is 0 or it holds a backfill
        (whose size is not listed: Spark's tasks send it).  A step is cut to ``driver_bytes``
        (``driver_sized_end``) but holds at least one tier batch, which may be larger: the driver
        reads it one staging object at a time, so it sends it too."""
        return bool(self.driver_bytes) and not any(b.backfill for b in listed)

    def _start_sender(self) -> None:
        try:
            self._sender.start()
        except TierlogError as exc:  # the first batch tries again and fails with it
            log.warning("%s", exc)

    def close(self) -> None:
        """Release what the batches sent here held: the sender process, the tier's backend, the
        driver's producer."""
        if self._sender is not None:
            self._sender.close()
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        close_shared_producer(self.kafka)

    def _collect(self, outcomes: list[dict], report: MirrorReport) -> list[dict]:
        """Take in what each task reached; returns the failed ones."""
        failed = []
        for o in outcomes:
            report.sent += o["sent"]
            report.skipped += o["skipped"]
            report.bytes += o["bytes"]
            for phy, why in json.loads(o["too_large"]):
                log.warning("mirror: skipped the message at physical offset %d: too large for Kafka (%s)", phy, why)
                self.metadata.journal.record_skip(MIRROR, phy, why)
            self._partitions.update(json.loads(o["partitions"]))
            if o["error"] is None:
                self._positions.update(json.loads(o["positions"]))
            else:
                failed.append(o)
        if failed:
            # What a failed task got to is unknown, so the retry must read positions back; a sink
            # reads them back only for topics whose partition count it does not know, so forget both
            # (the chaos harness found every record of a failed slot sent twice when counts stayed).
            self._positions.clear()
            self._partitions.clear()
        return failed
