"""The ``tierfeed`` streaming source: the micro-batches of a query that consumes the tier's
committed batches (compaction) instead of the commitlog.

Its offsets are the commitlog source's own shape, ``{"phy_offset": N}``, and every one is the end
of a batch the tier committed, so a consumer's batch is whole tier batches: ``state.tier_feed`` lists
them.  The source yields the ``columns`` asked for of the batches' messages, read back from their
staging objects (``connectors.tier.feed``: decoded and CRC-checked once, by the stager), one
partition per ``PARTITION_BYTES`` of staging objects (or per backfill, or a task's share of a large
batch).  Spark gives the query its trigger, its offset log and its exactly-once bookkeeping, as for
every query of ``tierlog run``.

Options:

``metadata``         the metadata store's directory (read as a RocksDB secondary: no lock taken)
``startingOffset``   where a new checkpoint starts: a batch end the feed lists
``maxBytesPerTrigger``  at most about this many commitlog bytes a batch, as the ``commitlog``
                     source's (at least one tier batch)
``minBytesPerTrigger``, ``maxTriggerDelayMs``  hold a smaller batch back, at most this long, as
                     the ``commitlog`` source's (``streaming.sources.hold``)
``columns``          message columns to yield (comma-separated; required)
``location``, ``broker``  the tier and whose part of it
``localCopies``      ``connectors.tier.copies.CopySettings`` as JSON: read the stagers' local
                     copies where they are
``topics``           a ``TopicFilter`` as JSON: only its topics' rows are yielded
``tasks``            how many tasks Spark runs at once: a batch of more than that many
                     ``PARTITION_BYTES`` is that many partitions (each backfill still one of its own)
``latestPerKey``     ``true``: of each partition, only each ``(topic, key)``'s last message that
                     entered a queue (``columns`` must hold ``topic, key, phy_offset``; ``sysflag``, 0
                     if asked for), so fewer rows reach Spark's aggregation; the result of a
                     ``max(phy_offset)`` per key is the same

Under ``availableNow`` a batch ends at most at the tier's end when the query started.  ``tierlog
run --until-caught-up`` does not use it (the tier is still growing then): it runs the query on its
trigger and stops it once tiering is done and the query has applied all the tier committed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxBytes, SupportsTriggerAvailableNow

from connectors.commitlog.arrow import project_ddl
from connectors.commitlog.topics import TopicFilter
from connectors.tier.copies import CopySettings
from connectors.task_cpu import counted
from connectors.tier.feed import FeedBatch
from streaming.sources.hold import BatchHold
from streaming.sources.options import flag, offset, positive, required_columns
from state.tier_feed import listed_batches, listed_ends, next_end

log = logging.getLogger("tierlog.feed")


SCRATCH_PREFIX = "tierlog-feed-"  # then the owning process's pid, "-", and mkdtemp's own suffix


def _scratch_dir(root: str | None = None) -> str:
    """A new scratch directory for a secondary's own files, after removing those of processes that
    have ended.  Why: Spark ends the Python process that runs a streaming source without waiting for
    its ``stop()``, so the ``close`` below rarely ran: one test suite left over a thousand of them in
    /tmp, and a service one a restart."""
    root = root or tempfile.gettempdir()
    try:
        entries = list(os.scandir(root))
    except OSError:
        entries = []
    for entry in entries:
        owner = entry.name[len(SCRATCH_PREFIX):].split("-", 1)[0] if entry.name.startswith(SCRATCH_PREFIX) else ""
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class _Listing:
    """The metadata store's feed, read as a RocksDB secondary instance that catches up with the
    running service on each call: a read-only open would replay the store's whole WAL every trigger."""

    def __init__(self, path: str):
        self.path = path
        self.scratch = self.db = None
        self._open()

    def _open(self) -> None:
        """A new secondary.  Opened while the primary is writing its MANIFEST, RocksDB can refuse it
        for a moment (CI met "leveldb.BytewiseComparator: does not match existing comparator
        rocksdict" in a compaction query's latestOffset); a moment later it opens.  Any error is
        tried again, each time in a new scratch directory: a secondary's own files may be what failed."""
        from state.rocks import tried_again

        self.db = tried_again(self._open_secondary, f"the feed's RocksDB secondary of {self.path}",
                              attempts=10, retriable=lambda exc: True)

    def _open_secondary(self):
        from state.rocks import open_rdict

        self.scratch = _scratch_dir()
        try:
            return open_rdict(self.path, secondary=self.scratch)
        except Exception:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise

    def _catch_up(self) -> None:
        """Up to the primary.  A secondary that meets a file the primary has just replaced (its
        MANIFEST after a restart, say) fails; a new secondary reads the primary as it is now."""
        try:
            self.db.try_catch_up_with_primary()
        except Exception as exc:  # noqa: BLE001 - rocksdict raises plain Exception with RocksDB's message
            log.info("the feed's RocksDB secondary of %s could not catch up (%s): opening it again", self.path, exc)
            self.close()
            self._open()

    def batch_ends(self, start: int) -> list[tuple[int, int]]:
        """(end, commitlog bytes) of each listed batch that ends after ``start``, in order."""
        self._catch_up()
        return listed_ends(self.db, start)

    def batches(self, start: int, end: int) -> list[FeedBatch]:
        """The listed batches that hold anything of ``[start, end)``, as ``state.tier_feed.TierFeed.batches``."""
        self._catch_up()
        return listed_batches(self.db, start, end, self.path)

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
        shutil.rmtree(self.scratch, ignore_errors=True)


