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
from dataclasses import dataclass

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.topics import CLASSES, TopicFilter
from connectors.errors import ConfigError
from connectors.kafka.settings import KafkaSettings, parse_topic_map
from connectors.sinks import FILTERED_SINKS
from connectors.tables.catalog import TableSettings, default_settings
from connectors.tier.copies import CopySettings
from connectors.tier.retention import Retention
from connectors.tier.staging import StageSettings
from connectors.tier.writer import WriterSettings
from streaming import config as cfg


@dataclass(frozen=True)
class Settings:
    conf: cfg.Config
    filters: dict[str, TopicFilter]  # sink (tier, compaction, mirror) -> its topic filter
    ttl: dict[str, float] | None  # compaction.ttl: topic -> seconds; None: keys never expire
    retention: Retention  # tier.retention, retention_bytes, retention_messages
    local_retention_s: float  # commitlog.local_retention
    reader: ReaderOptions  # how every commitlog reader of this broker reads
    copies: CopySettings | None  # tier.local_copy_bytes on an S3 tier; None: every read back is a GET
    stage: StageSettings  # the tiering query's stagers
    writer: WriterSettings  # the tier writer
    tables: TableSettings | None  # the Iceberg message tables; None: tables.enabled is off
    driver_stage_bytes: int  # tier.stage_on_driver: tiering batches up to this size are staged by the driver; 0: none
    stage_processes: int  # tier.stage_in_processes, resolved: larger tiering batches are staged by this many; 0: Spark
    kafka: KafkaSettings | None  # the Kafka sinks'; None when kafka.bootstrap is empty (they are off)
    source: dict  # the commitlog source's options (strings, as Spark hands them over), from ``reader``


def derive(conf: cfg.Config) -> Settings:
    """Every typed setting of ``conf``; raises ``ConfigError`` naming the first bad one."""
    t = conf.tier
    filters, kept, reader, copies = topic_filters(conf), retention(conf), reader_options(conf), local_copies(conf)
    return Settings(
        conf=conf,
        filters=filters,
        ttl=ttl(conf),
        retention=kept,
        local_retention_s=local_retention_s(conf),
        reader=reader,
        copies=copies,
        stage=StageSettings(location=t.location, reader=reader, filters=filters, copies=copies),
        writer=WriterSettings(location=t.location, broker=conf.broker.name, segment_bytes=t.segment_bytes,
                              segment_messages=t.segment_messages, segment_age_s=t.segment_age_s,
                              retention=kept, fold_every=max(1, t.fold_every), delete_grace_s=t.delete_grace_s,
                              copies=copies),
        tables=tables(conf),
        driver_stage_bytes=conf.source.partition_bytes if t.stage_on_driver else 0,
        stage_processes=stage_processes(conf),
        kafka=kafka_settings(conf),
        source=source_options(conf, reader),
    )


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


def kafka_settings(conf: cfg.Config) -> KafkaSettings | None:
    """The Kafka sinks' settings; None when ``kafka.bootstrap`` is empty (the sinks are off)."""
    k = conf.kafka
    if not k.bootstrap.strip():
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
                            commit_interval_s=t.commit_interval_s, snapshots_kept=max(1, t.snapshots_kept))


def compaction_settings(settings: Settings):
    """The compaction query's handler settings (``state.kv_writer.CompactionSettings``)."""
    from state.kv_writer import CompactionSettings

    conf, c = settings.conf, settings.conf.compaction
    return CompactionSettings(reader=settings.reader, tier_location=conf.tier.location, ttl=settings.ttl,
                              snapshot_interval_s=c.snapshot_interval_s, snapshot_keep=max(1, c.snapshot_keep),
                              topics=settings.filters["compaction"], tables=settings.tables,
                              references=references(settings))


def references(settings: Settings):
    """Which values the KV view keeps as references into the tier (``state.kv_refs.ReferencePolicy``)."""
    from state.kv_refs import ReferencePolicy

    return ReferencePolicy(max(0, settings.conf.compaction.reference_min_bytes), settings.retention)


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
    consumers = {"compaction": conf.compaction.enabled,
                 "mirror": bool(conf.kafka.bootstrap.strip()) and conf.kafka.mirror}
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
