"""The plan of a run, from the configuration: which queries run and which sinks they feed, where
each keeps its state and checkpoint, the Spark settings, and the
safepoint below which no sink needs the commitlog.

``tierlog run`` (``streaming.service``) and the CLI's other commands (status, gc, config check)
read it here, so they agree on what a run is.  A new query is one line in ``QUERIES``.
"""

from __future__ import annotations

import os

from connectors.errors import TierlogError
from streaming import config as cfg
from streaming.queries.base import Query
from streaming.queries.compaction.query import CompactionQuery
from streaming.queries.mirror.query import MirrorQuery
from streaming.queries.tiering.query import TieringQuery

QUERIES: tuple[type[Query], ...] = (TieringQuery, CompactionQuery, MirrorQuery)


def queries(conf: cfg.Config) -> list[type[Query]]:
    """The queries this configuration runs, in the order they start."""
    return [q for q in QUERIES if q.enabled(conf)]


def enabled_sinks(conf: cfg.Config) -> list[str]:
    """The sinks the run feeds: ``tier``, and ``kv``, ``changelog``, ``mirror`` as switched on."""
    return [sink for q in queries(conf) for sink in q.sinks(conf)]


def commitlog_sinks(conf: cfg.Config) -> list[str]:
    """The sinks fed from the commitlog, whose applied offsets bound the safepoint: the tier's."""
    return [sink for q in queries(conf) if q.reads_commitlog for sink in q.sinks(conf)]


def tier_consumers(conf: cfg.Config) -> list[str]:
    """The queries of the run that consume the tier's committed batches (compaction, the mirror),
    for which the tier lists and keeps them (``state.tier_feed``)."""
    return [q.name for q in queries(conf) if not q.reads_commitlog]


def safepoint(conf: cfg.Config, sinks: dict[str, int]) -> int | None:
    """Below it, no sink needs the commitlog any more: the lowest offset every sink fed from the
    commitlog has applied, and no lower than where each of its queries' last committed batch ends.
    Only the tier is one of them: compaction and the mirror read the tier's committed batches,
    which the tier keeps until they have applied them, so a Kafka outage does not hold the disk.

    A sink records a batch before Spark commits it; after a crash Spark runs that batch again from
    the end of the last committed one, reading its bytes once more (the chaos harness found `gc`
    deleting them).  None until each sink has applied something and each query committed a batch,
    and for checkpoints on a Hadoop file system when no Spark session runs in this process.
    """
    enabled = commitlog_sinks(conf)
    if not all(n in sinks for n in enabled):
        return None
    points = [sinks[n] for n in enabled]
    for query in (q for q in queries(conf) if q.reads_commitlog):
        committed = _committed_end(checkpoint_path(conf, query.name))
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


def metadata_path(conf: cfg.Config) -> str:
    return os.path.join(conf.state.dir, "metadata")


def kv_path(conf: cfg.Config) -> str:
    return os.path.join(conf.state.dir, "kv")


def checkpoint_path(conf: cfg.Config, query: str) -> str:
    return os.path.join(conf.checkpoint.dir, query)


def session_conf(conf: cfg.Config) -> dict:
    """The Spark settings of the run's session."""
    from streaming.runtime.checkpoints import LOCAL_FILE_MANAGER, is_local, s3a_settings

    out = {
        "spark.sql.shuffle.partitions": str(conf.spark.shuffle_partitions),
        "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": str(conf.state.rocksdb_memory_mb),
    }
    if conf.spark.jars:
        out["spark.jars"] = conf.spark.jars
    if conf.checkpoint.dir.startswith("s3a://"):
        out.update(s3a_settings())
    if is_local(conf.checkpoint.dir):
        out.update(LOCAL_FILE_MANAGER)
    return out