class FeedPartition(InputPartition):
    """What one task reads of the listed batches within ``[start, end)``: some staging objects
    (each as a ``FeedBatch`` of one object), or one backfill."""

    def __init__(self, batches: list[FeedBatch], start: int, end: int):
        super().__init__([b.to_json() for b in batches])
        self.batches, self.start, self.end = tuple(batches), start, end


# Staging objects one task reads together, at most (one larger object is a task of its own),
# unless a batch has more than ``tasks`` times this: then a task's share of it.
# Why: a Python task costs PySpark tens of ms of CPU whatever it reads, so a quiet broker's batch
# of many small objects is one task, not one an object (the cost ledger, docs/benchmarks.md), and a
# catch-up's large batch is one task per core rather than one per object, whose fixed costs were
# most of each task's time.
PARTITION_BYTES = 32 << 20


def feed_partitions(batches: list[FeedBatch], start: int, end: int,
                    max_bytes: int = PARTITION_BYTES, tasks: int = 0) -> list[FeedPartition]:
    """The listed ``batches`` as partitions: each backfill alone, the staging objects in physical
    order, grouped up to ``max_bytes``; or, when they hold more than ``tasks`` times that (``tasks``:
    how many Spark runs at once; 0: no such bound), cut into ``tasks`` runs of about equal bytes."""
    total = sum(obj[1] for batch in batches for obj in batch.objects)
    share = 0 < tasks and tasks * max_bytes < total
    out, group, size, before, slot = [], [], 0, 0, 0
    for batch in batches:
        if batch.backfill:
            out.append(FeedPartition([batch], start, end))
        for obj in batch.objects:
            mine = before * tasks // total if share else 0  # the task's share this object starts in
            if group and (mine != slot if share else size + obj[1] > max_bytes):
                out.append(FeedPartition(group, start, end))
                group, size = [], 0
            if not group:
                slot = mine
            group.append(FeedBatch(batch.start, batch.end, (obj,)))
            size += obj[1]
            before += obj[1]
    if group:
        out.append(FeedPartition(group, start, end))
    return out


class TierFeedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict):
        opts = {k.lower(): v for k, v in options.items()}
        self.path = opts["metadata"]
        self.columns = required_columns(opts.get("columns"))
        self.location = opts.get("location", "")
        self.broker = opts.get("broker") or None
        self.copies = CopySettings(**json.loads(opts["localcopies"])) if opts.get("localcopies") else None
        self.topics = TopicFilter.from_json(opts["topics"]) if opts.get("topics") else None
        self.latest_per_key = flag(opts, "latestperkey", "latestPerKey", False)
        self.tasks = positive(opts, "tasks", "tasks") or 0
        self.starting = offset(opts, "startingoffset", "startingOffset")
        self.max_bytes = positive(opts, "maxbytespertrigger", "maxBytesPerTrigger") or 0
        self._hold = BatchHold(positive(opts, "minbytespertrigger", "minBytesPerTrigger") or 0,
                               (positive(opts, "maxtriggerdelayms", "maxTriggerDelayMs") or 0) / 1000)
        self._target: int | None = None
        self._listing: _Listing | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_listing"] = None
        return state

    @property
    def listing(self) -> _Listing:
        if self._listing is None:
            self._listing = _Listing(self.path)
        return self._listing

    def initialOffset(self) -> dict:
        return {"phy_offset": self.starting}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxBytes(self.max_bytes) if self.max_bytes else ReadAllAvailable()

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        """The end of the last listed batch that fits ``limit`` (at least one; all under
        ``ReadAllAvailable``, as Spark requires), never past the availableNow target."""
        begin = int((start or self.initialOffset())["phy_offset"])
        cap = limit.max_bytes if isinstance(limit, ReadMaxBytes) else 0
        end = next_end(self.listing.batch_ends(begin), begin, cap, self._target)
        if self._hold.held_back(begin, end, draining=self._target is not None):
            return {"phy_offset": begin}
        return {"phy_offset": end}

    def prepareForTriggerAvailableNow(self) -> None:
        ends = self.listing.batch_ends(-1)
        self._target = ends[-1][0] if ends else self.starting

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, stop = int(start["phy_offset"]), int(end["phy_offset"])
        return feed_partitions(self.listing.batches(begin, stop), begin, stop, tasks=self.tasks) if stop > begin else []

    def read(self, partition):
        return counted("tierfeed read", read_partition(self.location, self.broker, self.columns, self.topics,
                                                       partition, self.latest_per_key, self.copies))

    def commit(self, end: dict) -> None:
        pass  # the handler releases what the mirror applied (state.tier_feed.TierFeed.release)

    def stop(self) -> None:
        if self._listing is not None:
            self._listing.close()
            self._listing = None


def read_partition(location: str, broker: str | None, columns: tuple[str, ...], topics: TopicFilter | None,
                   partition: FeedPartition, latest: bool = False, copies: CopySettings | None = None):
    """The rows of one partition: ``columns`` of its messages that ``topics`` takes (with ``latest``,
    each key's last; see the module's options)."""
    from connectors.tier.location import open_backend
    from connectors.tier.feed import read_batches

    read = (*columns, "sysflag") if latest and "sysflag" not in columns else columns  # keyed_mask's
    backend = open_backend(location, create=False, copies=copies)
    try:
        batches, rows = [], 0
        for batch in read_batches(backend, partition.batches, partition.start, partition.end, read, broker):
            if topics is not None and not topics.everything and batch.num_rows:
                batch = batch.filter(topics.mask(batch.column("topic")))
            batch = batch.select(list(read))
            if not latest:
                yield batch
                continue
            batches.append(batch)
            rows += batch.num_rows
            if rows >= LATEST_CHUNK_ROWS:  # a backfill's partition is the whole tier: bound its memory
                yield from last_per_key(batches, columns).to_batches()
                batches, rows = [], 0
        if batches:
            yield from last_per_key(batches, columns).to_batches()
    finally:
        backend.close()


LATEST_CHUNK_ROWS = 1_000_000  # rows reduced at a time under latestPerKey (Spark's max merges the chunks)


def last_per_key(batches, columns: tuple[str, ...]) -> "pa.Table":
    """``columns`` of each ``(topic, key)``'s message with the highest physical offset, of the keyed
    messages that entered a queue (``batches`` hold ``sysflag`` too); ``sysflag``, if asked for, 0
    (a plain message: every row here entered a queue).  Only fewer rows for Spark's aggregation,
    which gives the same answer without it (docs/architecture.md, "Latest per key, four times")."""
    import numpy as np
    import pyarrow as pa

    from connectors.commitlog.arrow import project_schema
    from state.replay import keyed_mask

    schema = project_schema(columns)
    if not batches:
        return schema.empty_table()
    table = pa.Table.from_batches(batches)
    table = table.filter(keyed_mask(table))
    last = table.group_by(["topic", "key"], use_threads=False).aggregate([("phy_offset", "max")])
    out = {"topic": last["topic"], "key": last["key"], "phy_offset": last["phy_offset_max"]}
    if "sysflag" in columns:
        out["sysflag"] = pa.array(np.zeros(last.num_rows, np.int32))
    return pa.table([out[c] for c in columns], schema=schema)


class TierFeedDataSource(DataSource):
    """The ``tierfeed`` format (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "tierfeed"

    def schema(self) -> str:
        return project_ddl(required_columns(self.options.get("columns")))

    def streamReader(self, schema) -> TierFeedStreamReader:
        if not os.path.isdir(self.options.get("metadata", "")):
            from connectors.errors import ConfigError

            raise ConfigError(f"tierfeed: no metadata store at {self.options.get('metadata')!r}")
        return TierFeedStreamReader(dict(self.options))
