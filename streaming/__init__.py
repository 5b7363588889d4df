"""The Spark side of tierlog: session, the ``commitlog`` data source, queries, runner, CLI."""

from __future__ import annotations

import os

# Arrow's allocator (mimalloc) hands memory it has not used for 1 s back to the kernel; by default it
# decommits it (MADV_DONTNEED), so the next batch's buffers fault every page in again, zeroed.  With
# 0 it resets the memory instead (MADV_FREE): the kernel takes the pages back only when it needs
# them, and a page reused before then costs no fault: a third less kernel time, for a little more
# resident memory (docs/benchmarks.md, "Freed memory reset").  Set before anything loads pyarrow
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
