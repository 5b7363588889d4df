"""The ``commitlog`` PySpark data source: a RocketMQ commitlog as a stream of message rows.

    spark.readStream.format("commitlog").option("path", "data/commitlog").load()

Offsets are ``{"phy_offset": N, "from": M}``: the physical offset where the next batch
starts (§8 of docs/commitlog-format.md), and where the batch that ends there began, so a
batch's range is in its own entry of the offset log (a first batch's too, whose start no
earlier entry holds).  A restarted query resumes strictly at the offset in its checkpoint,
so no message is read twice or skipped.

Options (all optional except ``path``):

=====================  ====================================================
``path``               the commitlog directory
``maxRecordsPerTrigger``  at most this many messages per micro-batch
``maxBytesPerTrigger``    at most this many commitlog bytes per micro-batch
``followBytesPerTrigger`` while at most 4 times this many bytes are past a batch's start (the
                       stream follows the log's head), the batch holds at most this many; more
                       is a catch-up, up to ``maxBytesPerTrigger``
``partitionBytes``     split a batch into Spark partitions of about this many
                       bytes, and always at file boundaries (default 64 MiB)
``startingOffset``     ``earliest`` (default), ``latest``, or a physical offset
``checkCrc``           verify every body CRC (default ``true``)
``keyProperty``        the property whose first word is the ``key`` column (``KEYS``)
``refsOnly``           ``true``: rows are only ``(phy_offset, size)`` references to the
                       records, for queries that read the bytes themselves (tiering)
``columns``            comma-separated columns of the message row to produce (all by
                       default); columns not asked for are not decoded at all
``topics``             a topic filter (``TopicFilter.to_json()``): only messages of the
                       topics it accepts are produced (needs the ``topic`` column)
``broker``             the broker name every row carries in ``broker`` (``broker-a``)
``onMissing``          ``fail`` (default) or ``skip``: files deleted before they were read
``minBytesPerTrigger``    a micro-batch waits until this many bytes are there ...
``maxTriggerDelayMs``     ... or until the first of them has waited this long (both, as
                       Spark's Kafka source's ``minOffsetsPerTrigger`` and ``maxTriggerDelay``)
=====================  ====================================================

Why the last two: a micro-batch costs Spark several hundred ms of CPU whatever it holds (a
stateful one most), so on a quiet broker a query that runs one a second costs most of a core for
a few messages.  Waiting for bytes or a delay runs a quiet stream's batches seconds apart, and a
busy one's as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from connectors.brokers import DEFAULT_BROKER, broker_name_problem
from connectors.commitlog.topics import TopicFilter

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from connectors.commitlog.arrow import MESSAGE_DDL
from streaming.sources.hold import BatchHold
from streaming.sources.options import columns as parse_columns, flag, positive
from connectors.commitlog.reader import ON_CORRUPT, ON_MISSING, CommitLogReader, ReaderOptions, ScanResult, cut
from connectors.errors import ConfigError
from connectors.task_cpu import counted

DEFAULT_PARTITION_BYTES = 64 << 20
FOLLOW_BACKLOG = 4  # more than this many followBytesPerTrigger past a batch's start is a catch-up


@dataclass(frozen=True)
class SourceOptions:
    """The data source's options, parsed and checked once, on the driver."""

    reader: ReaderOptions  # the commitlog (option path) and how it is read
    max_records: int | None = None
    max_bytes: int | None = None
    follow_bytes: int | None = None  # followBytesPerTrigger
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    starting_offset: str = "earliest"
    refs_only: bool = False
    columns: tuple[str, ...] | None = None
    topics: TopicFilter | None = None
    min_bytes: int = 0  # minBytesPerTrigger: 0 runs a batch as soon as anything is there
    max_delay_s: float = 0.0  # maxTriggerDelayMs, in seconds

    def open(self, check_crc: bool = False) -> CommitLogReader:
        """A reader of the commitlog as these options read it (the CRC only where bodies are decoded)."""
        return self.reader.open(check_crc=check_crc and self.reader.check_crc)

    @classmethod
    def parse(cls, options: dict) -> "SourceOptions":
        opts = {k.lower(): v for k, v in options.items()}
        path = opts.get("path")
        if not path:
            raise ConfigError("the commitlog source needs option `path`: the commitlog directory")
        if not os.path.isdir(path):
            raise ConfigError(
                f"commitlog directory {path!r} (option `path`) does not exist; "
                "create it, or point `commitlog.dir` at a broker's store/commitlog"
            )
        start = opts.get("startingoffset", "earliest")
        if start not in ("earliest", "latest") and not start.isdigit():
            raise ConfigError(f"option startingOffset={start!r}: use earliest, latest or a physical offset")
        base = ReaderOptions(path)  # an option not given reads as every reader of a commitlog does
        return cls(
            reader=ReaderOptions(path, check_crc=flag(opts, "checkcrc", "checkCrc", base.check_crc),
                                 on_corrupt=_on_corrupt(opts.get("oncorrupt", base.on_corrupt)),
                                 broker=_broker(opts.get("broker", base.broker)),
                                 key_property=opts.get("keyproperty", base.key_property),
                                 on_missing=_on_missing(opts.get("onmissing", base.on_missing))),
            max_records=positive(opts, "maxrecordspertrigger", "maxRecordsPerTrigger"),
            max_bytes=positive(opts, "maxbytespertrigger", "maxBytesPerTrigger"),
            follow_bytes=positive(opts, "followbytespertrigger", "followBytesPerTrigger"),
            partition_bytes=positive(opts, "partitionbytes", "partitionBytes") or DEFAULT_PARTITION_BYTES,
            starting_offset=start,
            refs_only=flag(opts, "refsonly", "refsOnly", False),
            columns=parse_columns(opts.get("columns")),
            topics=_topics(opts.get("topics"), parse_columns(opts.get("columns")), flag(opts, "refsonly", "refsOnly", False)),
            min_bytes=positive(opts, "minbytespertrigger", "minBytesPerTrigger") or 0,
            max_delay_s=(positive(opts, "maxtriggerdelayms", "maxTriggerDelayMs") or 0) / 1000,
        )


