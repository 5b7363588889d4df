"""The latest-per-key stateful step: Spark's built-in streaming aggregation over RocksDB state.

``latest_per_key(messages)`` groups the message stream by ``(topic, key)``
and keeps, for every key, a reference to its latest message: the physical
offset of the one with the highest physical offset.  That offset names the
message exactly (its body, queue offset, store time, and whether it is a
delete are read from the tier's committed batch that holds it).  In ``update`` output mode each
micro-batch emits exactly the keys that changed in it, once each.

Why this shape:

* **The JVM does all the work.**  The aggregate is one ``max`` of a long, so
  Spark runs a code-generated HashAggregate: a partial one per input
  partition (the within-batch dedupe, skipped when keys barely repeat), then
  the merge with the RocksDB state.  Carrying the other fields through
  ``max_by`` was measured slower.  A Python stateful step
  (``transformWithStateInPandas``) was measured far below the rate this needs
  (see docs/benchmarks.md).
* **Ordering is by physical offset**, never by arrival: ``max(phy_offset)``
  cannot move a key backwards, whatever is replayed or late.
* **A delete stays in the state** (its offset is the key's maximum), so an
  older put replayed later can never bring the key back.
* **Fewer rows reach it.**  The ``tierfeed`` source reduces each partition
  (one staging object) to each key's last message in Arrow first
  (``latestPerKey``): the same ``max``, with a key's repeats within an object
  never crossing into the JVM.  Those rows are keyed messages that entered a
  queue already, so they cross without ``sysflag`` and Spark filters nothing
  (``max_per_key``).  That alone made no difference the benchmark of Spark's
  stateful step resolved (``bench/bench_state_step.py``); there the string
  key's two columns cost more than one would, but that is another state,
  which no checkpoint made before could keep.
* **The state holds references, not bodies** (as RocketMQ's ConsumeQueue
  does).  Each changed message's body is read once, from the tier's
  committed batch to the KV view, on the driver; the tier keeps the batch
  until then.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from connectors.commitlog import format as fmt

# What ``latest_per_key`` reads from a source of unfiltered messages (its ``columns`` option).
SOURCE_COLUMNS = ("topic", "key", "phy_offset", "sysflag")
# What ``max_per_key`` reads: the ``tierfeed`` source's rows under ``latestPerKey``, every one a
# keyed message that entered a queue.
REDUCED_COLUMNS = ("topic", "key", "phy_offset")


def dispatched() -> Column:
    """True for a message row that entered a queue: PREPARED or ROLLBACK transaction records never
    do (docs/commitlog-format.md §8); ``connectors.commitlog.arrow.dispatched_mask`` in Arrow."""
    tx = F.col("sysflag").bitwiseAND(F.lit(fmt.TRANSACTION_MASK))
    return tx.isin(fmt.TRANSACTION_NOT_TYPE, fmt.TRANSACTION_COMMIT)


def keyed_messages(messages: DataFrame) -> DataFrame:
    """Messages that take part in KV semantics: those with a key that entered a queue.

    A message without a key has no place in a key-value view, and PREPARED or
    ROLLBACK transaction records never enter a queue (docs/commitlog-format.md §8).
    """
    return messages.where(F.col("key").isNotNull() & dispatched())


def latest_per_key(messages: DataFrame) -> DataFrame:
    """The physical offset of the latest message per ``(topic, key)``; run it with ``outputMode("update")``."""
    return max_per_key(keyed_messages(messages))


def max_per_key(keyed: DataFrame) -> DataFrame:
    """``latest_per_key`` of rows that are keyed messages that entered a queue already
    (``REDUCED_COLUMNS``); the same state as ``latest_per_key``'s, so it runs on a checkpoint
    that one made (the compaction query's before it used this)."""
    return keyed.groupBy("topic", "key").agg(F.max("phy_offset").alias("phy_offset"))


def read_state(spark, checkpoint: str):
    """Spark's committed state for the compaction query: an Arrow table of ``connectors.changes.CHANGE_REF``.

    Read with Spark's ``statestore`` data source; a key whose latest message
    is a delete is included (its offset points at the delete).  For audits and
    tests: it reads every key.
    """
    raw = spark.read.format("statestore").load(checkpoint)
    # The state row is the aggregation buffer of max(phy_offset): one field named `max`.
    return raw.select("key.topic", "key.key", F.col("value").getField("max").alias("phy_offset")).toArrow()
