"""The Spark side of tierlog: session, the ``commitlog`` data source, queries, runner, CLI."""

from __future__ import annotations


def register(spark) -> None:
    """Register tierlog's Python data sources (``commitlog``, ``tier`` and ``tierfeed``) with a SparkSession.

    Also turns on ``spark.sql.python.filterPushdown.enabled`` in that session: the ``tier`` source
    prunes by its pushed filters, and Spark refuses a source that accepts filters while it is off
    (``DATA_SOURCE_PUSHDOWN_DISABLED``)."""
    from streaming.feed_source import TierFeedDataSource
    from streaming.source import CommitLogDataSource
    from streaming.tier_source import TierDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(CommitLogDataSource)
    spark.dataSource.register(TierDataSource)
    spark.dataSource.register(TierFeedDataSource)