def _broker(value: str) -> str:
    problem = broker_name_problem(value)
    if problem:
        raise ConfigError(f"option broker: {problem}")
    return value


def _topics(raw: str | None, columns: tuple[str, ...] | None, refs_only: bool) -> TopicFilter | None:
    if not raw:
        return None
    if refs_only or (columns is not None and "topic" not in columns):
        raise ConfigError("option topics needs the topic column: leave refsOnly off and include topic in columns")
    try:
        return TopicFilter.from_json(raw)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"option topics={raw!r} is not a topic filter: {exc}") from None


def _on_missing(value: str) -> str:
    if value not in ON_MISSING:
        raise ConfigError(f"option onMissing={value!r}: use fail or skip")
    return value


def _on_corrupt(value: str) -> str:
    if value not in ON_CORRUPT:
        raise ConfigError(f"option onCorrupt={value!r}: use fail or quarantine")
    return value


class CommitLogPartition(InputPartition):
    """Records in ``[start, end)`` of one commitlog file; ``end`` is a known record boundary."""

    def __init__(self, start: int, end: int):
        super().__init__((start, end))
        self.start, self.end = start, end


def plan_partitions(reader: CommitLogReader, start: int, end: int, split_bytes: int) -> list[CommitLogPartition]:
    """Cut ``[start, end)`` at every file boundary and about every ``split_bytes``."""
    if end <= start:
        return []
    return to_partitions(start, reader.scan(start, end, split_bytes=split_bytes).splits, end)


