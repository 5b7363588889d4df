"""The typed settings every part of tierlog receives, parsed from ``Config`` in this one place.

``Config`` (``streaming.config``) holds what the user wrote: strings like ``*=7d,orders=30d``.
``derive(conf)`` turns them into what the code uses: topic filters per sink, TTLs, retention
limits, the commitlog reader's options, the tier writer's and stager's settings.  Every error
names the setting, so ``tierlog config check`` and ``tierlog run`` fail at start on a bad value,
before Spark starts.  Nothing else parses a setting's text.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.topics import CLASSES, TopicFilter
from connectors.errors import ConfigError
from connectors.kafka.settings import KafkaSettings, parse_topic_map
from connectors.sinks import FILTERED_SINKS
from connectors.bodies.formats import BodyFormats
from connectors.tables.catalog import TableSettings, default_settings
from connectors.tier.copies import CopySettings
from connectors.tier.retention import Retention
from connectors.tier.staging import StageSettings
from connectors.tier.writer import WriterSettings
from state.kv_refs import ReferencePolicy
from state.kv_writer import CompactionSettings
from streaming import config as cfg


@dataclass(frozen=True)
class Paths:
    """Where one tierlog keeps what it reads and writes."""

    commitlog: str  # commitlog.dir
    tier: str  # tier.location: a directory or s3://bucket/prefix
    state: str  # state.dir: the metadata store, the KV view, the tables' SQLite catalog
    checkpoints: str  # checkpoint.dir: one Spark checkpoint per query under it

    @property
    def metadata(self) -> str:
        return os.path.join(self.state, "metadata")

    @property
    def kv(self) -> str:
        return os.path.join(self.state, "kv")

    def checkpoint(self, query: str) -> str:
        return os.path.join(self.checkpoints, query)


@dataclass(frozen=True)
class ProducerSettings:
    """The embedded producer's (``tierlog produce``, the demo): how it writes ``commitlog.dir``."""

    file_size: int
    fsync: str
    fsync_interval_s: float


@dataclass(frozen=True)
class SparkSettings:
    master: str
    shuffle_partitions: int
    trigger_interval_s: float
    late_start_s: float
    jars: tuple[str, ...]  # spark.jars, split
    jit_c1_only: bool
    transparent_huge_pages: bool
    rocksdb_memory_mb: int  # state.rocksdb_memory_mb: Spark's state stores' bound per executor


@dataclass(frozen=True)
class CompactionRun:
    """The compaction query's settings (``compaction.*``), as the runner and the query use them."""

    enabled: bool
    nice: int
    min_batch_bytes: int
    max_batch_delay_s: float
    max_batch_bytes: int | None  # what a batch behind takes at most; None: no bound
    key_property: str  # its Spark state is keyed by it (a checkpoint guard)
    writer: CompactionSettings  # the KV writer's


@dataclass(frozen=True)
class MirrorRun:
    """The mirror query's settings (``kafka.mirror*``)."""

    enabled: bool  # kafka.bootstrap set and kafka.mirror on
    tasks: int
    driver_bytes: int
    process: bool
    min_batch_bytes: int
    max_batch_delay_s: float


@dataclass(frozen=True)
class Settings:
    """Every typed setting of one configuration: what everything below the CLI reads."""

    broker: str  # broker.name
    paths: Paths
    filters: dict[str, TopicFilter]  # sink (tier, compaction, mirror) -> its topic filter
    ttl: dict[str, float] | None  # compaction.ttl: topic -> seconds; None: keys never expire
    retention: Retention  # tier.retention, retention_bytes, retention_messages
    local_retention_s: float  # commitlog.local_retention
    headroom_warn_fraction: float  # commitlog.headroom_warn_fraction
    headroom_warn_s: float  # commitlog.headroom_warn_s
    reader: ReaderOptions  # how every commitlog reader of this broker reads
    copies: CopySettings | None  # tier.local_copy_bytes on an S3 tier; None: every read back is a GET
    stage: StageSettings  # the tiering query's stagers
    writer: WriterSettings  # the tier writer
    tables: TableSettings | None  # the Iceberg tables; None: tables.enabled is off
    body_formats: BodyFormats = field(compare=False)  # topics.body_format: JSON topics (typed columns, parsed values)
    driver_stage_bytes: int  # tier.stage_on_driver: tiering batches up to this size are staged by the driver; 0: none
    stage_processes: int  # tier.stage_in_processes, resolved: larger tiering batches are staged by this many; 0: Spark
    partition_bytes: int  # source.partition_bytes
    starting_offset: str  # source.starting_offset
    kafka: KafkaSettings | None  # the Kafka sinks'; None when kafka.bootstrap is empty (they are off)
    changelog: bool  # the changelog sink runs: Kafka on, kafka.changelog and compaction on
    compaction: CompactionRun
    mirror: MirrorRun
    spark: SparkSettings
    metrics_host: str
    metrics_port: int  # 0: no endpoint
    producer: ProducerSettings
    source: dict  # the commitlog source's options (strings, as Spark hands them over), from ``reader``
    # "section.key" -> where its value came from, for errors that name it (``origin``)
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def origin(self, dotted: str) -> str:
        """Where a setting's value came from, for an error: ``from tierlog.toml``, ``the default`` ..."""
        where = self.origins.get(dotted)
        return f"from {where}" if where else "the default"


