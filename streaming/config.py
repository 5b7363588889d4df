"""tierlog's configuration: one frozen dataclass tree, documented where it is defined.

Values are layered, each layer overriding the one before:

1. the defaults below;
2. the TOML file (``--config``, else ``./tierlog.toml`` when it exists);
3. environment variables ``TIERLOG_<SECTION>_<KEY>``, e.g. ``TIERLOG_TIER_LOCATION``;
4. command-line flags.

Every error names the setting (``section.key``) and where the bad value came
from.  AWS credentials and endpoints are *not* settings: boto3 reads the
standard ``AWS_*`` variables and its default credential chain.

It is longer than most modules because it is the one place every setting is
declared with its documentation, and the documentation is the bulk of it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from connectors.brokers import DEFAULT_BROKER, broker_name_problem
from connectors.tables.catalog import TableSettings
from connectors.kafka.settings import PRODUCERS
from connectors.errors import ConfigError

log = logging.getLogger("tierlog.config")

ENV_PREFIX = "TIERLOG_"
DEFAULT_FILE = "tierlog.toml"
# Variables with the prefix that are not settings.
_ENV_NOT_SETTINGS = {"TIERLOG_CONFIG", "TIERLOG_FAULT", "TIERLOG_FAULT_DIR", "TIERLOG_FAULT_DISK_FULL", "TIERLOG_FAULT_LATE_WORKER", "TIERLOG_READ_LOG",
                     "TIERLOG_NAMED_THREADS", "TIERLOG_TASK_CPU", "TIERLOG_TEST_KAFKA"}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def setting(default: Any, doc: str, *, choices: tuple = (), secret: bool = False, size: bool = False, check=None):
    """A field with its one-line documentation (shown by `config show` and in docs/configuration.md).
    ``check(value)`` returns why a value is wrong, or None."""
    return field(default=default, repr=not secret,  # a secret never reaches a log line through repr()
                 metadata={"doc": doc, "choices": choices, "secret": secret, "size": size, "check": check})


class SettingError(ConfigError):
    """A value a setting cannot take; ``reason`` is the message without the setting's name."""

    def __init__(self, setting_name: str, reason: str):
        super().__init__(f"setting {setting_name}: {reason}")
        self.reason = reason


def parsed_by(parse, **kw):
    """A ``setting(check=...)`` that runs a parser of this module at load, so a bad duration or limit
    fails there, naming where it came from, rather than later in whichever command parses it."""
    def check(value: str) -> str | None:
        try:
            parse(value, "", **kw)
        except SettingError as exc:
            return exc.reason
        return None
    return check


def body_format_problem(value: str) -> str | None:
    from connectors.bodies.formats import BodyFormats
    from connectors.errors import ConfigError

    try:
        BodyFormats(value)
    except ConfigError as e:
        return str(e).split(": ", 1)[1]
    return None


def topic_classes_problem(value: str) -> str | None:
    from connectors.commitlog.topics import CLASSES

    unknown = [c for c in (p.strip() for p in value.split(",")) if c and c not in CLASSES]
    if unknown:
        return f"{', '.join(map(repr, unknown))} is not a topic class; use any of {', '.join(CLASSES)}"
    return None


@dataclass(frozen=True)
class BrokerConfig:
    name: str = setting(DEFAULT_BROKER, "The RocketMQ brokerName whose commitlog this is (a master and its replicas "
                        "share it). Several brokers' tierlogs may write one tier and one set of Kafka topics: give "
                        "each its own.", check=broker_name_problem)


