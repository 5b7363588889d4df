"""The Spark side of tierlog: session, the ``commitlog`` data source, queries, runner, CLI."""

from __future__ import annotations


def register(spark) -> None:
    """Register tierlog's Python data sources (``commitlog``) with a SparkSession."""
    from streaming.source import CommitLogDataSource

    spark.dataSource.register(CommitLogDataSource)