def derive(conf: cfg.Config) -> Settings:
    """Every typed setting of ``conf``; raises ``ConfigError`` naming the first bad one."""
    t, c, k, sp = conf.tier, conf.compaction, conf.kafka, conf.spark
    filters, kept, reader, copies = topic_filters(conf), retention(conf), reader_options(conf), local_copies(conf)
    kafka, tables_on, ttl_s = kafka_settings(conf), tables(conf), ttl(conf)
    source = source_options(conf, reader)
    compaction_cap = c.max_batch_bytes or (s.max_bytes_per_trigger * SOURCE_CAP_FACTOR
                                           if (s := conf.source).max_bytes_per_trigger else None)
    return Settings(
        broker=conf.broker.name,
        paths=Paths(conf.commitlog.dir, t.location, conf.state.dir, conf.checkpoint.dir),
        filters=filters,
        ttl=ttl_s,
        retention=kept,
        local_retention_s=local_retention_s(conf),
        headroom_warn_fraction=conf.commitlog.headroom_warn_fraction,
        headroom_warn_s=conf.commitlog.headroom_warn_s,
        reader=reader,
        copies=copies,
        stage=StageSettings(location=t.location, reader=reader, filters=filters, copies=copies),
        writer=WriterSettings(location=t.location, broker=conf.broker.name, segment_bytes=t.segment_bytes,
                              segment_messages=t.segment_messages, segment_age_s=t.segment_age_s,
                              retention=kept, fold_every=max(1, t.fold_every), delete_grace_s=t.delete_grace_s,
                              copies=copies),
        tables=tables_on,
        body_formats=BodyFormats(conf.topics.body_format),
        driver_stage_bytes=conf.source.partition_bytes if t.stage_on_driver else 0,
        stage_processes=stage_processes(conf),
        partition_bytes=conf.source.partition_bytes,
        starting_offset=conf.source.starting_offset,
        kafka=kafka,
        changelog=kafka is not None and k.changelog and c.enabled,
        compaction=CompactionRun(
            enabled=c.enabled, nice=c.nice, min_batch_bytes=c.min_batch_bytes, max_batch_delay_s=c.max_batch_delay_s,
            max_batch_bytes=compaction_cap, key_property=conf.commitlog.key_property,
            writer=CompactionSettings(reader=reader, tier_location=t.location, ttl=ttl_s,
                                      snapshot_interval_s=c.snapshot_interval_s, snapshot_keep=max(1, c.snapshot_keep),
                                      topics=filters["compaction"], tables=tables_on,
                                      references=ReferencePolicy(max(0, c.reference_min_bytes), kept))),
        mirror=MirrorRun(enabled=kafka is not None and k.mirror, tasks=k.mirror_tasks,
                         driver_bytes=k.mirror_driver_bytes, process=k.mirror_process,
                         min_batch_bytes=k.mirror_min_batch_bytes, max_batch_delay_s=k.mirror_max_batch_delay_s),
        spark=SparkSettings(master=sp.master, shuffle_partitions=sp.shuffle_partitions,
                            trigger_interval_s=sp.trigger_interval_s, late_start_s=sp.late_start_s,
                            jars=spark_jars(sp.jars),
                            jit_c1_only=sp.jit_c1_only, transparent_huge_pages=sp.transparent_huge_pages,
                            rocksdb_memory_mb=conf.state.rocksdb_memory_mb),
        metrics_host=conf.metrics.host,
        metrics_port=conf.metrics.port,
        producer=ProducerSettings(conf.commitlog.file_size, conf.commitlog.fsync, conf.commitlog.fsync_interval_s),
        source=source,
        origins=conf.origins,
    )


