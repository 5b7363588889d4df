"""The Spark side of tierlog: session, the ``commitlog`` data source, queries, runner, CLI."""

from __future__ import annotations

import os

# Arrow's allocator (mimalloc) hands memory it has not used for 1 s back to the kernel; by default it
# decommits it (MADV_DONTNEED), so the next batch's buffers fault every page in again, zeroed.  With
# 0 it resets the memory instead (MADV_FREE): the kernel takes the pages back only when it needs
# them, and a page reused before then costs no fault.  At 6,400 msgs/s of 16 KiB with Kafka, runs
# new, old, old, new: the service's kernel time 0.22 against 0.31-0.33 of its CPU, its total 1.210 /
# 1.211 against 1.245 / 1.264 cores; at 25,000 msgs/s of 1 KiB 0.911 against 0.984, the driver's
# resident memory 0.6 against 0.5 GB (docs/benchmarks.md).  Set before anything loads pyarrow
# (this package is imported first), and inherited by the JVM and every Python process it starts;
# a value of the user's own wins.
os.environ.setdefault("MIMALLOC_PURGE_DECOMMITS", "0")


def register(spark) -> None:
    """Register tierlog's Python data sources (``commitlog``, ``tier`` and ``tierfeed``) with a SparkSession.

    Also turns on ``spark.sql.python.filterPushdown.enabled`` in that session: the ``tier`` source
    prunes by its pushed filters, and Spark refuses a source that accepts filters while it is off
    (``DATA_SOURCE_PUSHDOWN_DISABLED``)."""
    from streaming.sources.tierfeed import TierFeedDataSource
    from streaming.sources.commitlog import CommitLogDataSource
    from streaming.sources.tier import TierDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(CommitLogDataSource)
    spark.dataSource.register(TierDataSource)
    spark.dataSource.register(TierFeedDataSource)
