"""Staging: one byte range of the commitlog -> one staging object in the tier, and its summary.

The stager runs where the bytes are (a Spark executor under ``tierlog run``, or any process): it
reads its range with the Arrow fast path, drops what the tier's topic filter leaves out, sorts the
rows by (topic, queue, queue offset) and uploads one object, named by the range's first physical
offset so a repeated upload overwrites itself.  Its :class:`StagedPart` carries everything the
commit needs: the queues' offsets, the corrupt ranges it skipped, and the fingerprint of the last
record it read.  So the process that commits never opens the commitlog for bytes a stager read;
it reads only the gaps *between* parts (:class:`CommitLogGaps`), which hold blank markers, corrupt
records or, when something went wrong, messages that would be skipped.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from connectors.commitlog.arrow import MESSAGE_SCHEMA, BodyViews, dispatched_only
from connectors.commitlog.reader import ReaderOptions
from connectors.errors import TierlogError
from connectors.faults import crash_point
from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.copies import CopySettings
from connectors.tier.manifest import StagingObject
from connectors.tier.records import LastRecord


@dataclass(frozen=True)
class StageSettings:
    """What a stager needs: where to upload, how to read, what the tier keeps."""

    location: str
    reader: ReaderOptions
    filters: dict | None = None  # sink -> TopicFilter; the tier keeps what filters["tier"] accepts; all are counted
    copies: CopySettings | None = None  # local copies for the tier's consumers (connectors.tier.copies)


@dataclass
class StagedPart:
    """The summary of one staged range ``[first_phy, end_phy)``.  ``name`` is empty when the
    filter left nothing to stage: the range still counts as tiered."""

    first_phy: int
    end_phy: int
    last_record: LastRecord
    name: str = ""
    size: int = 0
    rows: int = 0
    bytes: int = 0
    queues: list = field(default_factory=list)  # [topic, queue, first, last, rows, bytes, min_ts, max_ts]
    upload_s: float = 0.0
    filtered: dict = field(default_factory=dict)  # sink -> topic class -> messages its filter left out
    quarantined: list = field(default_factory=list)  # corrupt ranges inside the part, skipped

    def staging_object(self, time_ms: int) -> StagingObject:
        queues = {(t, q): {"first": lo, "last": hi, "rows": n, "bytes": b, "min_ts": tmin, "max_ts": tmax}
                  for t, q, lo, hi, n, b, tmin, tmax in self.queues}
        return StagingObject(self.name, self.size, self.first_phy, queues, time_ms)

    # The row a Spark task yields: nested values travel as JSON strings.
    SCHEMA = pa.schema(
        [("first_phy", pa.int64()), ("end_phy", pa.int64()), ("last_record", pa.string()), ("name", pa.string()),
         ("size", pa.int64()), ("rows", pa.int64()), ("bytes", pa.int64()), ("queues", pa.string()),
         ("upload_s", pa.float64()), ("filtered", pa.string()), ("quarantined", pa.string())]
    )
    DDL = ("first_phy bigint, end_phy bigint, last_record string, name string, size bigint, rows bigint, "
           "bytes bigint, queues string, upload_s double, filtered string, quarantined string")
    _JSON = ("last_record", "queues", "filtered", "quarantined")

    def to_row(self) -> dict:
        row = dict(vars(self))
        for key in self._JSON:
            row[key] = json.dumps(row[key])
        return row

    @classmethod
    def from_row(cls, row: dict) -> "StagedPart":
        return cls(**{k: json.loads(v) if k in cls._JSON else v for k, v in row.items()})


def queue_stats(table: pa.Table) -> list[list]:
    """Per queue: [topic, queue, first, last, rows, bytes, min_ts, max_ts] (store times in ms)."""
    if table.num_rows == 0:
        return []
    grouped = table.group_by(["topic", "queue_id"]).aggregate(
        [("queue_offset", "min"), ("queue_offset", "max"), ("queue_offset", "count"), ("size", "sum"),
         ("store_ts", "min"), ("store_ts", "max")]
    )
    cols = [grouped[c].to_pylist() for c in (
        "topic", "queue_id", "queue_offset_min", "queue_offset_max", "queue_offset_count", "size_sum",
        "store_ts_min", "store_ts_max")]
    out = []
    for t, q, lo, hi, n, nbytes, tmin, tmax in zip(*cols):
        out.append([t, q, lo, hi, n, nbytes, int(tmin.timestamp() * 1000), int(tmax.timestamp() * 1000)])
    return out


def read_rows(reader, first_phy: int, end_phy: int, key_property: str,
              dispatched: bool = True) -> tuple[pa.Table | None, BodyViews]:
    """The records of ``[first_phy, end_phy)`` that entered a queue (with ``dispatched``; else every
    record), their bodies held as views into the mapped log (``BodyViews``: sorted as 16 bytes a
    row, copied once by ``views.bodies``); None when the range holds no record.  A view keeps its
    mapping alive past the reader's close."""
    views = BodyViews()
    batches = [views.hold(b) for b in reader.record_batches(first_phy, end_phy, key_property=key_property,
                                                             body_views=True)]
    if not batches:
        return None, views
    table = pa.Table.from_batches(batches, schema=batches[0].schema)
    return (dispatched_only(table) if dispatched else table), views