# How many times the commitlog source's cap a compaction batch takes while it is behind, when
# compaction.max_batch_bytes is not set: its rows are keys and offsets, and over many keys a larger
# batch holds more repeats of each, so the view and the changelog write fewer changes, while the
# changelog sends a batch's bodies a slice at a time (docs/benchmarks.md, "Compaction's batches four
# times the source's cap").
SOURCE_CAP_FACTOR = 4


def spark_jars(text: str) -> tuple[str, ...]:
    """``spark.jars`` as its jar files."""
    return tuple(j.strip() for j in text.split(",") if j.strip())


def stage_processes(conf: cfg.Config) -> int:
    """``tier.stage_in_processes`` as a number: one per core of a local master (``local``: 1,
    ``local[N]`` or ``local[N,F]``: N, ``local[*]``: every core); none when it is off or on a
    cluster, whose executors are other hosts."""
    if not conf.tier.stage_in_processes:
        return 0
    found = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", conf.spark.master.strip())
    if found is None:
        return 0
    cores = found.group(1)
    return 1 if cores is None else (os.cpu_count() or 1) if cores == "*" else max(1, int(cores))


def local_copies(conf: cfg.Config) -> CopySettings | None:
    if not conf.tier.location.startswith("s3://") or conf.tier.local_copy_bytes <= 0:
        return None  # a directory tier is read back from local files already
    return CopySettings(os.path.join(os.path.abspath(conf.state.dir), "tier-copies"), conf.tier.local_copy_bytes)


def reader_options(conf: cfg.Config) -> ReaderOptions:
    c = conf.commitlog
    return ReaderOptions(c.dir, check_crc=c.check_crc, on_corrupt=c.on_corrupt, broker=conf.broker.name,
                         key_property=c.key_property, on_missing=conf.source.on_missing)


def source_options(conf: cfg.Config, reader: ReaderOptions) -> dict:
    """The ``commitlog`` source's options; None values are left out when the stream is built."""
    s = conf.source
    return {
        "path": reader.directory,
        "broker": reader.broker,
        "maxRecordsPerTrigger": s.max_records_per_trigger or None,
        "maxBytesPerTrigger": s.max_bytes_per_trigger or None,
        # Batches the driver stages while tiering follows the head (CommitLogStreamReader._follow_cap).
        "followBytesPerTrigger": s.partition_bytes if conf.tier.stage_on_driver else None,
        "partitionBytes": s.partition_bytes,
        "startingOffset": s.starting_offset,
        "checkCrc": str(reader.check_crc).lower(),
        "onCorrupt": reader.on_corrupt,
        "onMissing": reader.on_missing,
        "keyProperty": reader.key_property,
    }


def kafka_on(conf: cfg.Config) -> bool:
    """Whether the Kafka sinks run: ``kafka.bootstrap`` names a broker."""
    return bool(cfg.bootstrap_servers(conf.kafka.bootstrap))


def kafka_settings(conf: cfg.Config) -> KafkaSettings | None:
    """The Kafka sinks' settings; None when ``kafka.bootstrap`` is empty (the sinks are off)."""
    k = conf.kafka
    if not kafka_on(conf):
        return None
    client = {"bootstrap_servers": cfg.bootstrap_servers(k.bootstrap),
              "client_id": k.client_id, "security_protocol": k.security_protocol}
    optional = {"sasl_mechanism": k.sasl_mechanism, "sasl_plain_username": k.sasl_username,
                "sasl_plain_password": k.sasl_password, "ssl_cafile": k.ssl_cafile, "ssl_certfile": k.ssl_certfile,
                "ssl_keyfile": k.ssl_keyfile}
    client.update({name: value for name, value in optional.items() if value})
    return KafkaSettings(
        client=client,
        broker=conf.broker.name,
        mirror_topic=k.mirror_topic,
        mirror_topic_map=parse_topic_map(k.mirror_topic_map, "kafka.mirror_topic_map"),
        changelog_topic=k.changelog_topic,
        changelog_topic_map=parse_topic_map(k.changelog_topic_map, "kafka.changelog_topic_map"),
        auto_create_topics=k.auto_create_topics,
        partitions=max(1, k.partitions),
        replication_factor=max(1, k.replication_factor),
        compression=k.compression,
        linger_ms=k.linger_ms,
        batch_bytes=k.batch_bytes,
        max_request_size=k.max_request_size,
        delivery_timeout_s=max(2.0 + k.linger_ms / 1000, k.delivery_timeout_s),
        on_too_large=k.on_too_large,
        producer=k.producer,
        native_send=k.native_send,
    )


