"""The tiering query's foreachBatch: Spark stages, ``TierWriter`` commits.

Per micro-batch (``TieringHandler.process``):

1. **stage** (executors): each Spark partition is a range of commitlog references; its task
   stages that byte range itself (``connectors.tier.staging.stage``: Arrow fast path, one object)
   and yields one ``StagedPart`` row.  Only (physical offset, size) references travel through
   Spark, as in RocketMQ's dispatcher, which hands the uploader references, never bodies.
   A batch that fits in one task (``tier.stage_on_driver``) is staged by the driver instead,
   from the batch's offset range, with no Spark job: the job's own cost was most of a small
   batch's time, so of a message's time to become visible (docs/benchmarks.md).  A larger one
   (catching up), under a local Spark master, is cut the same way and staged by the driver's own
   processes, one a core (``tier.stage_in_processes``; ``connectors.tier.stage_pool``), which
   stage the batch expected next behind it (``expect``; the first one from the query's start), so
   Spark's steps between batches no longer leave both cores waiting; a guess a batch does not
   hold is deleted before that batch stages anything.
2. **commit**, then **maintain** (driver): ``connectors.tier.writer.TierWriter`` does both; this
   module adds only what needs Spark, the batch's timing and its report, and runs the maintenance
   beside the next batch's stage.

Rows below the tier's ``source_end`` are dropped before staging, so a replayed batch, or a new
checkpoint that starts over, stages and commits nothing twice.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import pyarrow as pa

from connectors.tier.stage_pool import StagePool
from connectors.tier.staging import CommitLogGaps, StagedPart, StageSettings, stage, stage_range
from connectors.tables.catalog import TableSettings
from connectors.task_cpu import counted
from connectors.threads import name_native
from connectors.tier.writer import TierWriter, WriterSettings

log = logging.getLogger("tierlog.tier")
# Between batches, a maintenance at most this often: what it waits on (a seal by age, a table
# commit held for more rows) is due in seconds, and each round re-plans every table.
TICK_MAINTAIN_S = 1.0

if TYPE_CHECKING:
    from connectors.commitlog.reader import CommitLogReader
    from streaming.runtime.checkpoints import Batch


@dataclass(frozen=True)
class TieringSettings:
    stage: StageSettings
    writer: WriterSettings
    tables: TableSettings | None = None
    driver_stage_bytes: int = 0  # a batch of at most this many bytes is staged by the driver; 0: never
    stage_processes: int = 0  # a larger batch is staged by this many processes of the driver's; 0: Spark's tasks
    split_bytes: int = 32 << 20  # the ranges those processes are handed (source.partition_bytes)


def open_tables(settings: TieringSettings):
    if settings.tables is None:
        return None
    from connectors.tables.messages import MessageTables  # pyiceberg loads only when tables are on

    return MessageTables(settings.tables, settings.writer.location, settings.writer.broker)


def make_stager(settings: StageSettings, floor: int):
    """The mapInArrow function: the partition's references at or above ``floor`` -> one summary row."""

    def stager(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        lo = hi = last = None
        for b in batches:
            if b.num_rows == 0:
                continue
            phy = b.column("phy_offset").to_numpy()
            end = phy + b.column("size").to_numpy()
            keep = phy >= floor
            if not keep.any():
                continue
            blo, bhi = int(phy[keep].min()), int(end[keep].max())
            lo = blo if lo is None else min(lo, blo)
            if hi is None or bhi > hi:
                hi, last = bhi, int(phy[keep][np.argmax(end[keep])])
        if lo is not None:
            part = stage(settings, lo, hi, last)
            yield pa.RecordBatch.from_pylist([part.to_row()], schema=StagedPart.SCHEMA)

    return lambda batches: counted("stage", stager(batches))


@dataclass
class BatchReport:
    batch_id: int
    rows: int = 0
    bytes: int = 0
    objects: int = 0
    seals: int = 0  # by the last batch's maintenance
    source_end: int | None = None
    max_store_ts: int | None = None
    seconds: float = 0.0
    replay: bool = False
    staged_by: str = "spark"  # or "driver" (``tier.stage_on_driver``), or "processes" (``tier.stage_in_processes``)
    read_on_driver: int = 0  # records the driver read for it: Spark, which read none, counts 0 input rows
    phases: dict | None = None  # seconds per step: stage (Spark job + uploads), wait (for the last batch's
    # maintenance), dispatch, commit; and maintain, the last batch's maintenance (it ran beside this one)
    uploads: list | None = None  # (kind, seconds) per object written: staging, segment, key_index


class TieringHandler:
    """The foreachBatch of the tiering query.  One instance per running query, on the driver.

    A batch's maintenance (seals, retention, deletes, folds) runs on a thread of its own after the
    batch committed, so the next batches' stages and commits overlap it: it holds ``writer_lock``
    only to plan a seal and to commit it (with retention, deletes and folds), not while the seal
    reads its staging objects and writes its segments, which on a quiet broker takes seconds every
    ``tier.segment_age_s``.  A message is visible as soon as its batch commits, never after a seal
    of other queues.  One maintenance runs at a time, the next starts after the batch that finds
    the last one done, and its seals and seconds are in that batch's report.
    """

    def __init__(self, settings: TieringSettings, metadata, on_batch=None,
                 expect: Callable[[int], tuple[int, tuple[int, ...]]] | None = None,
                 header_reader: Callable[[], CommitLogReader] | None = None):
        self.settings = settings
        self.writer = TierWriter(settings.writer, metadata, tables=open_tables(settings))
        self.gaps = CommitLogGaps(settings.stage.reader)
        self.lock = threading.RLock()  # held while a batch is processed; graceful stop waits on it
        self.writer_lock = threading.Lock()  # the writer is not thread-safe: a commit or a maintenance
        self.on_batch = on_batch
        self.pool = StagePool(settings.stage, settings.stage_processes, settings.split_bytes, header_reader) \
            if settings.stage_processes else None
        self._maintenance = ThreadPoolExecutor(1, thread_name_prefix="tier-maintain", initializer=name_native)
        self._maintained: Future | None = None  # the last batch's maintenance: (seals, seconds)
        self._idle_seals = 0  # seals of maintenances run between batches (``tick``), for the next report
        self._maintain_started = 0.0  # monotonic: when the last maintenance was handed to its thread
        self.expect = expect  # begin -> (end, splits) of the batch the stream is expected to run from there

    def start_behind(self, begin: int, end: int) -> None:
        """When tiering resumes at ``begin`` with the log's end at ``end`` and more lies between
        (above the tier's end, whose rows are not staged again) than the driver stages in one batch,
        start staging the first batch now (``expect``), else at least the staging processes: Spark
        plans that batch meanwhile, about 2 s of a first batch's 4 s before it reaches
        :meth:`process` (docs/benchmarks.md)."""
        begin = max(begin, self.writer.source_end or 0)
        if self.pool is None or end - begin <= self.settings.driver_stage_bytes:
            return
        expected = self._batch_expected(begin)
        if expected is not None:
            self.pool.stage_ahead(*expected)
        else:
            self.pool.warm()

    def _batch_expected(self, begin: int) -> tuple[int, int, tuple[int, ...]] | None:
        """The batch expected from ``begin`` (its start, end and splits) when the staging processes
        would stage it; None when there is no such guess or the driver would stage that batch
        itself.  Staged ahead, a batch that turns out otherwise only costs the staging of the
        ranges it does not hold (``StagePool.drop_ahead``)."""
        if self.expect is None:
            return None
        try:
            end, splits = self.expect(begin)
        except Exception as exc:  # noqa: BLE001 - only a guess: the batch itself meets what failed here
            log.debug("no batch expected from commitlog offset %d: %s", begin, exc)
            return None
        return (begin, end, splits) if end - begin > self.settings.driver_stage_bytes else None

    def process(self, batch: Batch) -> None:
        name_native("tiering")  # py4j's callback thread, for the cost ledger
        with self.lock:
            started = time.monotonic()
            report = self._process(batch)
            report.seconds = time.monotonic() - started
            if self.on_batch:
                self.on_batch(report)

    def _process(self, batch: Batch) -> BatchReport:
        self._check_maintenance()
        report = BatchReport(batch.batch_id, phases={})
        clock = _Clock(report.phases)
        floor = self.writer.source_end if self.writer.source_end is not None else 0  # only commits move it
        staged = self._stage_on_driver(batch, floor)
        if staged is None:
            rows = batch.df.mapInArrow(make_stager(self.settings.stage, floor), StagedPart.DDL).toArrow().to_pylist()
            parts = [StagedPart.from_row(r) for r in rows]
        else:
            parts, report.read_on_driver, report.staged_by = staged
        clock.lap("stage")
        with self.writer_lock:
            clock.lap("wait")  # for a maintenance's planning or commit, if one holds the writer
            report.seals, report.phases["maintain"] = self._maintenance_taken()
            try:
                committed = self.writer.commit(batch.batch_id, parts, self.gaps.between, clock.lap)
            finally:
                report.uploads, self.writer.uploads = self.writer.uploads, []
        if committed is None:
            report.replay = True
            return report
        report.rows, report.bytes, report.objects = committed.rows, committed.bytes, committed.objects
        report.source_end, report.max_store_ts = committed.source_end, committed.max_store_ts
        if self._maintained is None:  # none running: the last one's result was taken above
            self._submit_maintenance()
        return report

    def _stage_on_driver(self, batch: Batch, floor: int) -> tuple[list[StagedPart], int, str] | None:
        """The batch's parts staged from its offset range without a Spark job, the records read and
        who staged them: the driver itself when the batch fits in ``driver_stage_bytes``, else the
        stage pool's processes, which take what they staged ahead for exactly its ranges.  None when Spark's tasks should stage it (the settings off, or the
        range not known: an offset log Spark purged, or a checkpoint from before the offset log
        recorded batch starts)."""
        start = None if batch.start is None else max(batch.start, floor)  # below the floor: tiered already
        limit = self.settings.driver_stage_bytes
        if self.pool is not None and start is not None and batch.end - start > limit:
            parts, records = self.pool.stage(start, batch.end, ahead=lambda: self._batch_expected(batch.end))
            return parts, records, "processes"
        if self.pool is not None:
            self.pool.drop_ahead()  # before anything of this batch is staged: a guess may share a name
        if start is None:
            return None
        if batch.end <= start:
            return [], 0, "driver"
        if limit and batch.end - start <= limit:
            part, records = stage_range(self.settings.stage, start, batch.end)
            return ([part] if part is not None else []), records, "driver"
        return None

    def _maintain(self) -> tuple[int, float]:
        started, now_ms = time.monotonic(), int(time.time() * 1000)
        with self.writer_lock:
            plan = self.writer.plan_seal(now_ms)
        built = self.writer.build_seal(plan)  # commits go on meanwhile
        with self.writer_lock:  # its own clock: the seal retires its staging objects now, not when planned
            seals = self.writer.finish_seal(built, int(time.time() * 1000))
            view = self.writer.table_view()
        self.writer.sync_tables(view)  # commits go on meanwhile
        with self.writer_lock:
            self.writer.finish_maintenance(int(time.time() * 1000))
        return seals, round(time.monotonic() - started, 3)

    def tick(self) -> None:
        """Between batches (the runner's clock): a maintenance when none runs, so that a broker that
        went quiet still seals by age and its tables still take the rows they held back to fill a
        commit.  Never waits: a batch in hand, or a maintenance running, is left alone; nor runs
        one within ``TICK_MAINTAIN_S`` of the last (each batch runs one: the clock only fills gaps)."""
        if time.monotonic() - self._maintain_started < TICK_MAINTAIN_S or not self.lock.acquire(blocking=False):
            return
        try:
            done = self._maintained
            if done is not None and not done.done():
                return
            if done is not None:
                if done.exception() is not None:
                    return  # the next batch raises it, as it would have
                seals, seconds = done.result()
                self._idle_seals += seals
            self._submit_maintenance()
        finally:
            self.lock.release()

    def _submit_maintenance(self) -> None:
        self._maintain_started = time.monotonic()
        self._maintained = self._maintenance.submit(self._maintain)

    def _maintenance_taken(self) -> tuple[int, float]:
        """The last maintenance's seals and seconds once it has finished, (0, 0.0) while it runs
        (the caller holds the writer lock, which the maintenance may be waiting for: never wait on
        it here)."""
        done = self._maintained
        seals, self._idle_seals = self._idle_seals, 0  # those of maintenances the clock ran between batches
        if done is None or not done.done():
            return seals, 0.0
        self._maintained = None
        more, seconds = done.result()
        return seals + more, seconds

    def _maintenance_finished(self) -> None:
        """Wait for the maintenance that runs, without the writer lock (its last step takes it)."""
        done, self._maintained = self._maintained, None
        if done is not None:
            done.result()

    def _check_maintenance(self) -> None:
        """A maintenance that failed fails the batch after it, as it would have failed its own."""
        if self._maintained is not None and self._maintained.done() and self._maintained.exception() is not None:
            self._maintained.result()

    def flush(self) -> None:
        """On a clean stop: finish the last maintenance and any reconciliation of the tables, fold the
        records since the last root, so readers and the next start read a root and nothing after it,
        and delete what is past its grace (the consumers of the tier have stopped by now: what the
        last maintenance retired was still held by them then)."""
        with self.lock:
            self._maintenance_finished()
            self.writer.settle_tables()  # no commit runs now: the stream has stopped
            with self.writer_lock:
                now_ms = int(time.time() * 1000)
                self.writer.fold(now_ms)
                try:
                    self.writer.delete_due(now_ms)
                except Exception as exc:  # noqa: BLE001 - garbage only: the stop stays clean
                    log.warning("objects the tier retired were not deleted at this stop (%s: %s); they stay "
                                "listed for deletion, and the next start deletes them", type(exc).__name__, exc)

    def close(self) -> None:
        self._maintenance.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()
        self.writer.close()


class _Clock:
    """Seconds spent per step of a batch, for the batch's log line."""

    def __init__(self, into: dict):
        self.into, self.last = into, time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.into[name] = round(now - self.last, 3)
        self.last = now


def refs_stream(spark, opts: dict):
    """The tiering and mirror queries' input: references (physical offset, size) to the commitlog's records."""
    reader = spark.readStream.format("commitlog").option("refsOnly", "true")
    for key, value in opts.items():
        if value is not None:
            reader = reader.option(key, str(value))
    return reader.load()
