"""What each query's checkpoint was made with, so a start that would corrupt it is refused.

Spark keeps a query's offsets and state in its checkpoint, but not which
commitlog the offsets point into or which tier holds what they say was
written; and a changed shuffle partition count or state store provider is
silently overridden by the checkpoint's own (or fails deep inside Spark).
tierlog writes ``tierlog-checkpoint.json`` into each query's checkpoint on
its first start, and on every later start compares it with the config,
naming the setting that changed and what to do.

The checkpoint may be a local directory or any Hadoop path Spark can write
(``s3a://``, ``hdfs://``); the latter are read and written through Spark's JVM,
by :class:`Checkpoint`, which is also where the queries learn the offset range
of a batch from Spark's offset log.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Callable

from connectors.errors import ConfigError, TierlogError

FINGERPRINT = "tierlog-checkpoint.json"
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
STATE_PROVIDER = "spark.sql.streaming.stateStore.providerClass"

# Why changing each setting would corrupt a query's checkpoint.
WHY = {
    "broker.name": "its offsets are physical offsets of that broker's commitlog, and its outputs carry that name",
    "commitlog.dir": "its offsets are physical offsets in that commitlog (a replica of the same broker is "
                     "accepted when it holds the tier's last committed record byte for byte)",
    "tier.location": "it records what that tier holds; a new tier would lack everything before",
    "commitlog.key_property": "its state is keyed by that property",
    "spark.shuffle_partitions": "its state is split into that many partitions",
    "state store provider": "its state is stored in that provider's format",
}


def location_problem(jars: tuple[str, ...], root: str) -> str | None:
    """Why Spark could not use ``checkpoint.dir`` ``root`` (or a jar of ``spark.jars``), naming the
    setting; None when it can.  s3a:// needs Hadoop's s3a file system, which pyspark does not ship."""
    for jar in jars:
        if not os.path.isfile(jar.removeprefix("file://")):
            return f"spark.jars: {jar!r} does not exist"
    if root.startswith("s3a://") and not any("hadoop-aws" in os.path.basename(j) for j in jars):
        return (f"checkpoint.dir {root!r} needs Hadoop's s3a file system, which pyspark does not include: put "
                "hadoop-aws (the version of pyspark's Hadoop client) and the AWS SDK v2 bundle in spark.jars")
    return None