def retention(conf: cfg.Config) -> Retention:
    t = conf.tier
    return Retention(
        seconds=cfg.parse_topic_durations(t.retention, "tier.retention"),
        bytes=cfg.parse_topic_limits(t.retention_bytes, "tier.retention_bytes", size=True),
        messages=cfg.parse_topic_limits(t.retention_messages, "tier.retention_messages"),
    )


def ttl(conf: cfg.Config) -> dict[str, float] | None:
    return cfg.parse_topic_durations(conf.compaction.ttl, "compaction.ttl")


def local_retention_s(conf: cfg.Config) -> float:
    return cfg.parse_duration(conf.commitlog.local_retention, "commitlog.local_retention")


def tables(conf: cfg.Config) -> TableSettings | None:
    t = conf.tables
    for setting in ("name", "latest_name"):
        template = getattr(t, setting)
        if "{topic}" not in template:
            raise ConfigError(f"setting tables.{setting}: {template!r} has no {{topic}}, so every topic would share "
                              "one table")
    if t.name == t.latest_name:
        raise ConfigError(f"settings tables.name and tables.latest_name are both {t.name!r}: a topic's message "
                          "table and its latest-per-key table need different names")
    if not conf.tables.enabled:
        return None
    props = {}
    for part in _globs(t.catalog_properties):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"setting tables.catalog_properties: {part.split('=')[0]!r} is not key=value")
        props[key.strip()] = value.strip()
    return default_settings(conf.tier.location, conf.state.dir, catalog_uri=t.catalog_uri, warehouse=t.warehouse,
                            namespace=t.namespace, name=t.name, latest_name=t.latest_name, properties=props,
                            commit_interval_s=t.commit_interval_s, min_commit_bytes=t.min_commit_bytes,
                            max_commit_delay_s=t.max_commit_delay_s, commits_per_minute=t.commits_per_minute,
                            snapshots_kept=max(1, t.snapshots_kept), body_formats=conf.topics.body_format)


def _globs(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def topic_filters(conf: cfg.Config) -> dict[str, TopicFilter]:
    """Each sink's ``TopicFilter`` from ``[topics]``."""
    t = conf.topics
    out = {}
    for sink in FILTERED_SINKS:
        classes = _globs(getattr(t, sink))
        unknown = [c for c in classes if c not in CLASSES]
        if unknown:
            raise ConfigError(f"setting topics.{sink}: {', '.join(map(repr, unknown))} is not a topic class; "
                              f"use any of {', '.join(CLASSES)}")
        out[sink] = TopicFilter(frozenset(classes), _globs(t.include) or ("*",),
                                _globs(t.exclude) + _globs(getattr(t, f"{sink}_exclude")),
                                _globs(getattr(t, f"{sink}_include")))
    consumers = {"compaction": conf.compaction.enabled, "mirror": kafka_on(conf) and conf.kafka.mirror}
    for sink, what in (("compaction", "the KV view takes"), ("mirror", "the Kafka mirror sends")):
        wider = _wider_than_tier(t, sink) if consumers[sink] else None
        if wider:
            raise ConfigError(f"{what} what the tier keeps, but {wider}: widen the tier's filter (topics.tier, "
                              f"tier_include) or narrow the {sink}'s (topics.{sink}, {sink}_include, {sink}_exclude)")
    return out


def _wider_than_tier(t: cfg.TopicsConfig, sink: str) -> str | None:
    """How ``sink``'s topic filter (compaction's, the mirror's: they read the tier) takes a topic
    the tier's leaves out, judged by the settings' words (globs are not compared by what they
    match); None when it does not."""
    classes, include, exclude = (_globs(getattr(t, sink + part)) for part in ("", "_include", "_exclude"))
    extra = [c for c in classes if c not in _globs(t.tier)]
    if extra:
        return f"topics.{sink} takes the class(es) {', '.join(extra)}, which topics.tier ({t.tier!r}) leaves out"
    left_out = [p for p in _globs(t.tier_exclude) if p not in exclude]
    if left_out:
        return f"topics.tier_exclude leaves out {', '.join(left_out)}, which topics.{sink}_exclude does not"
    extra = [p for p in include if p not in _globs(t.tier_include)]
    if extra and set(_globs(t.tier)) != set(CLASSES):
        return f"topics.{sink}_include takes {', '.join(extra)}, which topics.tier_include does not"
    return None


# Each part on its own, so `tierlog config check` can list every bad setting, not only the first.
PARTS = (topic_filters, retention, ttl, local_retention_s, tables, kafka_settings)
