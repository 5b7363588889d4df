"""Compaction runs behind the tier, the mirror and the broker when the cores are full
(``compaction.nice``).

Why: on a full machine every part of the service waits its turn, so the tier's batches waited
behind compaction's, and a message reached the tier and the mirror topic late.  The KV view and the
changelog are derived from the tier and can trail it; the tier and the mirror are what a broker's
retention and Kafka's readers wait for.  On a full host, compaction behind them brought the tier's
and the mirror topic's p99 down and let the KV view's rise (docs/benchmarks.md, "Compaction behind
the tier and the mirror").  While the cores are not full, niceness changes nothing.

What runs at ``compaction.nice``:

* the driver's KV view threads (``streaming.queries.compaction.handler``: resolve and apply), and what they start:
  the changelog's reads and its librdkafka threads;
* in a local master's JVM, Spark's task threads and the state store's RocksDB threads (this class).
  At steady state compaction's stateful step is the only Spark job the service runs: tiering
  stages on the driver and in its own processes, the mirror sends from the driver.  The rare tasks
  of others (tiering's stager when a batch's range is unknown, the mirror's backfill) share the
  task threads, and run behind too.

Not: the py4j thread that runs each query's handler in turn, Arrow's CPU pool (started before at
niceness 0: ``connectors.threads.start_arrow_pool``), the staging processes, the mirror's thread.
On a cluster the executors are other hosts' processes, which this leaves alone.  And only where
the run started the process's JVM itself (``tierlog run``): a service handed a caller's session
(``Service.run(spark=...)``, the tests') leaves that process's threads as they are.
"""

from __future__ import annotations

import logging
import os

from connectors.threads import lower_priority

log = logging.getLogger("tierlog.service")

# The JVM's thread names (``/proc``'s comm, 15 bytes) that do compaction's work.
JVM_THREADS = ("Executor task", "rocksdb:", "state-store-mai")


class JvmThreads:
    """The JVM's threads named by ``prefixes``, each given niceness ``nice`` once it is seen.

    ``lower`` looks at the JVM's threads it has not seen yet: call it after each of compaction's
    Spark jobs, which start the task threads (Spark keeps them a minute between tasks)."""

    def __init__(self, pid: int | None, nice: int, prefixes: tuple[str, ...] = JVM_THREADS):
        self.pid = pid if nice > 0 else None
        self.nice, self.prefixes = nice, prefixes
        self._seen: set[int] = set()

    @classmethod
    def of(cls, spark, nice: int) -> "JvmThreads":
        """The JVM of ``spark`` when it runs the executors (a local master) and PySpark started it."""
        sc = spark.sparkContext
        proc = getattr(getattr(sc, "_gateway", None), "proc", None)
        local = sc.master.startswith("local")
        return cls(proc.pid if proc is not None and local else None, nice)

    def lower(self) -> int:
        """Give the matching threads not seen before niceness ``nice``; how many it gave."""
        if self.pid is None:
            return 0
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{self.pid}/task")}
        except OSError:  # no /proc, or the JVM has gone: nothing to do
            return 0
        self._seen &= tids  # an ended thread's id may come back as another thread's
        lowered = 0
        for tid in tids - self._seen:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/comm") as fh:
                    name = fh.read()
            except OSError:
                continue  # ended meanwhile
            self._seen.add(tid)
            if name.startswith(self.prefixes) and lower_priority(self.nice, tid):
                lowered += 1
        if lowered:
            log.debug("%d of the JVM's compaction threads at niceness %d", lowered, self.nice)
        return lowered