@dataclass(frozen=True)
class CommitlogConfig:
    dir: str = setting("data/commitlog", "Directory of the mapped files; a broker's store/commitlog works as is.")
    file_size: int = setting(1 << 30, "Size of each file the embedded producer creates (RocketMQ: 1 GiB).", size=True)
    fsync: str = setting(
        "interval", "When the embedded producer syncs appends: always, interval or never.",
        choices=("always", "interval", "never"),
    )
    fsync_interval_s: float = setting(1.0, "Seconds between syncs under fsync = interval.")
    check_crc: bool = setting(True, "Verify every message body's CRC while reading.")
    on_corrupt: str = setting(
        "fail", "A corrupt record: fail (stop, naming the file and offset) or quarantine (skip it, record the "
        "range in the metadata and `status`, go on).", choices=("fail", "quarantine"),
    )
    key_property: str = setting("KEYS", "Property whose first space-separated word is a message's key.")
    local_retention: str = setting(
        "1h", "`tierlog commitlog gc` deletes files below the safepoint once they are this old (s, m, h, d).",
        check=parsed_by(lambda v, n: parse_duration(v, n)),
    )
    headroom_warn_fraction: float = setting(
        0.1, "Warn when the commitlog bytes the broker may delete before it reaches what tierlog has yet to read "
        "fall under this fraction of the retained bytes (the headroom: `status`, "
        "tierlog_commitlog_headroom_bytes)."
    )
    headroom_warn_s: float = setting(
        3600.0, "Warn, too, when that headroom in store time falls under this many seconds "
        "(tierlog_commitlog_headroom_seconds)."
    )


@dataclass(frozen=True)
class SourceConfig:
    max_records_per_trigger: int = setting(0, "At most this many messages per micro-batch (0: no cap).")
    max_bytes_per_trigger: int = setting(
        256 << 20, "At most this many commitlog bytes per micro-batch (0: no cap). While tiering follows the "
        "log's head (at most 4 x source.partition_bytes behind), a batch holds at most source.partition_bytes, "
        "which the driver stages (tier.stage_on_driver); this bound is for catching up.", size=True
    )
    partition_bytes: int = setting(32 << 20, "Split each micro-batch into Spark tasks of about this size.", size=True)
    starting_offset: str = setting(
        "earliest", "Where a query with a new checkpoint starts: earliest, latest or a physical offset."
    )
    on_missing: str = setting(
        "fail", "Commitlog files deleted before tierlog read them (the broker's retention outran it): fail (stop, "
        "naming the range) or skip (record the range as a gap, which `status` reports until `tierlog gap ack`, "
        "and go on from the oldest retained file).", choices=("fail", "skip"),
    )


@dataclass(frozen=True)
class TierConfig:
    location: str = setting("data/tier", "Where the tier lives: a directory, or s3://bucket/prefix. A directory "
                               "holds topics of up to 249 bytes once escaped (file names hold 255); longer ones "
                               "(a long retry or dead-letter topic) are refused by name and need S3.")
    segment_bytes: int = setting(128 << 20, "Seal a queue's staged messages into a segment at this many bytes.", size=True)
    segment_messages: int = setting(1_000_000, "Seal a queue's staged messages into a segment at this many messages.")
    segment_age_s: float = setting(600.0, "Seal a queue's staged messages once the oldest batch is this many seconds old.")
    retention: str = setting(
        "", "Time to live in the tier, `*=7d,orders=30d` (per topic, * for the rest); empty keeps forever.",
        check=parsed_by(lambda v, n: parse_topic_durations(v, n)),
    )
    retention_bytes: str = setting(
        "", "Bytes of sealed segments each queue keeps, `*=10GiB,orders=1TiB` (per topic, * for the rest); the "
            "oldest segments go first, as Kafka's retention.bytes per partition. Empty: no limit.",
        check=parsed_by(lambda v, n: parse_topic_limits(v, n, size=True)),
    )
    retention_messages: str = setting(
        "", "Messages each queue keeps, `*=1000000` (per topic, * for the rest); whole oldest segments go first. "
            "Empty: no limit.",
        check=parsed_by(lambda v, n: parse_topic_limits(v, n)),
    )
    delete_grace_s: float = setting(60.0, "Seconds a retired object stays readable before it is deleted.")
    stage_on_driver: bool = setting(
        True, "Stage a tiering micro-batch that fits in one Spark task (source.partition_bytes) on the driver, "
              "without a Spark job: a job's own cost is most of a small batch's time, so this is what makes a "
              "message visible sooner. Larger batches (catching up) are staged in parallel (tier.stage_in_processes). "
              "On a cluster the driver then reads the commitlog too."
    )
    stage_in_processes: bool = setting(
        True, "Stage a larger tiering micro-batch (catching up) in processes of the driver's own, one per core of a "
              "local spark.master (local[N]), each a source.partition_bytes range, instead of Spark's tasks: faster, "
              "as a local master's tasks run on this host anyway. Off, or on a cluster master: Spark's tasks."
    )
    local_copy_bytes: int = setting(
        512 << 20, "On an S3 tier, keep the staging objects just uploaded in state.dir as well, up to this many "
        "bytes (oldest out first), so compaction and the mirror read them back without a GET. 0: always GET.",
        size=True)
    fold_every: int = setting(200, "Commit records between folds of the tier's commit log into manifests (a fold "
                                "also happens once the records since the last one reach 8 MiB).")


