"""The mirror query: commitlog -> Kafka, one record per message.

    spark.readStream.format("commitlog")  (references only: physical offset and size)
      -> foreachBatch(MirrorHandler.process)

Spark gives the query its micro-batches, admission control and checkpoint,
and the executors do the sending.  Per batch:

1. take the batch's byte range, which the runner reads from the query's
   offset log (where the batch before it ended, and where it ends);
2. run one Spark task per sender slot (``kafka.mirror_tasks``; see ``default_slots``).  Each task
   reads the batch's byte range from the commitlog with the Arrow fast path
   and sends only the Kafka partitions its slot owns (``slot_of``), with its
   own idempotent producer, in physical order.  A partition therefore has one
   sender and keeps its order, while the slots run in parallel: two
   kafka-python producers in two processes send about 1.8 times as fast as
   one here;
3. the driver collects each task's outcome: the positions it reached (handed
   to the next batch's tasks, so they need not read them back), messages
   skipped as too large (recorded in the metadata store), or a failure.  A
   retriable failure (broker away, topic missing) is reported in the log and
   in ``tierlog status`` and the failed slots run again after a backoff,
   reading their positions back from Kafka, until they succeed or a stop is
   requested;
4. record the batch's end as the ``mirror`` sink's applied offset, which
   bounds the safepoint.

The changelog sink rides on the compaction query instead (see
``streaming.kv_handler``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow as pa

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.topics import TopicFilter
from connectors.kafka.errors import KafkaSinkError, KafkaUnavailable
from connectors.kafka.mirror_sink import MIRROR_COLUMNS, MirrorSink, slot_of
from connectors.kafka.settings import KafkaSettings
from connectors.kafka.sink import Health, backoff
from streaming.checkpoints import Batch
from connectors.faults import crash_point
from connectors.sinks import MIRROR

log = logging.getLogger("tierlog.mirror")

OUTCOME_DDL = ("slot int, sent bigint, skipped bigint, bytes bigint, partitions string, positions string, "
               "too_large string, error string, retriable boolean")


@dataclass
class MirrorReport:
    batch_id: int
    sent: int
    skipped: int
    bytes: int
    source_end: int
    seconds: float
    attempts: int = 1


@dataclass(frozen=True)
class SendTask:
    """What one sender task needs; pickled into the Spark job."""

    kafka: KafkaSettings
    reader: ReaderOptions
    start: int
    end: int
    slots: int
    partitions: dict  # Kafka topic -> partition count, where known
    positions: dict  # "topic\x00partition" -> position, where known
    topics: TopicFilter | None = None  # the messages of the topics it accepts are sent


def send_slot(task: SendTask, slot: int) -> dict:
    """Send the partitions ``slot`` owns of ``[task.start, task.end)``; the outcome as one row."""
    too_large: list = []
    sink = MirrorSink(task.kafka, owns=lambda topic, p: slot_of(topic, p, task.slots) == slot,
                      on_skip=lambda phy, why: too_large.append([phy, why]), shared_producer=True,
                      topics=task.topics)
    sink.seed(task.partitions, {tuple(_split(k)): v for k, v in task.positions.items()})
    error, retriable = None, False
    try:
        with task.reader.open() as reader:
            sink.publish(lambda: reader.record_batches(
                task.start, task.end, key_property=task.reader.key_property, columns=MIRROR_COLUMNS), once=True)
    except KafkaSinkError as exc:
        error, retriable = str(exc), exc.retriable
    finally:
        sink.close()
    partitions, positions = sink.known()
    owned = {f"{t}\x00{p}": v for (t, p), v in positions.items() if slot_of(t, p, task.slots) == slot}
    return {"slot": slot, "sent": sink.stats.sent, "skipped": sink.stats.skipped, "bytes": sink.stats.bytes,
            "partitions": json.dumps(partitions), "positions": json.dumps(owned),
            "too_large": json.dumps(too_large), "error": error, "retriable": retriable}


def default_slots(kafka: KafkaSettings, parallelism: int) -> int:
    """Sender slots under ``kafka.mirror_tasks = 0``: one a core with kafka-python, one per two
    cores with librdkafka.

    Why: kafka-python's sending is Python on one GIL, so a second process nearly doubles it.  A
    librdkafka sender keeps about a core busy by itself (1.06 cores: its Python thread and
    librdkafka's threads), and every slot decodes the whole batch to find its own rows, so on two
    cores a second slot only competed with the first: the query at 1 KB on tansu, four rounds
    alternating, 50-63k messages/s with one slot against 49-54k with two, at half the CPU."""
    return parallelism if kafka.producer == "kafka-python" else max(1, parallelism // 2)


def _split(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition("\x00")
    return topic, int(partition)


def make_sender(task: SendTask, slots: list[int]):
    """The mapInArrow function over ``spark.range(len(slots))``: row i sends slot ``slots[i]``."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column("id").to_pylist():
                yield pa.RecordBatch.from_pylist([send_slot(task, slots[index])], schema=_OUTCOME_SCHEMA)

    return run


_OUTCOME_SCHEMA = pa.schema([("slot", pa.int32()), ("sent", pa.int64()), ("skipped", pa.int64()),
                             ("bytes", pa.int64()), ("partitions", pa.string()), ("positions", pa.string()),
                             ("too_large", pa.string()), ("error", pa.string()), ("retriable", pa.bool_())])


class MirrorHandler:
    """The foreachBatch of the mirror query.  One instance per running query, on the driver."""

    def __init__(self, kafka: KafkaSettings, reader: ReaderOptions, metadata=None, *, tasks: int = 0,
                 should_stop: Callable[[], bool] = lambda: False,
                 on_batch: Callable[[MirrorReport], None] | None = None,
                 topics: TopicFilter | None = None):
        self.kafka = kafka
        self.topics = topics
        self.reader = reader
        self.metadata = metadata
        self.tasks = tasks
        self.should_stop = should_stop
        self.on_batch = on_batch
        self.lock = threading.RLock()  # held while a batch is sent; a graceful stop waits on it
        self.health = Health(MIRROR, None if metadata is None else
                             lambda h: metadata.journal.record_health(MIRROR, h))
        # What the last batch's tasks reached: the next batch's tasks start from it.
        self._partitions: dict[str, int] = {}
        self._positions: dict[str, int] = {}
        self.sent = 0  # messages sent since start, all batches

    def process(self, batch: Batch) -> None:
        with self.lock:
            started = time.monotonic()
            batch_id, df, end = batch.batch_id, batch.df, batch.end
            start = batch.start if batch.start is not None else self._first_reference(df)
            report = MirrorReport(batch_id, 0, 0, 0, end, 0.0, 0)
            if start is not None and start < end:
                self._send(df.sparkSession, start, end, report)
            crash_point("mirrored")
            if self.metadata is not None:
                self.metadata.journal.record_sink(MIRROR, end)
            self.sent += report.sent
            report.seconds = time.monotonic() - started
            if self.on_batch:
                self.on_batch(report)

    @staticmethod
    def _first_reference(df) -> int | None:
        """The first physical offset of a batch whose start the offset log lacks; None when empty."""
        from pyspark.sql import functions as F

        return df.agg(F.min("phy_offset")).first()[0]

    def _send(self, spark, start: int, end: int, report: MirrorReport) -> None:
        slots_total = self.tasks or default_slots(self.kafka, spark.sparkContext.defaultParallelism)
        pending = list(range(slots_total))
        attempt = 0
        while pending:
            task = SendTask(self.kafka, self.reader, start, end, slots_total, dict(self._partitions),
                            dict(self._positions), self.topics)
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

    def _collect(self, outcomes: list[dict], report: MirrorReport) -> list[dict]:
        """Take in what each task reached; returns the failed ones."""
        failed = []
        for o in outcomes:
            report.sent += o["sent"]
            report.skipped += o["skipped"]
            report.bytes += o["bytes"]
            for phy, why in json.loads(o["too_large"]):
                log.warning("mirror: skipped the message at physical offset %d: too large for Kafka (%s)", phy, why)
                if self.metadata is not None:
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
