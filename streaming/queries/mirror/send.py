"""One sender slot's send of a mirror batch: what the driver, the sender process
(``streaming.queries.mirror.sender_process``) and Spark's tasks all run.

Contract: ``send_slot(task, slot)`` sends the Kafka partitions ``slot`` owns (``slot_of``) of the
tier batches in ``[task.start, task.end)``, read back from their staging objects (the mirror's
columns only, no commitlog read), with its own idempotent producer, in queue order, past the
positions ``task`` hands it; it returns one outcome row (``OUTCOME_DDL``): what it sent and
skipped, the positions it reached, and a failure as text with its ``retriable`` flag.  It raises
only an error no retry would mend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa

from connectors.commitlog.topics import TopicFilter
from connectors.errors import TierlogError
from connectors.kafka.errors import KafkaSinkError
from connectors.kafka.mirror_sink import MIRROR_COLUMNS, MirrorSink, slot_of
from connectors.kafka.settings import KafkaSettings
from connectors.task_cpu import counted
from connectors.tier.location import open_backend
from connectors.tier.copies import CopySettings
from connectors.tier.feed import FeedBatch, read_unsorted


OUTCOME_DDL = ("slot int, sent bigint, skipped bigint, bytes bigint, partitions string, positions string, "
               "too_large string, error string, retriable boolean")


@dataclass(frozen=True)
class SendTask:
    """What one sender task needs; pickled into the Spark job."""

    kafka: KafkaSettings
    location: str  # the tier's
    batches: tuple[FeedBatch, ...]  # the tier batches of [start, end)
    start: int
    end: int
    slots: int
    partitions: dict  # Kafka topic -> partition count, where known
    positions: dict  # "topic\x00partition" -> position, where known
    topics: TopicFilter | None = None  # the messages of the topics it accepts are sent
    copies: CopySettings | None = None  # the stagers' local copies, read where they are


def send_slot(task: SendTask, slot: int, backend=None) -> dict:
    """Send the partitions ``slot`` owns of ``[task.start, task.end)``; the outcome as one row.
    ``backend``: the tier's, open (the driver keeps one); else one is opened and closed here."""
    too_large: list = []
    sink = MirrorSink(task.kafka, owns=lambda topic, p: slot_of(topic, p, task.slots) == slot,
                      on_skip=lambda phy, why: too_large.append([phy, why]), shared_producer=True,
                      topics=task.topics)
    sink.seed(task.partitions, {tuple(_split(k)): v for k, v in task.positions.items()})
    error, retriable = None, False
    tier = backend or open_backend(task.location, copies=task.copies)
    try:
        sink.publish(lambda: read_unsorted(tier, task.batches, task.start, task.end, MIRROR_COLUMNS,
                                           broker=task.kafka.broker), once=True)
    except KafkaSinkError as exc:
        error, retriable = str(exc), exc.retriable
    except TierlogError as exc:
        if not exc.retriable:
            raise
        error, retriable = f"reading the tier's staging objects back: {exc}", True  # S3 away: waited out as Kafka is
    finally:
        sink.close()
        if backend is None:
            tier.close()
    partitions, positions = sink.known()
    owned = {f"{t}\x00{p}": v for (t, p), v in positions.items() if slot_of(t, p, task.slots) == slot}
    return {"slot": slot, "sent": sink.stats.sent, "skipped": sink.stats.skipped, "bytes": sink.stats.bytes,
            "partitions": json.dumps(partitions), "positions": json.dumps(owned),
            "too_large": json.dumps(too_large), "error": error, "retriable": retriable}


def _split(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition("\x00")
    return topic, int(partition)


def make_sender(task: SendTask, slots: list[int]):
    """The mapInArrow function over ``spark.range(len(slots))``: row i sends slot ``slots[i]``."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column("id").to_pylist():
                yield pa.RecordBatch.from_pylist([send_slot(task, slots[index])], schema=_OUTCOME_SCHEMA)

    return lambda batches: counted("mirror send", run(batches))


_OUTCOME_SCHEMA = pa.schema([("slot", pa.int32()), ("sent", pa.int64()), ("skipped", pa.int64()),
                             ("bytes", pa.int64()), ("partitions", pa.string()), ("positions", pa.string()),
                             ("too_large", pa.string()), ("error", pa.string()), ("retriable", pa.bool_())])