@dataclass(frozen=True)
class StateConfig:
    dir: str = setting("data/state", "Local directory of the RocksDB stores: the metadata store and the KV view "
                       "(which keeps values of 1.5 KB and more in RocksDB's blob files: fewer rewrites, some more "
                       "disk until their garbage collection).")
    rocksdb_memory_mb: int = setting(
        512, "Memory bound (MB) for all of Spark's RocksDB state stores in one executor: block cache and write buffers."
    )


@dataclass(frozen=True)
class CompactionConfig:
    enabled: bool = setting(True, "Run the compaction query: the latest value per key, the KV view and snapshots.")
    ttl: str = setting(
        "", "Keys not updated for this long expire, per topic: `sessions=30m,*=7d` (* for the rest); empty: never.",
        check=parsed_by(lambda v, n: parse_topic_durations(v, n)),
    )
    snapshot_interval_s: float = setting(
        30.0, ("Seconds between compacted snapshots written to the tier, each of the topics whose keys changed "
               "since the last (a quiet topic's newest still stands), the first one this long after the service "
               "first starts on its KV view, and one at the end of `run --until-caught-up`; each is a commit of "
               "the topic's latest-per-key table, so the table follows the KV view within about this long (0: "
               "only by `tierlog kv snapshot`).")
    )
    snapshot_keep: int = setting(2, "Compacted snapshots kept per topic; older ones are deleted.")
    reference_min_bytes: int = setting(
        1 << 10, "The KV view keeps the value of a message stored at this many bytes or more as a reference into "
        "the tier (its queue and offset), read back from there when asked, instead of a copy: the view's writes "
        "were half the CPU of a catch-up. Values of topics with a tier retention stay copies. 0: every value is "
        "copied.", size=True)
    min_batch_bytes: int = setting(
        1 << 20, "A compaction micro-batch waits until this many commitlog bytes are there, or until "
        "compaction.max_batch_delay_s: a micro-batch costs Spark several hundred ms of CPU whatever it holds, so "
        "a quiet broker's KV view is then updated seconds apart instead of every trigger. 0: every trigger.",
        size=True)
    max_batch_delay_s: float = setting(
        5.0, "The longest a compaction micro-batch below compaction.min_batch_bytes waits: how far the KV view "
        "and the changelog may trail the tier on a quiet broker. 0: never waits.")
    max_batch_bytes: int = setting(
        0, "At most this many commitlog bytes a compaction micro-batch takes while it is behind (at least one "
        "tier batch). Over many keys a larger batch holds more repeats of each, so the KV view and the changelog "
        "write fewer changes. 0: four times source.max_bytes_per_trigger (1 GiB by default).", size=True)
    nice: int = setting(
        10, "The niceness (0-19) of compaction's threads: the KV view's, and on a local master Spark's task "
        "threads. On a full machine they run behind the tier, the mirror and the broker, and the KV view and "
        "the changelog trail instead; with idle cores it changes nothing. 0: as every other thread.",
        check=lambda v: None if v <= 19 else f"{v} is not a niceness: use 0 to 19")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = setting("checkpoints", "Root of the Spark checkpoints, one sub-directory per query: a local "
                                      "directory, or s3a://bucket/path (with hadoop-aws in spark.jars) or hdfs://.")


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap: str = setting("", "Kafka bootstrap servers, host:port[,host:port]; empty turns the Kafka sinks off.")
    mirror: bool = setting(True, "Replicate every message to Kafka (the mirror sink), when bootstrap is set.")
    changelog: bool = setting(
        True, "Send each changed key's latest value to a compacted topic (the changelog sink); needs compaction."
    )
    mirror_tasks: int = setting(
        0, "Parallel Spark tasks sending the mirror when Spark's tasks send it (a backfill, or "
        "kafka.mirror_driver_bytes 0), each owning some partitions (0: one per two cores with "
        "librdkafka, one per core with kafka-python)."
    )
    mirror_min_batch_bytes: int = setting(
        1 << 20, "A mirror batch waits until this many commitlog bytes are there, or until "
        "kafka.mirror_max_batch_delay_s, as compaction.min_batch_bytes does for the KV view. 0: every trigger.",
        size=True)
    # Why 3 s and not compaction's 5: a quiet broker's messages then reach Kafka within the owners'
    # 6 s at the p99, for no CPU the yardstick resolves (docs/benchmarks.md, "A quiet broker on the
    # yardstick").
    mirror_max_batch_delay_s: float = setting(
        3.0, "The longest a mirror batch below kafka.mirror_min_batch_bytes waits: how far Kafka may trail "
        "the tier on a quiet broker. 0: never waits.")
    # Why 32 MiB: a busy broker's tier batch must fit, or it goes to Spark's tasks and reaches Kafka
    # later; and every step of a catch-up is cheaper sent from the driver (docs/benchmarks.md, "The
    # mirror on the driver").
    mirror_driver_bytes: int = setting(
        32 << 20, "The driver sends the mirror itself, without a Spark job, in steps of at most this many bytes "
        "of staging objects (or one tier batch, if larger), the next step at once while more is committed: sooner "
        "in Kafka, and about 0.6 of the CPU a message of Spark's tasks, catching up included. A backfill goes to "
        "kafka.mirror_tasks Spark tasks. 0: every step from Spark's tasks.", size=True)
    # Off by default: on a full 2-core host the tier's p99 fell but Kafka's rose, as the sender no
    # longer took turns with the staging on the driver's one interpreter lock (docs/benchmarks.md).
    mirror_process: bool = setting(
        False, "Send the driver's mirror steps (kafka.mirror_driver_bytes) from a process of their own, so "
        "they do not share the driver's Python with the tier's staging: for a host with cores to spare. "
        "false: from a driver thread.")
    mirror_topic: str = setting("{topic}", "Kafka topic of the mirror; {topic} is the RocketMQ topic.")
    mirror_topic_map: str = setting("", "Explicit mirror topics, `orders=orders-mirror,...`; they win over mirror_topic.")
    changelog_topic: str = setting("{topic}.changelog", "Kafka topic of the changelog; {topic} is the RocketMQ topic.")
    changelog_topic_map: str = setting("", "Explicit changelog topics, `orders=orders-latest,...`.")
    auto_create_topics: bool = setting(True, "Create missing topics (changelog ones compacted); off: wait for them.")
    partitions: int = setting(8, "Partitions of the topics tierlog creates; the mirror sends each broker queue to one (crc32(broker) + queue id, modulo this).")
    replication_factor: int = setting(1, "Replication factor of the topics tierlog creates (3 on a real cluster).")
    compression: str = setting(
        "none", "Producer compression: none, gzip, lz4 or zstd; snappy needs the python-snappy package.", choices=("none", "gzip", "snappy", "lz4", "zstd")
    )
    # 20, not 5: librdkafka's threads take less CPU with fuller batches, and freshness as consumed from the
    # mirror topic did not change (docs/benchmarks.md).  A batch's flush sends what lingers, so the wait
    # never adds to a batch's end.
    linger_ms: int = setting(20, "Milliseconds the producer waits to fill a batch.")
    # 1 MiB, near librdkafka's own default (1,000,000 bytes): large bodies cost its threads less CPU in
    # fewer, fuller batches (the cost ledger, docs/benchmarks.md).
    batch_bytes: int = setting(1 << 20, "The producer's batch size per partition; keep it at or below "
                                        "kafka.max_request_size.", size=True)
    max_request_size: int = setting(1 << 20, "Largest record the producer sends (keep at or below the broker's).", size=True)
    delivery_timeout_s: float = setting(
        120.0, "Seconds the sink waits for Kafka to take its records before it starts over with a new producer from the positions it reads back (the client never drops a record by itself)."
    )
    on_too_large: str = setting(
        "fail", "A message larger than kafka.max_request_size: fail stops the query; skip records it (status) and goes on. Keep kafka.max_request_size at or below the broker's limit: a record the broker refuses stops the query either way.",
        choices=("fail", "skip"),
    )
    producer: str = setting(
        "librdkafka", "Client library the sinks send with: kafka-python, or librdkafka (confluent-kafka's, which the "
        "mirror and the changelog call through ctypes, a batch's records read from its Arrow buffers: about a third of "
        "the sending thread's CPU a record of the binding's produce, itself a fifth of kafka-python's).",
        choices=PRODUCERS,
    )
    native_send: bool = setting(
        True, "With kafka.producer = librdkafka: the mirror's batches go to librdkafka through ctypes, from their "
        "Arrow buffers, when the library the binding loaded passes a self-test at the first send (its version is "
        "the binding's, and one record sent to librdkafka's in-process mock broker comes back as sent); false, or "
        "a failed check: through the binding's produce, one call a record.")
    security_protocol: str = setting(
        "PLAINTEXT", "How to reach the brokers.", choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
    )
    sasl_mechanism: str = setting(
        "", "SASL mechanism under SASL_*: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.",
        choices=("", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
    )
    sasl_username: str = setting("", "SASL user name.")
    sasl_password: str = setting("", "SASL password (better set through TIERLOG_KAFKA_SASL_PASSWORD).", secret=True)
    ssl_cafile: str = setting("", "CA bundle (PEM) that signed the brokers' certificates, under SSL or SASL_SSL.")
    ssl_certfile: str = setting("", "Client certificate (PEM) for mutual TLS.")
    ssl_keyfile: str = setting("", "Client private key (PEM) for mutual TLS.")
    client_id: str = setting("tierlog", "Client id the brokers see in their logs and quotas.")


@dataclass(frozen=True)
class SparkConfig:
    master: str = setting("local[2]", "Spark master URL: local[N] or spark://host:port.")
    shuffle_partitions: int = setting(4, "spark.sql.shuffle.partitions; fixed once a stateful checkpoint exists.")
    trigger_interval_s: float = setting(1.0, "Seconds between micro-batches of `tierlog run`.")
    late_start_s: float = setting(
        300.0, "Seconds a query is started again, with backoff, while Spark's Python worker keeps connecting back "
               "too late for Spark's fixed 10 s (a busy host), before the run gives up.")
    jars: str = setting("", "Comma-separated local jar files Spark loads (spark.jars): hadoop-aws and the AWS SDK "
                            "v2 bundle for s3a:// checkpoints, say. tierlog never downloads them.")
    jit_c1_only: bool = setting(True, "The driver's JVM compiles with the JIT's first tier only "
                                      "(-XX:TieredStopAtLevel=1; under local[N], every Spark thread): less CPU, as "
                                      "little of its code stays hot (docs/benchmarks.md). false: both tiers, as a "
                                      "stock JVM.")
    transparent_huge_pages: bool = setting(
        False, "Let the kernel back the service's large allocations (the driver, its JVM and Python workers) with "
               "transparent huge pages. false: tierlog turns them off for its own processes (Linux's "
               "PR_SET_THP_DISABLE): catching up, a third less system CPU here. true: as the kernel is set up.")


@dataclass(frozen=True)
class TablesConfig:
    enabled: bool = setting(True, "Keep each topic's messages in an Apache Iceberg table (its sealed segments, "
                                  "registered in place, and fresh files of what was committed since), and each "
                                  "topic's latest values in another, so Spark, Trino, DuckDB and polars read what "
                                  "is committed within seconds. false: nothing touches a catalog.")
    catalog_uri: str = setting("", "The Iceberg catalog: a SQLAlchemy URL (sqlite:///path, postgresql://...) for a SQL "
                                   "catalog, or an http(s):// REST catalog. Empty: SQLite at state.dir/tables.db.")
    catalog_properties: str = setting("", "More catalog properties, `token=...,credential=...,s3.endpoint=...`.",
                                      secret=True)
    warehouse: str = setting("", "Where table metadata is written: a directory or s3://bucket/prefix. Empty: "
                                 "_tables/ in the tier.")
    namespace: str = setting("tierlog", "The catalog namespace of the tables.")
    name: str = setting("rmq_{topic}", "Table name; {topic} is the topic, characters other than letters, digits "
                                       "and _ made _.")
    latest_name: str = setting("rmq_{topic}_latest", "Name of each topic's latest-per-key table, committed with "
                                                     "each compacted snapshot (compaction.snapshot_interval_s).")
    commit_interval_s: float = setting(
        TableSettings.commit_interval_s, "The shortest time between two commits of one message table: a message "
        "is in its table within about this long of its commit on a busy broker. Expired segments are deleted only "
        "once their table has let them go.")
    min_commit_bytes: int = setting(
        TableSettings.min_commit_bytes, "A message table commits once its new rows reach this many bytes of the "
        "tier's staging objects, or have waited tables.max_commit_delay_s: a quiet topic's table commits seconds "
        "apart. 0: at every tables.commit_interval_s.", size=True)
    max_commit_delay_s: float = setting(
        TableSettings.max_commit_delay_s, "The longest a committed message waits for its table below "
        "tables.min_commit_bytes (the budget, tables.commits_per_minute, permitting).")
    commits_per_minute: int = setting(
        TableSettings.commits_per_minute, "The request budget: at most this many message table commits a minute, "
        "all tables together, longest waiting first (each commit writes about four objects: a data file, a "
        "manifest, a manifest list, the table's metadata), and half as many compacted snapshots, each a commit of "
        "a latest-per-key table. With more busy topics than fit, each table waits its turn.",
        check=lambda v: None if v >= 1 else "at least 1")
    snapshots_kept: int = setting(20, "Snapshots kept per message table (time travel this far back); older ones "
                                      "expire with the manifests only they referenced. Each kept snapshot slows "
                                      "every commit a little (docs/benchmarks.md).")


@dataclass(frozen=True)
class MetricsConfig:
    port: int = setting(9464, "Port of the Prometheus endpoint (/metrics) of `tierlog run`; 0 turns it off.")
    host: str = setting("127.0.0.1", "Address the metrics endpoint listens on (0.0.0.0 to be scraped from outside).")


@dataclass(frozen=True)
class TopicsConfig:
    include: str = setting("*", "Topics any sink may take: comma-separated globs (`orders-*,users`).")
    exclude: str = setting("", "Topics no sink takes: comma-separated globs (a broker's cluster and broker names, "
                               "which it registers as system topics at start, say).")
    tier: str = setting("business,retry", "Topic classes the tier keeps: any of business, retry (%RETRY%, %DLQ%), "
                                          "system (RocketMQ's own topics).", check=topic_classes_problem)
    compaction: str = setting("business", "Topic classes the KV view, its snapshots and the Kafka changelog keep "
                                          "(within the tier's: the view is built from what the tier keeps).",
                              check=topic_classes_problem)
    mirror: str = setting("business", "Topic classes the Kafka mirror sends (within the tier's: it sends what the "
                                       "tier keeps).", check=topic_classes_problem)
    tier_include: str = setting("", "Topics the tier keeps whatever their class (globs).")
    tier_exclude: str = setting("", "Topics the tier leaves out (globs).")
    compaction_include: str = setting("", "Topics the KV view and changelog keep whatever their class (globs).")
    compaction_exclude: str = setting("", "Topics the KV view and changelog leave out (globs).")
    mirror_include: str = setting("", "Topics the Kafka mirror sends whatever their class (globs).")
    mirror_exclude: str = setting("", "Topics the Kafka mirror leaves out (globs).")
    body_format: str = setting("", "How topics' bodies are read into the message tables: `glob=format` pairs, "
                                   "`orders=json,events-*=json`, the first match winning. `json`: each top-level "
                                   "field of a JSON object body is a typed column beside the raw body, the types "
                                   "inferred from the data (docs/reading.md, \"Typed columns\"). Topics no glob "
                                   "matches stay `bytes`: the body alone.", check=body_format_problem)


@dataclass(frozen=True)
class Config:
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    commitlog: CommitlogConfig = field(default_factory=CommitlogConfig)
    source: SourceConfig = field(default_factory=SourceConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    state: StateConfig = field(default_factory=StateConfig)
    compaction: CompactionConfig = field(default_factory=CompactionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    spark: SparkConfig = field(default_factory=SparkConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tables: TablesConfig = field(default_factory=TablesConfig)
    # "section.key" -> where its value came from, for the settings that are not defaults.
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False,
                                       metadata={"not_a_section": True})

    def origin(self, dotted: str) -> str:
        """Where a setting's value came from, for an error: ``from tierlog.toml``, ``the default`` ..."""
        where = self.origins.get(dotted)
        return f"from {where}" if where else "the default"


def sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config) if not f.metadata.get("not_a_section")}  # type: ignore[misc]


def settings_reference() -> list[tuple[str, str, Any, str]]:
    """``(section.key, type, default, doc)`` for every setting, in definition order."""
    out = []
    for section, cls in sections().items():
        for f in fields(cls):
            out.append((f"{section}.{f.name}", _type_name(f), f.default, f.metadata["doc"]))
    return out


def _type_name(f: dataclasses.Field) -> str:
    if f.metadata.get("size"):
        return "size"
    return {int: "int", float: "float", bool: "bool", str: "string"}.get(_base_type(f), "string")


def _base_type(f: dataclasses.Field) -> type:
    return {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type), str)


