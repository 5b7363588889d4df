"""The Spark side of tierlog: session, the ``commitlog`` data source, queries, runner, CLI."""

from __future__ import annotations


def register(spark) -> None:
    """Register tierlog's Python data sources (``commitlog`` and ``tier``) with a SparkSession."""
    from streaming.source import CommitLogDataSource
    from streaming.tier_source import TierDataSource

    spark.dataSource.register(CommitLogDataSource)
    spark.dataSource.register(TierDataSource)