def stage(settings: StageSettings, first_phy: int, end_phy: int, last_phy: int) -> StagedPart:
    """Stage the records in ``[first_phy, end_phy)``, the last of which starts at ``last_phy``."""
    options = settings.reader
    with options.open() as reader:
        table, views = read_rows(reader, first_phy, end_phy, options.key_property)
        last = reader.read_bytes(last_phy, end_phy - last_phy)
        quarantined = [q.to_json() for q in reader.quarantined]
    if table is None:
        table = MESSAGE_SCHEMA.empty_table()
    return _staged(settings, table, views, first_phy, end_phy, last_phy, last, quarantined)


def _staged(settings: StageSettings, table: pa.Table, views: BodyViews, first_phy: int, end_phy: int, last_phy: int,
            last: bytes | None, quarantined: list) -> StagedPart:
    """The staging object of ``table`` (the range's records that entered a queue) and its part."""
    from connectors.commitlog.topics import filtered_counts

    options = settings.reader
    if last is None:
        raise TierlogError(f"the commitlog {options.directory} no longer holds physical offsets "
                                f"{last_phy}-{end_phy}, which this stager just read: was it replaced?")
    filters = settings.filters
    # Every sink's filter is counted here, where each message passes exactly once.
    filtered = filtered_counts(table["topic"], filters) if filters and table.num_rows else {}
    if filters and "tier" in filtered:
        table = table.filter(filters["tier"].mask(table["topic"]))
    part = StagedPart(first_phy, end_phy, {"phy": last_phy, "size": end_phy - last_phy, "crc32": zlib.crc32(last)},
                      filtered=filtered, quarantined=quarantined)
    if table.num_rows:
        data = layout.to_staging_parquet(views.bodies(layout.sort_rows(table)))
        part.name = layout.Names(options.broker).staging(first_phy)
        backend = open_backend(settings.location, copies=settings.copies)
        started = time.monotonic()
        try:
            backend.put(part.name, data)
        finally:
            backend.close()
        part.upload_s = time.monotonic() - started
        part.size, part.rows = len(data), table.num_rows
        part.bytes = int(pc.sum(table["size"]).as_py() or 0)
        part.queues = queue_stats(table)
        crash_point("staged")
    return part


def stage_range(settings: StageSettings, start: int, end: int) -> tuple[StagedPart | None, int]:
    """Stage every record in ``[start, end)`` as one part, exactly as one Spark task handed that
    range's references would (``stage`` from its first record to the end of its last); returns the
    part (None when the range holds no record) and how many records the range holds, which Spark
    would have counted as the batch's input.  ``start`` must be a record boundary, as a batch's is.

    Why: under ``tierlog run`` a small batch is staged this way by the driver itself
    (``tier.stage_on_driver``), without a Spark job, whose own cost was most of such a batch's time
    (``docs/benchmarks.md``)."""
    # One read: the decode's own walk finds the first and the last record (``stage`` is handed them),
    # where a header walk before it walked every record twice.
    options = settings.reader
    with options.open() as reader:
        every, views = read_rows(reader, start, end, options.key_property, dispatched=False)
        if not reader.quarantined:
            if every is None:
                return None, 0
            phy, size = every["phy_offset"], every["size"]
            first, last_phy = phy[0].as_py(), phy[-1].as_py()
            end_phy = last_phy + size[-1].as_py()
            last = reader.read_bytes(last_phy, end_phy - last_phy)
            part = _staged(settings, dispatched_only(every), views, first, end_phy, last_phy, last, [])
            return part, every.num_rows
    return _stage_walked(settings, start, end)


def _stage_walked(settings: StageSettings, start: int, end: int) -> tuple[StagedPart | None, int]:
    """``stage_range`` of a range the decode skipped records of (quarantine): the first and the last
    record found by a header walk, as the source's references are, whatever their bodies."""
    first = last = None
    records = 0
    # What the header walk skips under quarantine is found again, and recorded, by ``stage``'s own read.
    with settings.reader.open(check_crc=False) as reader:
        for span in reader.spans(start, end):
            if span.starts:
                if first is None:
                    first = span.file.base + span.starts[0]
                last = (span.file.base + span.starts[-1], span.sizes[-1])
                records += len(span.starts)
    if first is None:
        return None, 0
    return stage(settings, first, last[0] + last[1], last[0]), records


@dataclass(frozen=True)
class Gap:
    """What lies in a commitlog range no part covered: ``skipped`` says what would be lost (None when
    only blank markers, or corrupt records quarantined, lie there)."""

    skipped: str | None
    quarantined: list


class CommitLogGaps:
    """Reads the ranges between staged parts: the only commitlog reads of the committing process.
    A body whose CRC is wrong is always inside a part (the references name it); a gap holds what the
    header walk skips, which ``scan`` finds and, under quarantine, records."""

    def __init__(self, reader: ReaderOptions):
        self.reader = reader

    def between(self, start: int, end: int) -> Gap:
        from connectors.commitlog.errors import CommitLogError

        if end < start:
            return Gap(f"{start - end} bytes (overlap)", [])
        try:
            with self.reader.open(check_crc=False) as reader:
                found = reader.scan(start, end).records
                quarantined = [q.to_json() for q in reader.quarantined]
        except CommitLogError as exc:
            return Gap(f"an unreadable range ({exc})", [])
        return Gap(f"{found} message(s)" if found else None, quarantined)
