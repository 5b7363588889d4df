"""The plan of a run, from the configuration: which queries run and which sinks they feed, where
each keeps its state and checkpoint, the Spark settings, and the
safepoint below which no sink needs the commitlog.

``tierlog run`` (``streaming.service``) and the CLI's other commands (status, gc, config check)
read it here, so they agree on what a run is.  A new query is one line in ``QUERIES``.
"""

from __future__ import annotations

from connectors.errors import TierlogError
from streaming.queries.base import Query
from streaming.queries.compaction.query import CompactionQuery
from streaming.queries.mirror.query import MirrorQuery
from streaming.queries.tiering.query import TieringQuery
from streaming.settings import Settings

QUERIES: tuple[type[Query], ...] = (TieringQuery, CompactionQuery, MirrorQuery)


def queries(settings: Settings) -> list[type[Query]]:
    """The queries this configuration runs, in the order they start."""
    return [q for q in QUERIES if q.enabled(settings)]


def enabled_sinks(settings: Settings) -> list[str]:
    """The sinks the run feeds: ``tier``, and ``kv``, ``changelog``, ``mirror`` as switched on."""
    return [sink for q in queries(settings) for sink in q.sinks(settings)]


def commitlog_sinks(settings: Settings) -> list[str]:
    """The sinks fed from the commitlog, whose applied offsets bound the safepoint: the tier's."""
    return [sink for q in queries(settings) if q.reads_commitlog for sink in q.sinks(settings)]


def tier_consumers(settings: Settings) -> list[str]:
    """The queries of the run that consume the tier's committed batches (compaction, the mirror),
    for which the tier lists and keeps them (``state.tier_feed``)."""
    return [q.name for q in queries(settings) if not q.reads_commitlog]


def safepoint(settings: Settings, sinks: dict[str, int]) -> int | None:
    """Below it, no sink needs the commitlog any more: the lowest offset every sink fed from the
    commitlog has applied, and no lower than where each of its queries' last committed batch ends.
    Only the tier is one of them: compaction and the mirror read the tier's committed batches,
    which the tier keeps until they have applied them, so a Kafka outage does not hold the disk.

    A sink records a batch before Spark commits it; after a crash Spark runs that batch again from
    the end of the last committed one, reading its bytes once more (the chaos harness found `gc`
    deleting them).  None until each sink has applied something and each query committed a batch,
    and for checkpoints on a Hadoop file system when no Spark session runs in this process.
    """
    enabled = commitlog_sinks(settings)
    if not all(n in sinks for n in enabled):
        return None
    points = [sinks[n] for n in enabled]
    for query in (q for q in queries(settings) if q.reads_commitlog):
        committed = _committed_end(settings.paths.checkpoint(query.name))
        if committed is None:
            return None
        points.append(committed)
    return min(points)


def _committed_end(checkpoint: str) -> int | None:
    from streaming.runtime.checkpoints import Checkpoint

    try:
        return Checkpoint(checkpoint).last_committed_end()
    except TierlogError:
        return None


def session_conf(settings: Settings) -> dict:
    """The Spark settings of the run's session."""
    from streaming.runtime.checkpoints import LOCAL_FILE_MANAGER, is_local, s3a_settings

    spark, root = settings.spark, settings.paths.checkpoints
    out = {
        "spark.sql.shuffle.partitions": str(spark.shuffle_partitions),
        "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": str(spark.rocksdb_memory_mb),
    }
    if spark.jars:
        out["spark.jars"] = ",".join(spark.jars)
    if root.startswith("s3a://"):
        out.update(s3a_settings())
    if is_local(root):
        out.update(LOCAL_FILE_MANAGER)
    return out