def _size_bytes(num: str, unit: str | None) -> int:
    return int(num) * _UNITS[(unit or "")[:1].lower()]


def _coerce(f: dataclasses.Field, value: Any, name: str, origin: str) -> Any:
    """Turn a TOML value or a string from the environment or a flag into the field's type."""
    kind = _base_type(f)
    where = f"setting {name} (from {origin})"
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a whole number, got {value!r}")
        if isinstance(value, int):
            out = value
        elif isinstance(value, str) and f.metadata.get("size") and _SIZE.match(value):
            out = _size_bytes(*_SIZE.match(value).groups())
        elif isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            out = int(value)
        else:
            hint = " (sizes may use KiB, MiB, GiB)" if f.metadata.get("size") else ""
            raise ConfigError(f"{where}: expected a whole number{hint}, got {value!r}")
        if out < 0:
            raise ConfigError(f"{where}: must not be negative, got {out}")
        problem = f.metadata["check"](out) if f.metadata.get("check") else None
        if problem:
            raise ConfigError(f"{where}: {problem}")
        return out
    if kind is float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if out < 0:
            raise ConfigError(f"{where}: must not be negative, got {out}")
        return out
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}: must be one of {', '.join(choices)}; got {value!r}")
    problem = f.metadata["check"](value) if f.metadata.get("check") else None
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return value


