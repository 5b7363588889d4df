"""Object names in a tier, and the Parquet form of its objects.

A tier holds the messages of one or more RocketMQ brokers (``broker.name``: the ``brokerName``
that a master and its replicas share).  Each broker's tierlog owns its own commit log,
metadata and staging objects, so several write one tier without coordinating:

    _log/broker=<b>/<seq, 20 digits>.json           commit records (what is visible)
    _log/broker=<b>/<seq, 20 digits>.root.json      the committed state at <seq>: a root of
                                                    buckets, queue manifests and pages under
                                                    _meta/broker=<b>/ (``connectors.tier.manifest``)
    _staging/broker=<b>/<first physical offset, 20 digits>.parquet
                                                    one micro-batch part, every queue, sorted
    topic=<topic>/broker=<b>/queue=<queue>/<base queue offset, 20 digits>.parquet
                                                    a sealed queue-dimension segment
    _keys/topic=<topic>/broker=<b>/queue=<queue>/<base queue offset, 20 digits>.parquet
                                                    that segment's key index: (key, queue_offset)
                                                    sorted by key, written at seal time

Segments keep the topic first, so an engine reads one topic across brokers from one directory.
Names starting with ``_`` are hidden from Spark's and DuckDB's directory listings, so
``spark.read.parquet(tier)`` sees exactly the sealed segments.  Topic names are escaped like
Hive partition values (Spark un-escapes them).

A tier written before tierlog knew brokers has the same objects without the ``broker=<b>/``
level (``Names(None)``); it is read only to upgrade it (``tierlog tier upgrade``).
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.commitlog.arrow import MESSAGE_SCHEMA, project_schema

LOG_PREFIX = "_log/"
META_PREFIX = "_meta/"
STAGING_PREFIX = "_staging/"
KEYS_PREFIX = "_keys/"
KEY_INDEX_SCHEMA = pa.schema([("key", pa.string()), ("queue_offset", pa.int64())])
KEY_INDEX_ROW_GROUP_ROWS = 8 * 1024  # sorted by key, so a lookup reads about one small row group
SORT_KEYS = [("topic", "ascending"), ("queue_id", "ascending"), ("queue_offset", "ascending")]
# Sealed segments: a point read (get, by_key, a KV view's reference) decodes one whole row group of
# every column it reads, so groups are kept small enough for that while scans still read long runs:
# at most ROW_GROUP_ROWS rows and about ROW_GROUP_BYTES of bodies (``group_rows``): a KV view's
# referenced value is read within the owners' 50 ms bound at the p99 (``./dev bench kv_get``,
# docs/benchmarks.md), and a group of large bodies is not hundreds of MB to decode for one row.
ROW_GROUP_ROWS = 16 * 1024
ROW_GROUP_BYTES = 4 << 20
STAGING_MIN_GROUP_ROWS = 1024  # smaller queue runs share a row group, so the footer stays small
COMPRESSION = "zstd"  # segments, key indexes and snapshots: what the tier keeps for months
# Staging objects live until their queues seal, and every byte of the log is encoded into one on
# the hot path: LZ4 encodes several times as fast as zstd (bench/bench_stage.py's phases).
STAGING_COMPRESSION = "lz4"
DICTIONARY_COLUMNS = ["topic", "key", "tags", "born_host", "store_host", "op", "broker"]
# Every column a staging object is pruned by keeps its statistics; the body and the properties map
# are never filtered on, and the bodies' were the dearest to compute (``to_staging_parquet``).
STAGING_STATISTICS = [f.name for f in MESSAGE_SCHEMA if f.name not in ("body", "properties")]

# Kept as they are: ASCII letters, digits and ._+- (Hive's escapePathName keeps them too), and
# every character above U+009F, so Spark, DuckDB and pyarrow read a UTF-8 topic back as it is.
_SAFE_ASCII = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")


def escape_topic(topic: str) -> str:
    """A topic as one path segment: every other character below U+00A0 as %XX (Hive's escaping:
    ``/`` ``..`` ``%`` ``=`` and control characters can never form another path or partition)."""
    return "".join(c if c in _SAFE_ASCII or ord(c) >= 0xA0 else f"%{ord(c):02X}" for c in topic)


def unescape_topic(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "%" and i + 2 < len(text) and all(c in "0123456789ABCDEFabcdef" for c in text[i + 1 : i + 3]):
            out.append(chr(int(text[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def key_index(segment: pa.Table) -> bytes:
    """The key index of a segment's rows: every keyed row's (key, queue_offset), sorted by key."""
    import pyarrow.compute as pc

    index = segment.select(["key", "queue_offset"]).filter(pc.is_valid(segment["key"]))
    index = index.cast(KEY_INDEX_SCHEMA).sort_by([("key", "ascending"), ("queue_offset", "ascending")])
    sink = io.BytesIO()
    pq.write_table(index, sink, compression=COMPRESSION, row_group_size=KEY_INDEX_ROW_GROUP_ROWS,
                   write_statistics=True)
    return sink.getvalue()


class ObjectFile(io.RawIOBase):
    """A read-only, seekable file over one tier object, reading only the ranges asked for: Parquet
    readers fetch the footer and the row groups they need, not the whole object."""

    def __init__(self, backend, name: str, size: int | None = None):
        self.backend, self.name = backend, name
        self.length = backend.size(name) if size is None else size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.length - self.pos)
        if want <= 0:
            return 0
        data = self.backend.read(self.name, self.pos, want)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def read_object_rows(backend, name: str, filters, columns: list[str] | None = None, schema: pa.Schema = None,
                     size: int | None = None) -> pa.Table:
    """Rows of one tier object that pass ``filters``, by ranged reads: only the footer and the row
    groups whose statistics may match are fetched."""
    return pq.read_table(backend.open_input(name, size), schema=schema or MESSAGE_SCHEMA, filters=filters,
                         columns=columns)


def read_where_equal(backend, name: str, where: dict, columns: list[str], size: int | None = None) -> pa.Table:
    """``columns`` (and those of ``where``) of the rows whose columns equal ``where``'s values.

    Row groups are pruned by their statistics; of those left, only the last ``where`` column (the
    selective one, a key) is read first, and the other columns only from row groups that hold a
    match.  A point lookup in a row group without the value reads one column, and no dataset is
    set up: about a third of the work of ``read_object_rows`` for a key.
    """
    import numpy as np
    import pyarrow.compute as pc

    source = pq.ParquetFile(backend.open_input(name, size))
    meta = source.metadata
    paths = [meta.schema.column(c).path for c in range(meta.num_columns)]  # leaf paths: a map's "key" differs
    checks = [(paths.index(column), value) for column, value in where.items()]
    groups, rows = [], []
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        if all(_may_hold(group.column(c).statistics, value) for c, value in checks):
            groups.append(i)
            rows.append(group.num_rows)
    probe, value = list(where.items())[-1]
    hits = pc.equal(source.read_row_groups(groups, columns=[probe])[probe], value).to_numpy(zero_copy_only=False)
    starts = np.cumsum([0, *rows])
    holding = [g for g, lo, hi in zip(groups, starts[:-1], starts[1:]) if hits[lo:hi].any()]
    table = source.read_row_groups(holding, columns=list(dict.fromkeys([*columns, *where])))
    for column, value in where.items():
        table = table.filter(pc.equal(table[column], value))
    return table


def _may_hold(stats, value) -> bool:
    return stats is None or not stats.has_min_max or stats.min <= value <= stats.max


def read_segment_slice(backend, name: str, first: int, stop: int, columns: list[str] | None = None,
                       size: int | None = None) -> pa.Table:
    """Rows ``first`` .. ``stop - 1`` (by position) of a sealed segment, by ranged reads of just the
    row groups holding them: no filter is evaluated and nothing is copied but what is decoded."""
    segment = pq.ParquetFile(backend.open_input(name, size))
    groups, at, skip = [], 0, 0
    for i in range(segment.num_row_groups):
        rows = segment.metadata.row_group(i).num_rows
        if at < stop and at + rows > first:
            if not groups:
                skip = first - at
            groups.append(i)
        at += rows
    schema = MESSAGE_SCHEMA if columns is None else project_schema(columns)
    if not groups:
        return schema.empty_table()
    return segment.read_row_groups(groups, columns=columns).cast(schema).slice(max(0, skip), stop - first)


def read_segment_rows(backend, name: str, rows: list[int], columns: list[str], size: int | None = None) -> pa.Table:
    """The rows at positions ``rows`` (ascending) of a sealed segment, by ranged reads of just the
    row groups holding them (``columns`` of those groups, nothing else)."""
    segment = pq.ParquetFile(backend.open_input(name, size))
    starts = np.cumsum([0] + [segment.metadata.row_group(i).num_rows for i in range(segment.num_row_groups)])
    group_of = np.searchsorted(starts, rows, side="right") - 1
    groups = sorted(set(group_of.tolist()))
    read = segment.read_row_groups(groups, columns=columns)
    shift, taken = {}, 0  # where each group read starts in ``read``, less where it starts in the segment
    for g in groups:
        shift[g] = taken - int(starts[g])
        taken += int(starts[g + 1] - starts[g])
    at = [r + shift[g] for r, g in zip(rows, group_of.tolist())]
    return read.take(pa.array(at, pa.int64())).cast(project_schema(columns))


LOG_KINDS = {"json": "record", "root.json": "root", "checkpoint.json": "legacy"}
BROKER_DIR = "broker="


class Names:
    """The object names of one broker's part of a tier (``broker=None``: the layout before
    brokers, read only to upgrade it).  Every name is a pure function of its arguments."""

    def __init__(self, broker: str | None):
        self.broker = broker
        self.level = "" if broker is None else f"{BROKER_DIR}{escape_topic(broker)}/"
        self.log_prefix = LOG_PREFIX + self.level
        self.meta_prefix = META_PREFIX + self.level
        self.staging_prefix = STAGING_PREFIX + self.level

    def __repr__(self) -> str:
        return f"Names({self.broker!r})"

    def segment(self, topic: str, queue_id: int, base_offset: int) -> str:
        return f"topic={escape_topic(topic)}/{self.level}queue={queue_id}/{base_offset:020d}.parquet"

    def key_index(self, topic: str, queue_id: int, base_offset: int) -> str:
        return KEYS_PREFIX + self.segment(topic, queue_id, base_offset)

    def staging(self, first_phy_offset: int) -> str:
        return f"{self.staging_prefix}{first_phy_offset:020d}.parquet"

    def log(self, seq: int) -> str:
        return f"{self.log_prefix}{seq:020d}.json"

    def root(self, seq: int) -> str:
        return f"{self.log_prefix}{seq:020d}.root.json"

    def legacy_checkpoint(self, seq: int) -> str:
        """A checkpoint of the first layout (the whole state in one object), read only to upgrade."""
        return f"{self.log_prefix}{seq:020d}.checkpoint.json"

    def bucket(self, bucket: int, seq: int) -> str:
        return f"{self.meta_prefix}buckets/{bucket:05d}/{seq:020d}.json"

    def queue_manifest(self, topic: str, queue_id: int, seq: int) -> str:
        return f"{self.meta_prefix}queues/topic={escape_topic(topic)}/queue={queue_id}/{seq:020d}.json"

    def page(self, topic: str, queue_id: int, base_offset: int, seq: int) -> str:
        return f"{self.meta_prefix}pages/topic={escape_topic(topic)}/queue={queue_id}/{base_offset:020d}.{seq:020d}.json"

    def parse_log(self, name: str) -> tuple[int, str] | None:
        """``(seq, kind)`` for one of this broker's commit-log object names (kind: record, root or
        legacy), else None (another broker's, or not a commit-log object)."""
        if not name.startswith(self.log_prefix):
            return None
        stem, _, rest = name[len(self.log_prefix):].partition(".")
        if not stem.isdigit() or rest not in LOG_KINDS:
            return None
        return int(stem), LOG_KINDS[rest]


def brokers_in(names: list[str]) -> tuple[list[str], bool]:
    """The brokers whose commit logs ``names`` (a listing of ``_log/``) hold, and whether the
    listing also holds a commit log from before brokers (``_log/<seq>...`` at the top)."""
    brokers, legacy, before = set(), False, Names(None)
    for name in names:
        rest = name[len(LOG_PREFIX):]
        if rest.startswith(BROKER_DIR) and "/" in rest:
            brokers.add(unescape_topic(rest[len(BROKER_DIR):rest.index("/")]))
        elif before.parse_log(name):
            legacy = True
    return sorted(brokers), legacy


def group_rows(table: pa.Table) -> int:
    """Rows per row group for ``table``'s messages: ``ROW_GROUP_ROWS``, or fewer, so that a group
    holds about ``ROW_GROUP_BYTES`` of bodies at their mean size."""
    body = pc.sum(pc.binary_length(table["body"])).as_py() if table.num_rows else None
    if not body:
        return ROW_GROUP_ROWS
    return max(1, min(ROW_GROUP_ROWS, ROW_GROUP_BYTES * table.num_rows // body))


def to_parquet(table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> bytes:
    """Serialize rows of the message schema, zstd, in row groups of ``group_rows``; ``metadata``
    goes into the footer's key-value metadata."""
    sink = io.BytesIO()
    table = table.cast(MESSAGE_SCHEMA)
    pq.write_table(
        table.replace_schema_metadata(metadata) if metadata else table,
        sink,
        compression=COMPRESSION,
        row_group_size=group_rows(table),
        write_statistics=True,
        use_dictionary=DICTIONARY_COLUMNS,
    )
    return sink.getvalue()


def to_staging_parquet(table: pa.Table) -> bytes:
    """A staging object: rows sorted by (topic, queue, offset), every row group cut at a queue's
    boundary, so a reader of one queue decodes only that queue's rows (row groups are skipped by
    their statistics).  Runs shorter than ``STAGING_MIN_GROUP_ROWS`` share a group; longer than
    ``group_rows`` are split.  No statistics for the bodies: a staging object is read by topic,
    queue, offset, key or store time, never by body, and min/max over every body cost about a tenth
    of the encode (docs/benchmarks.md)."""
    import numpy as np

    table = table.cast(MESSAGE_SCHEMA)
    topics = table["topic"].to_numpy(zero_copy_only=False)
    queues = table["queue_id"].to_numpy()
    changes = np.nonzero((topics[1:] != topics[:-1]) | (queues[1:] != queues[:-1]))[0] + 1
    sink = io.BytesIO()
    with pq.ParquetWriter(sink, MESSAGE_SCHEMA, compression=STAGING_COMPRESSION, write_statistics=STAGING_STATISTICS,
                          use_dictionary=DICTIONARY_COLUMNS) as writer:
        start = 0
        for end in [*changes.tolist(), table.num_rows]:
            if end - start >= STAGING_MIN_GROUP_ROWS or end == table.num_rows:
                run = table.slice(start, end - start)
                writer.write_table(run, row_group_size=group_rows(run))
                start = end
    return sink.getvalue()


def from_parquet(data, filters=None) -> pa.Table:
    """The messages of one tier object: its bytes, or a pyarrow file (``Backend.read_whole``)."""
    source = pa.BufferReader(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    return pq.read_table(source, schema=MESSAGE_SCHEMA, filters=filters)


def sort_rows(table: pa.Table) -> pa.Table:
    """``table`` in ``SORT_KEYS`` order.  The sort runs on integer keys (each topic's rank among the
    batch's topics, the queue, the offset) and the rows are gathered once: Arrow's own sort by a
    string column and the gather of every column behind it cost several times as much."""
    import numpy as np

    if table.num_rows < 2:
        return table
    topics = pc.dictionary_encode(table["topic"]).combine_chunks()
    names = topics.dictionary.to_pylist()
    rank = np.empty(len(names), np.int64)
    rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    queue = (rank[topics.indices.to_numpy()] << 32) | table["queue_id"].to_numpy().astype(np.int64)
    order = np.lexsort((table["queue_offset"].to_numpy(), queue))
    if (order[1:] > order[:-1]).all():
        return table  # already in order: one queue, or a log written queue by queue
    return table.take(order)


def unsealed_by_queue(tables: list[pa.Table], sealed_at: dict[tuple[str, int], int]) -> dict[tuple[str, int], pa.Table]:
    """The rows of ``tables`` (staging rows: each sorted by (topic, queue_id, queue_offset), the
    tables in physical order) whose queue is in ``sealed_at`` and whose queue offset is at or past
    it, as one slice per queue in queue-offset order: filtered and gathered once for all the tables.

    Why: a seal of a quiet broker takes a few rows of every queue from each of hundreds of staging
    objects.  A filter per queue and object cost 7 of the 8 s of CPU a seal of 64 queues over 600
    objects of 100 messages took; then a filter per object and a slice per queue and object, joined
    per queue (38,400 pieces), still cost more than reading the objects (bench/bench_seal.py)."""
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return {}
    table = pa.concat_tables(tables)
    combined, names = _queue_codes(table)
    uniq, inverse = np.unique(combined, return_inverse=True)
    never = np.iinfo(np.int64).max  # a queue not being sealed: no row of it is taken
    floor = np.array([sealed_at.get((names[c >> 32], int(c & 0xFFFFFFFF)), never) for c in uniq.tolist()], np.int64)
    keep = table["queue_offset"].to_numpy().astype(np.int64) >= floor[inverse]
    if len(tables) > 1 or not keep.all():  # one table kept whole is in queue order already: no copy
        rows = np.flatnonzero(keep)
        rows = rows[np.argsort(combined[rows], kind="stable")]  # stable: each queue's rows stay in offset order
        combined, table = combined[rows], table.take(pa.array(rows))
    if table.num_rows == 0:
        return {}
    starts = np.flatnonzero(np.diff(combined)) + 1
    bounds = [0, *starts.tolist(), table.num_rows]
    return {(names[combined[a] >> 32], int(combined[a] & 0xFFFFFFFF)): table.slice(a, b - a)
            for a, b in zip(bounds, bounds[1:])}


def _queue_codes(table: pa.Table) -> tuple[np.ndarray, list[str]]:
    """Each row's queue as one int64, ``topic code << 32 | queue_id``, and the topics by code."""
    topics = pc.unique(table["topic"])
    codes = pc.index_in(table["topic"], value_set=topics).to_numpy()
    combined = (codes.astype(np.int64) << 32) | table["queue_id"].to_numpy().astype(np.int64)
    return combined, topics.to_pylist()