def starting_offset(reader: CommitLogReader, start: str) -> int:
    """Where a stream with a new checkpoint starts (``startingOffset``: earliest, latest or a
    physical offset, as ``SourceOptions.parse`` checked it)."""
    if start == "earliest":
        return reader.first_offset()
    if start == "latest":
        return reader.end_offset()
    return int(start)


def batch_scan(reader: CommitLogReader, opts: SourceOptions, begin: int, target: int | None,
               max_records: int | None, max_bytes: int | None, draining: bool) -> ScanResult:
    """The header walk of the batch that starts at ``begin``, as ``latestOffset`` cuts it: at most
    ``max_records`` and ``max_bytes`` (``follow_cap``), never past ``target``, with its splits."""
    max_bytes = follow_cap(reader, begin, max_bytes, None if draining else opts.follow_bytes)
    return reader.scan(begin, target, max_records=max_records, max_bytes=max_bytes, split_bytes=opts.partition_bytes)


def expected_batch(reader: CommitLogReader, opts: SourceOptions, begin: int, draining: bool) -> ScanResult:
    """The batch a stream under its default read limit would run from ``begin`` with the log as it
    is now: a later call of ``latestOffset`` cuts the same batch, or a shorter one when a drain's
    end (fixed when it began) comes first, or, following the head, a longer one when the log has
    grown.  Only its splits before the end are sure: a split depends on nothing past it."""
    return batch_scan(reader, opts, begin, None, opts.max_records, opts.max_bytes, draining)


def follow_cap(reader: CommitLogReader, begin: int, max_bytes: int | None, follow: int | None) -> int | None:
    """``max_bytes`` held to ``follow`` (``followBytesPerTrigger``) while the stream follows the
    log's head.

    Why: tiering stages a batch within ``source.partition_bytes`` on the driver, a larger one in
    Spark's tasks at more CPU a message.  On a busy host a batch that ran long let the next grow
    past it, into Spark's tasks, and the tier fell further behind; held, the tier's p99 fell.  But
    a catch-up in small batches ran at half the rate of large ones (docs/benchmarks.md), hence the
    4x bound.

    A drain (availableNow, ``--until-caught-up``) follows no head, so its caller passes no
    ``follow``: it stops at an end fixed when it began, so its last batches are as large as its
    first.  Held, its last batches went one small batch at a time, staged by the driver on one core."""
    if not follow or max_bytes is None or max_bytes <= follow:
        return max_bytes  # no cap (ReadAllAvailable) stays none
    return follow if reader.end_offset() - begin <= FOLLOW_BACKLOG * follow else max_bytes


def to_partitions(start: int, splits: tuple[int, ...], end: int) -> list[CommitLogPartition]:
    return [CommitLogPartition(a, b) for a, b in cut(start, splits, end)]


REFS_DDL = "phy_offset bigint, size int"
REFS_SCHEMA = pa.schema([("phy_offset", pa.int64()), ("size", pa.int32())])


def read_partition(opts: SourceOptions, partition: CommitLogPartition):
    """Decode one partition into Arrow batches; opens the files here, on the executor."""
    with opts.open(check_crc=True) as reader:
        if opts.refs_only:
            for span in reader.spans(partition.start, partition.end):
                starts = np.asarray(span.starts, np.int64) + span.file.base
                yield pa.RecordBatch.from_arrays(
                    [pa.array(starts), pa.array(np.asarray(span.sizes, np.int32))], schema=REFS_SCHEMA
                )
        else:
            for batch in reader.record_batches(
                partition.start, partition.end, key_property=opts.reader.key_property, columns=opts.columns
            ):
                if opts.topics is not None and batch.num_rows:
                    batch = batch.filter(opts.topics.mask(batch.column("topic")))
                yield batch


class CommitLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Tails a commitlog directory; see the module docstring for options and offsets."""

    def __init__(self, opts: SourceOptions):
        self.opts = opts
        self._target: int | None = None  # availableNow: never read past this
        self._reader: CommitLogReader | None = None
        self._planned: tuple[int, int, tuple[int, ...]] | None = None  # the last latestOffset's walk: start, end, cuts
        self._hold = BatchHold(opts.min_bytes, opts.max_delay_s)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reader"] = None  # mmaps stay on the driver; read() opens its own
        return state

    @property
    def reader(self) -> CommitLogReader:
        if self._reader is None:
            self._reader = self.opts.open()
        return self._reader

    def initialOffset(self) -> dict:
        return {"phy_offset": starting_offset(self.reader, self.opts.starting_offset)}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records:
            return ReadMaxRows(self.opts.max_records)
        if self.opts.max_bytes:
            return ReadMaxBytes(self.opts.max_bytes)
        return ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """Where a batch starting at ``start`` should end, respecting ``limit``.

        Under ``ReadAllAvailable`` the configured per-trigger caps are ignored,
        as Spark requires; otherwise both caps apply.  The end never passes the
        availableNow target, so ``--until-caught-up`` terminates.
        """
        begin = int(start["phy_offset"])
        max_records = max_bytes = None
        if not isinstance(limit, ReadAllAvailable):
            max_records = limit.max_rows if isinstance(limit, ReadMaxRows) else self.opts.max_records
            max_bytes = limit.max_bytes if isinstance(limit, ReadMaxBytes) else self.opts.max_bytes
        # Nothing to read returns ``start`` itself: Spark runs a batch whenever the offset differs.
        if self._target is not None and begin >= self._target:
            return start
        result = batch_scan(self.reader, self.opts, begin, self._target, max_records, max_bytes,
                            draining=self._target is not None)
        if result.end <= begin or self._hold.held_back(begin, result.end, draining=self._target is not None):
            return start
        self._planned = (begin, result.end, result.splits)  # partitions() of this range needs no second walk
        return {"phy_offset": result.end, "from": begin}

    def reportLatestOffset(self) -> dict:
        return {"phy_offset": self.reader.end_offset()}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.reader.end_offset()

    def partitions(self, start: dict, end: dict) -> list[CommitLogPartition]:
        begin, stop = int(start["phy_offset"]), int(end["phy_offset"])
        if self._planned is not None and self._planned[:2] == (begin, stop):
            return to_partitions(begin, self._planned[2], stop)
        return plan_partitions(self.reader, begin, stop, self.opts.partition_bytes)

    def read(self, partition: CommitLogPartition):
        return counted("commitlog read", read_partition(self.opts, partition))

    def commit(self, end: dict) -> None:
        pass  # the log is append-only; retention is driven by the safepoint, not by this source

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class CommitLogBatchReader(DataSourceReader):
    """``spark.read.format("commitlog")``: everything in the log now, for inspection and audits."""

    def __init__(self, opts: SourceOptions):
        self.opts = opts

    def partitions(self) -> list[CommitLogPartition]:
        with self.opts.open() as reader:
            start = reader.first_offset()
            return plan_partitions(reader, start, reader.end_offset(), self.opts.partition_bytes)

    def read(self, partition: CommitLogPartition):
        return read_partition(self.opts, partition)


class CommitLogDataSource(DataSource):
    """The ``commitlog`` format: a RocketMQ commitlog directory as message rows."""

    @classmethod
    def name(cls) -> str:
        return "commitlog"

    def schema(self) -> str:
        opts = {k.lower(): v for k, v in self.options.items()}
        if str(opts.get("refsonly", "false")).lower() == "true":
            return REFS_DDL
        columns = parse_columns(opts.get("columns"))
        return MESSAGE_DDL if columns is None else project_ddl(columns)

    def streamReader(self, schema) -> CommitLogStreamReader:
        return CommitLogStreamReader(SourceOptions.parse(dict(self.options)))

    def reader(self, schema) -> CommitLogBatchReader:
        return CommitLogBatchReader(SourceOptions.parse(dict(self.options)))