def s3a_settings() -> dict[str, str]:
    """Spark settings that point s3a:// at the S3 endpoint the tier uses (AWS_ENDPOINT_URL_S3), so
    one set of AWS_* variables serves the tier and the checkpoints."""
    out = {"spark.hadoop.fs.s3a.aws.credentials.provider":
           "software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["spark.hadoop.fs.s3a.endpoint"] = endpoint
        out["spark.hadoop.fs.s3a.path.style.access"] = "true"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        out["spark.hadoop.fs.s3a.endpoint.region"] = region
    return out


def is_local(root: str) -> bool:
    """Whether a checkpoint root is on the local file system (a path, or file://)."""
    return "://" not in root or root.startswith("file://")


# Spark's default checkpoint file manager goes through Hadoop's FileContext, which, without
# Hadoop's native library (pyspark does not ship it), starts a process for every path it looks
# at: ``readlink`` for each file and its .crc before and after a rename, ``chmod`` for each file it
# creates: at a short trigger with three queries, tens of processes a second from the driver's JVM
# (docs/benchmarks.md).  The FileSystem-based manager renames without looking at links, leaving one
# chmod per file and its .crc.  Its rename is atomic on a local file system,
# which is all Spark asks of it; other schemes keep Spark's default.
LOCAL_FILE_MANAGER = {
    "spark.sql.streaming.checkpointFileManagerClass":
        "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
}


def recorded_settings(spark, path: str) -> dict[str, str]:
    """The settings a query's checkpoint was made with (empty for a new one)."""
    store = Checkpoint(path, spark)
    text = store.read(FINGERPRINT)
    return json.loads(text)["settings"] if text else _from_offset_log(store)


def check_before_start(path: str, query: str, settings: dict[str, str], movable: tuple[str, ...] = ()) -> None:
    """``check_or_record``'s refusal, for a local checkpoint, before anything opens (no JVM, no
    store): what the fingerprint recorded against ``settings`` (those known without Spark)."""
    if not is_local(path):
        return
    text = Checkpoint(path).read(FINGERPRINT)
    if text:
        _refuse_changed(path, query, json.loads(text)["settings"], settings, movable)


def _refuse_changed(path: str, query: str, recorded: dict, settings: dict[str, str], movable: tuple[str, ...]) -> None:
    for name, value in settings.items():
        if name in recorded and recorded[name] != value and name not in movable:
            raise ConfigError(
                f"the {query} query's checkpoint {path} was made with {name} = {recorded[name]!r}, but this "
                f"start would use {value!r}: {WHY[name]}. Set {name} back, or give checkpoint.dir a new "
                f"directory to start the {query} query over (from source.starting_offset)"
            )


def check_or_record(spark, path: str, query: str, settings: dict[str, str], movable: tuple[str, ...] = ()) -> None:
    """Refuse with a ``ConfigError`` if ``path`` was made with other ``settings``; else record them.
    ``movable``: settings that may change (checked by the caller: a commitlog replica).

    A checkpoint made before fingerprints existed adopts the current settings, except what
    Spark's own offset log says about shuffle partitions and the state store provider.
    """
    store = Checkpoint(path, spark)
    text = store.read(FINGERPRINT)
    recorded = json.loads(text)["settings"] if text else _from_offset_log(store)
    _refuse_changed(path, query, recorded, settings, movable)
    if not text or recorded != settings:
        store.write(FINGERPRINT, json.dumps({"query": query, "settings": settings}, indent=1))


def _from_offset_log(store: "Checkpoint") -> dict[str, str]:
    """Shuffle partitions and provider from the newest entry of Spark's offset log, if any."""
    batches = [int(n) for n in store.list("offsets") if n.isdigit()]
    if not batches:
        return {}
    lines = (store.read(f"offsets/{max(batches)}") or "").splitlines()
    try:
        conf = json.loads(lines[1]).get("conf", {})
    except (IndexError, ValueError):
        return {}
    out = {}
    if SHUFFLE_PARTITIONS in conf:
        out["spark.shuffle_partitions"] = conf[SHUFFLE_PARTITIONS]
    if STATE_PROVIDER in conf:
        out["state store provider"] = conf[STATE_PROVIDER]
    return out


class OffsetLogError(TierlogError):
    """Spark's offset log of a checkpoint lacks or garbles the entry of a batch."""


class Batch:
    """One micro-batch as a query's handler gets it: Spark's DataFrame and id, and the physical
    offsets it covers, ``[start, end)``, from the query's offset log, read when first asked for (a
    query that needs no range reads nothing; tiering stages by it, compaction applies the view up
    to its end).  ``start`` is None when the log no
    longer (or never) held the batch before it: the batch's first reference is its start."""

    def __init__(self, df, batch_id: int, checkpoint: "Checkpoint"):
        self.df, self.batch_id, self._checkpoint = df, batch_id, checkpoint

    @cached_property
    def end(self) -> int:
        return self._checkpoint.batch_end(self.batch_id)

    @cached_property
    def start(self) -> int | None:
        begun = self._checkpoint.batch_start(self.batch_id)
        if begun is not None or self.batch_id == 0:
            return begun
        try:
            return self._checkpoint.batch_end(self.batch_id - 1)
        except OffsetLogError:
            return None  # purged by Spark, or the checkpoint began at this batch


def foreach_batch(checkpoint: str, process: Callable[[Batch], None]) -> Callable[[object, int], None]:
    """A ``foreachBatch`` function that hands ``process`` each batch with its offset range, so no
    handler reads Spark's files itself."""

    def handle(df, batch_id: int) -> None:
        process(Batch(df, batch_id, Checkpoint(checkpoint, df.sparkSession)))

    return handle


class Checkpoint:
    """One query's checkpoint: its small files, on the local file system or, for any other scheme,
    through Hadoop's file system in Spark's JVM (so ``spark`` is needed only then)."""

    def __init__(self, root: str, spark=None):
        self.root = root
        self.local = is_local(root)
        if root.startswith("file://"):
            self.root = root[len("file://"):]
        if not self.local:
            if spark is None:
                from pyspark.sql import SparkSession

                spark = SparkSession.getActiveSession()
            if spark is None:
                raise ConfigError(f"checkpoint {root} is read through Spark's Hadoop file system, and no Spark "
                                  "session is running here")
            jvm = self._jvm = spark.sparkContext._jvm
            self._path = lambda name: jvm.org.apache.hadoop.fs.Path(f"{root.rstrip('/')}/{name}")
            self._fs = self._path("").getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())

    def batch_end(self, batch_id: int) -> int:
        """The physical offset batch ``batch_id`` ends at, from the offset log Spark wrote before running it."""
        return int(self._offset(batch_id, "ends")["phy_offset"])

    def batch_start(self, batch_id: int) -> int | None:
        """Where batch ``batch_id`` began, when its own entry says (the commitlog source's ``from``);
        None for an entry without it (another source's, or one written before it was recorded)."""
        try:
            begun = self._offset(batch_id, "begins").get("from")
        except OffsetLogError:
            return None
        return int(begun) if isinstance(begun, int) else None

    def _offset(self, batch_id: int, what: str) -> dict:
        """The source's offset in batch ``batch_id``'s entry of the offset log (its last line)."""
        name = f"offsets/{batch_id}"
        text = self.read(name)
        try:
            if text is None:
                raise ValueError("no such file")
            lines = [line for line in text.splitlines() if line.strip()]
            offset = json.loads(lines[-1])
            if not isinstance(offset, dict) or "phy_offset" not in offset:
                raise ValueError(f"no phy_offset in {lines[-1][:200]!r}")
            return offset
        except (ValueError, IndexError) as exc:
            raise OffsetLogError(f"cannot read where batch {batch_id} {what} from {self.root}/{name}: {exc}") from None

    def last_committed_end(self) -> int | None:
        """Where the last batch Spark committed ends; None before the first commit."""
        ids = [int(n) for n in self.list("commits") if n.isdigit()]
        return self.batch_end(max(ids)) if ids else None

    def read(self, name: str) -> str | None:
        if self.local:
            try:
                with open(os.path.join(self.root, name)) as f:
                    return f.read()
            except FileNotFoundError:
                return None
        path = self._path(name)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            return self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
        finally:
            stream.close()

    def list(self, directory: str) -> list[str]:
        if self.local:
            try:
                return os.listdir(os.path.join(self.root, directory))
            except FileNotFoundError:
                return []
        path = self._path(directory)
        if not self._fs.exists(path):
            return []
        return [s.getPath().getName() for s in self._fs.listStatus(path)]

    def write(self, name: str, text: str) -> None:
        if self.local:
            os.makedirs(self.root, exist_ok=True)
            tmp = os.path.join(self.root, f".{name}.tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(self.root, name))
            return
        stream = self._fs.create(self._path(name), True)
        try:
            stream.write(bytearray(text.encode()))
        finally:
            stream.close()