# Settings that were renamed: an old name is refused naming the new one, not ignored.
RENAMED = {"tier.compact_every": "tier.fold_every"}
# Settings renamed lately: the old name still works, with a warning naming the new one.
DEPRECATED = {"tier.checkpoint_every": "tier.fold_every"}


def _apply(values: dict[str, dict[str, Any]], section: str, key: str, raw: Any, origin: str,
           origins: dict[str, str]) -> None:
    cls = sections().get(section)
    if cls is None:
        raise ConfigError(f"unknown section [{section}] (from {origin}); known: {', '.join(sections())}")
    by_name = {f.name: f for f in fields(cls)}
    if f"{section}.{key}" in DEPRECATED:
        new = DEPRECATED[f"{section}.{key}"]
        log.warning("setting %s.%s (from %s) is now %s: it still works, rename it there", section, key, origin, new)
        section, key = new.split(".")
    if f"{section}.{key}" in RENAMED:
        raise ConfigError(f"setting {section}.{key} (from {origin}) is now {RENAMED[f'{section}.{key}']}: "
                          "rename it there, the value means the same")
    if key not in by_name:
        raise ConfigError(
            f"unknown setting {section}.{key} (from {origin}); [{section}] has: {', '.join(by_name)}"
        )
    values.setdefault(section, {})[key] = _coerce(by_name[key], raw, f"{section}.{key}", origin)
    origins[f"{section}.{key}"] = origin


