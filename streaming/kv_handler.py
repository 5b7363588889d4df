"""The compaction query's foreachBatch: Spark finds the changed keys, ``KVWriter`` applies them.

    spark.readStream.format("tierfeed")  (the tier's committed batches; only the columns it needs)
      -> latest_per_key (Spark's RocksDB state store; streaming/latest_per_key.py)
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
from connectors.threads import name_native
from streaming.checkpoints import Batch
from streaming.latest_per_key import SOURCE_COLUMNS, latest_per_key

log = logging.getLogger("tierlog.compaction")


def compaction_stream(spark, options: dict):
    """The streaming DataFrame of changed keys, from the ``tierfeed`` source with ``options``;
    write it with ``outputMode("update")``."""
    messages = (
        spark.readStream.format("tierfeed")
        .options(**{k: str(v) for k, v in options.items() if v is not None})
        .option("columns", ",".join(SOURCE_COLUMNS))
        .option("latestPerKey", "true")  # fewer rows reach the aggregation; max(phy_offset) is the same
        .load()
    )
    return latest_per_key(messages)


class CompactionHandler:
    """The foreachBatch of the compaction query.

    The writer's share of a batch (reading the changed messages, writing the view, snapshots) runs
    on one apply thread, overlapped with Spark's work on the next batch; at most one batch is in
    flight there, and the next batch waits for it.  So Spark may commit a batch the view has not
    applied yet: ``catch_up`` closes that gap at start (``KVWriter.catch_up``).  The apply thread
    is the only user of the writer, TTL sweeps included.
    """

    def __init__(self, settings: CompactionSettings, kv: KVView, metadata=None,
                 on_batch: Callable[[CompactionReport], None] | None = None,
                 changelog=None, messages=None, on_applied: Callable[[int], None] | None = None,
                 start_at: int | None = None):
        self.writer = KVWriter(settings, kv, metadata, changelog, messages)
        self.on_batch = on_batch
        self.on_applied = on_applied  # called with a batch's start once it is applied: Spark will not run below it
        self.start_at = start_at  # where a batch starts whose start the offset log lacks (a new checkpoint's first)
        self.applied_end: int | None = None  # where the last batch this process applied ends
        self.lock = threading.RLock()  # held while a batch is handed over; a graceful stop waits on it
        self._apply_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-apply", initializer=name_native)
        self._pending: Future | None = None

    def catch_up(self, committed: int | None) -> int:
        """Before the stream starts: what Spark committed but the view has not applied."""
        self.applied_end = committed
        return self.writer.catch_up(committed)

    def process(self, batch: Batch) -> None:
        name_native("compaction")  # py4j's callback thread, for the cost ledger
        with self.lock:
            t0 = time.monotonic()
            changes = batch.df.toArrow()  # runs this batch's Spark job while the apply thread works on the last one
            collect_s = time.monotonic() - t0
            crash_point("collected")
            self.flush()  # batches reach the view in order, one at a time
            start = batch.start if batch.start is not None else self.start_at
            self._pending = self._apply_thread.submit(self._apply, batch.batch_id, changes, start, batch.end,
                                                      collect_s)

    def _apply(self, batch_id: int, changes, start: int | None, end: int, collect_s: float) -> None:
        report = self.writer.apply(batch_id, changes, end, collect_s)
        self.applied_end = end
        if self.on_applied is not None and start is not None:
            # Up to this batch's start only: Spark runs this batch again if it stops before committing it.
            self.on_applied(start)
        if self.on_batch:
            self.on_batch(report)

    def flush(self) -> None:
        """Wait for the batch on the apply thread; raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

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
            self.writer.close()
