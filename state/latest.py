"""The latest-per-key stateful step: Spark's built-in streaming aggregation over RocksDB state.

``latest_per_key(messages)`` groups the message stream by ``(topic, key)``
and keeps, for every key, a reference to its latest message: the one with
the highest physical offset.  In ``update`` output mode each micro-batch
emits exactly the keys that changed in it, once each.

Why this shape:

* **The JVM does all the work.**  Every aggregate is a ``max``/``max_by`` on
  a fixed-width column, so Spark runs a code-generated HashAggregate: first a
  partial one per input partition (the within-batch dedupe), then the merge
  with the RocksDB state.  A Python stateful step
  (``transformWithStateInPandas``) was measured far below the rate this needs
  (see the README's benchmark table).
* **Ordering is by physical offset**, never by arrival: ``max_by(..,
  phy_offset)`` cannot move a key backwards, whatever is replayed or late.
* **Deletes are kept as tombstones** (``deleted = true``) so that an older
  put replayed later can never bring a key back; readers skip them.
* **The state holds references, not bodies** (physical offset and size, as
  RocketMQ's ConsumeQueue does).  The bodies travel once, from the commitlog
  to the KV view, on the driver; the safepoint keeps them on disk until then.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from connectors.commitlog import format as fmt

# What the compaction query reads from the commitlog source (its ``columns`` option).
SOURCE_COLUMNS = ("topic", "key", "op", "phy_offset", "queue_id", "queue_offset", "store_ts", "size", "sysflag")
# What each changed key carries, in this order.
CHANGE_COLUMNS = ("topic", "key", "phy_offset", "size", "queue_id", "queue_offset", "store_ts", "deleted")


def keyed_messages(messages: DataFrame) -> DataFrame:
    """Messages that take part in KV semantics: those with a key that entered a queue.

    A message without a key has no place in a key-value view, and PREPARED or
    ROLLBACK transaction records never enter a queue (COMMITLOG_FORMAT.md §8).
    """
    tx = F.col("sysflag").bitwiseAND(F.lit(fmt.TRANSACTION_MASK))
    return messages.where(
        F.col("key").isNotNull() & tx.isin(fmt.TRANSACTION_NOT_TYPE, fmt.TRANSACTION_COMMIT)
    )


def latest_per_key(messages: DataFrame) -> DataFrame:
    """The latest reference per ``(topic, key)``; run it with ``outputMode("update")``."""
    phy = F.col("phy_offset")
    latest = [F.max_by(c, phy).alias(c) for c in ("size", "queue_id", "queue_offset", "store_ts")]
    return keyed_messages(messages).groupBy("topic", "key").agg(
        F.max(phy).alias("phy_offset"),
        *latest,
        F.max_by(F.col("op") == F.lit("delete"), phy).alias("deleted"),
    ).select(*CHANGE_COLUMNS)


def read_state(spark, checkpoint: str):
    """Spark's committed state for the compaction query, as an Arrow table of ``CHANGE_COLUMNS``.

    Read with Spark's ``statestore`` data source; tombstones are included
    (``deleted = true``).  For audits and tests: it reads every key.
    """
    # The state row is the aggregation buffer: max(phy_offset), then (value, ordering) for
    # each max_by, under repeated field names; a cast renames the fields by position.
    buffer = ("struct<phy_offset:bigint, size:int, o1:bigint, queue_id:int, o2:bigint, queue_offset:bigint, "
              "o3:bigint, store_ts:timestamp, o4:bigint, deleted:boolean, o5:bigint>")
    raw = spark.read.format("statestore").load(checkpoint)
    state = raw.select("key.topic", "key.key", F.col("value").cast(buffer).alias("v"))
    return state.select("topic", "key", *[F.col("v")[c].alias(c) for c in CHANGE_COLUMNS[2:]]).toArrow()