def _split_env(name: str) -> tuple[str, str]:
    rest = name[len(ENV_PREFIX) :].lower()
    for section in sorted(sections(), key=len, reverse=True):
        if rest.startswith(section + "_"):
            return section, rest[len(section) + 1 :]
    raise ConfigError(
        f"environment variable {name} is not a tierlog setting: use TIERLOG_<SECTION>_<KEY> "
        f"with a section of {', '.join(sections())}"
    )


def resolve_path(path: str | None) -> str | None:
    """The config file to read: the one given, else ./tierlog.toml if present, else none."""
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} (--config) does not exist")
        return path
    return DEFAULT_FILE if os.path.isfile(DEFAULT_FILE) else None


def load(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the effective configuration: defaults, then file, then env, then ``overrides``.

    ``overrides`` maps ``"section.key"`` to a value (from flags).
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    file = resolve_path(path or env.get("TIERLOG_CONFIG"))
    if file:
        try:
            with open(file, "rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file}: not valid TOML: {exc}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"config file {file}: `{section}` must be a [section] table")
            for key, raw in table.items():
                _apply(values, section, key, raw, file, origins)
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in _ENV_NOT_SETTINGS:
            section, key = _split_env(name)
            _apply(values, section, key, env[name], f"environment variable {name}", origins)
    for dotted, raw in (overrides or {}).items():
        if raw is None:
            continue
        section, _, key = dotted.partition(".")
        _apply(values, section, key, raw, "the command line", origins)
    return Config(**{s: cls(**values.get(s, {})) for s, cls in sections().items()}, origins=origins)


def bootstrap_servers(text: str) -> list[str]:
    """``kafka.bootstrap`` as a list of host:port entries (empty when the sinks are off)."""
    return [h.strip() for h in text.split(",") if h.strip()]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, setting_name: str) -> float:
    """``90``, ``90s``, ``15m``, ``6h``, ``7d`` to seconds."""
    m = _DURATION.match(text)
    if not m:
        raise SettingError(setting_name, f"{text!r} is not a duration like 90s, 15m, 6h or 7d")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_topic_durations(text: str, setting_name: str) -> dict[str, float] | None:
    """``*=7d,orders=30d`` to {topic: seconds} (``*``: every other topic); empty gives None."""
    if not text.strip():
        return None
    out = {}
    for item in text.split(","):
        topic, sep, duration = item.strip().rpartition("=")
        if not sep or not topic:
            raise SettingError(setting_name, f"{item.strip()!r} is not TOPIC=DURATION (use * for every topic)")
        out[topic] = parse_duration(duration, setting_name)
    return out


def parse_topic_limits(text: str, setting_name: str, *, size: bool = False) -> dict[str, int] | None:
    """``*=10GiB,orders=1TiB`` (or plain counts) to {topic: limit} (``*``: every other topic); empty gives None."""
    if not text.strip():
        return None
    out = {}
    for item in text.split(","):
        topic, sep, value = item.strip().rpartition("=")
        m = _SIZE.match(value) if size else re.match(r"^\s*(\d+)\s*$", value)
        if not sep or not topic or not m:
            what = "TOPIC=SIZE (like *=10GiB)" if size else "TOPIC=COUNT (like *=1000000)"
            raise SettingError(setting_name, f"{item.strip()!r} is not {what}; use * for every topic")
        out[topic] = _size_bytes(*m.groups()) if size else int(m.group(1))
    return out


def to_toml(config: Config, *, with_docs: bool = True) -> str:
    """The configuration as TOML, each setting preceded by its doc; secrets masked."""
    lines = []
    for section in sections():
        lines.append(f"[{section}]")
        sub = getattr(config, section)
        for f in fields(sub):
            value = getattr(sub, f.name)
            if f.metadata.get("secret") and value:
                value = "****"
            if with_docs:
                lines.append(f"# {f.metadata['doc']}")
            lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def as_dict(config: Config) -> dict:
    return {name: dataclasses.asdict(getattr(config, name)) for name in sections()}
