"""The compaction query's foreachBatch: Spark finds the changed keys, ``KVWriter`` applies them.

    spark.readStream.format("tierfeed")  (the tier's committed batches; only the columns it needs)
      -> max_per_key (Spark's RocksDB state store; streaming/queries/compaction/latest_per_key.py)
      -> foreachBatch(CompactionHandler.process)

Per micro-batch the handler collects the changed keys (small references, one row per key) to the
driver and hands them, with the offset the batch ends at (from the query's own offset log), to
``state.kv_writer.KVWriter``, which reads their messages from the same committed batches, writes
the view, the changelog and snapshots.  Once a batch is applied the handler releases the tier's
batches before it (``on_applied``).  This module adds only what needs Spark, and the thread the
writer runs on.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from connectors.faults import crash_point
from state.kv import KVView
from state.kv_writer import CompactionReport, CompactionSettings, KVWriter
from connectors.threads import lower_priority, name_native
from streaming.runtime.checkpoints import Batch
from streaming.queries.compaction.latest_per_key import REDUCED_COLUMNS, max_per_key

log = logging.getLogger("tierlog.compaction")


def compaction_stream(spark, options: dict):
    """The streaming DataFrame of changed keys, from the ``tierfeed`` source with ``options``;
    write it with ``outputMode("update")``."""
    messages = (
        spark.readStream.format("tierfeed")
        .options(**{k: str(v) for k, v in options.items() if v is not None})
        .option("columns", ",".join(REDUCED_COLUMNS))
        .option("latestPerKey", "true")  # fewer rows reach the aggregation; max(phy_offset) is the same
        .load()
    )
    return max_per_key(messages)  # the source yields keyed messages that entered a queue only


class CompactionHandler:
    """The foreachBatch of the compaction query.

    The writer's share of a batch runs in two steps off Spark's thread, each on a thread of its
    own: reading the changed keys' messages (``KVWriter.resolve``), then writing the changelog, the
    view and snapshots (the apply thread).  So while batch N is applied, batch N+1's messages are
    read and Spark works on batch N+2.  Batch N+2 waits until N is applied: at most two batches
    are in flight, and they are applied in order.  A batch whose predecessor failed is not applied
    (the error is raised instead).  So Spark may commit up to two batches the view has not applied
    yet: ``catch_up`` closes that gap at start (``KVWriter.catch_up``).  The apply thread is the
    only writer, TTL sweeps included.

    Why two threads: catching up, reading a batch's messages back and applying them took longer
    together than Spark's job for the batch (``docs/benchmarks.md``); on one thread they were the
    longest step, and each batch waited for it.
    """

    def __init__(self, settings: CompactionSettings, kv: KVView, metadata=None,
                 on_batch: Callable[[CompactionReport], None] | None = None,
                 changelog=None, messages=None, on_applied: Callable[[int], None] | None = None,
                 start_at: int | None = None, nice: int = 0):
        self.writer = KVWriter(settings, kv, metadata, changelog, messages)
        self.on_batch = on_batch
        self.on_applied = on_applied  # called with a batch's start once it is applied: Spark will not run below it
        self.start_at = start_at  # where a batch starts whose start the offset log lacks (a new checkpoint's first)
        self.applied_end: int | None = None  # where the last batch this process applied ends
        self.lock = threading.RLock()  # held while a batch is handed over; a graceful stop waits on it
        # ``nice``: both threads, and what they start (the changelog's reads and librdkafka's threads),
        # run behind the tier and the mirror when the cores are full (``streaming.runtime.priority``).
        def started() -> None:
            name_native()
            lower_priority(nice)

        self._apply_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-apply", initializer=started)
        self._resolve_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-resolve", initializer=started)
        self._pending: list[Future] = []  # the batches on the apply thread, oldest first
        self._failed: BaseException | None = None  # what an apply raised: no later batch is applied

    def catch_up(self, committed: int | None) -> int:
        """Before the stream starts: what Spark committed but the view has not applied."""
        self.applied_end = committed
        return self.writer.catch_up(committed)

    def process(self, batch: Batch) -> None:
        name_native("compaction")  # py4j's callback thread, for the cost ledger
        with self.lock:
            t0 = time.monotonic()
            changes = batch.df.toArrow()  # runs this batch's Spark job while the threads work on the last two
            collect_s = time.monotonic() - t0
            crash_point("collected")
            self._settle(keep=1)  # batches reach the view in order; at most two in flight
            start = batch.start if batch.start is not None else self.start_at
            resolving = self._resolve_thread.submit(self._resolve, changes)
            self._pending.append(self._apply_thread.submit(self._apply, batch.batch_id, changes, resolving, start,
                                                           batch.end, collect_s))

    def _resolve(self, changes):
        t0 = time.monotonic()
        return self.writer.resolve(changes), time.monotonic() - t0

    def _apply(self, batch_id: int, changes, resolving: Future, start: int | None, end: int, collect_s: float) -> None:
        if self._failed is not None:  # the batch before was not applied: neither is this one
            raise self._failed
        try:
            report = self.writer.apply(batch_id, changes, end, collect_s, resolved=resolving.result())
        except BaseException as exc:
            self._failed = exc
            raise
        self.applied_end = end
        if self.on_applied is not None and start is not None:
            # Up to this batch's start only: Spark runs this batch again if it stops before committing it.
            self.on_applied(start)
        if self.on_batch:
            self.on_batch(report)

    def _settle(self, keep: int) -> None:
        """Wait until at most ``keep`` batches are on the apply thread; raise what one raised."""
        while len(self._pending) > keep:
            self._pending.pop(0).result()

    def flush(self) -> None:
        """Wait for the batches on the apply thread; raise what they raised."""
        self._settle(keep=0)

    def applied_all(self) -> bool:
        """Whether every batch handed over has been applied (raises what one raised); never waits."""
        if any(not pending.done() for pending in self._pending):
            return False
        self.flush()
        return True

    def tick(self) -> None:
        """Between batches (a quiet stream runs none): expire keys past their time to live, and
        write a snapshot that is due, on the apply thread; never waits for a batch."""
        self.sweep()
        if not self.writer.snapshot_due() or not self.lock.acquire(blocking=False):
            return
        try:
            if self.applied_all():  # nothing on the apply thread: the snapshot is of every batch applied
                self._pending.append(self._apply_thread.submit(self.writer.maybe_snapshot))
        finally:
            self.lock.release()

    def sweep(self) -> int:
        """Expire keys between batches (a quiet stream runs no batches); returns how many expired."""
        if not self.writer.settings.ttl:
            return 0
        with self.lock:
            self.flush()
            return len(self._apply_thread.submit(self.writer.expire).result())

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._apply_thread.shutdown(wait=True)
            self._resolve_thread.shutdown(wait=True)
            self.writer.close()
