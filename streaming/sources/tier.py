"""The ``tier`` batch data source: ``spark.read.format("tier").load(location)``.

It returns exactly the committed messages of a tier, as message rows: the
sealed segments, and the part of the staging objects not sealed yet.  It reads
the commit log once, when the query is planned, so a query sees one committed
state however long it runs; objects being written, or written and never
committed, are never read.  It needs only the tier location (a directory or
``s3://bucket/prefix``).

Every broker the tier holds is read; each row says which in ``broker``.

Pruning.  Filters on ``broker``, ``topic``, ``queue_id``, ``queue_offset`` and ``store_ts``
(``=``, ``<``, ``<=``, ``>``, ``>=``, ``IN``) are pushed down
(``spark.sql.python.filterPushdown.enabled``, set by ``build_session``): they
decide which queues, which segments and staging objects (by offset range and
by each object's min/max store time) and, inside an object, which row groups
are read.  Spark still applies every filter to the rows, so pushing down never
changes a result.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)

from connectors.commitlog.arrow import MESSAGE_DDL, MESSAGE_SCHEMA, epoch_ms_array
from connectors.errors import ConfigError

_FAR = 2**62


@dataclass
class Bounds:
    """What the pushed filters allow; None or the open ends mean no limit."""

    brokers: set | None = None
    topics: set | None = None
    queues: set | None = None
    offset: list = field(default_factory=lambda: [0, _FAR])  # [lo, hi) queue offsets
    ts: list = field(default_factory=lambda: [-_FAR, _FAR])  # [lo, hi] store time, epoch ms

    def take(self, f) -> bool:
        """Narrow the bounds by one filter; False if it is not one this source prunes by."""
        column = f.attribute[0] if len(f.attribute) == 1 else None
        if column in ("broker", "topic", "queue_id") and isinstance(f, (EqualTo, In)):
            values = set(f.value) if isinstance(f, In) else {f.value}
            name = {"broker": "brokers", "topic": "topics", "queue_id": "queues"}[column]
            current = getattr(self, name)
            setattr(self, name, values if current is None else current & values)
            return True
        if column not in ("queue_offset", "store_ts") or not isinstance(
                f, (EqualTo, GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual)):
            return False
        value = _ms(f.value) if column == "store_ts" else int(f.value)
        if column == "queue_offset":  # half-open [lo, hi)
            lo, hi = {EqualTo: (value, value + 1), GreaterThan: (value + 1, _FAR), GreaterThanOrEqual: (value, _FAR),
                      LessThan: (0, value), LessThanOrEqual: (0, value + 1)}[type(f)]
            target = self.offset
        else:  # closed [lo, hi]
            lo, hi = {EqualTo: (value, value), GreaterThan: (value + 1, _FAR), GreaterThanOrEqual: (value, _FAR),
                      LessThan: (-_FAR, value - 1), LessThanOrEqual: (-_FAR, value)}[type(f)]
            target = self.ts
        target[0], target[1] = max(target[0], lo), min(target[1], hi)
        return True


def _ms(value) -> int:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)  # the session time zone is UTC
        return int(value.timestamp() * 1000)
    return int(value)


class TierPartition(InputPartition):
    """One object to read, and per queue the queue offsets ``[lo, hi)`` to keep from it."""

    def __init__(self, name: str, size: int, ranges: list[tuple[str, int, int, int]]):
        super().__init__(name)
        self.name, self.size, self.ranges = name, size, ranges


class TierBatchReader(DataSourceReader):
    def __init__(self, location: str):
        self.location = location
        self.bounds = Bounds()

    def pushFilters(self, filters):
        for f in filters:
            self.bounds.take(f)
            yield f  # Spark re-applies them all: the bounds only prune

    def partitions(self) -> list[TierPartition]:
        from connectors.tier.reader import TierReader

        reader = TierReader(self.location)
        b = self.bounds
        parts: list[TierPartition] = []
        staged: dict[str, TierPartition] = {}
        for broker in reader.brokers():
            if b.brokers is None or broker in b.brokers:
                self._plan(reader.committed(broker), parts, staged)
        reader.backend.close()
        return parts + list(staged.values()) or [TierPartition("", 0, [])]

    def _plan(self, state, parts: list[TierPartition], staged: dict[str, TierPartition]) -> None:
        """The objects of one broker's state to read, and what to keep of each."""
        b = self.bounds
        topics = sorted(b.topics) if b.topics is not None else [None]
        queues = sorted(kv for t in topics for kv in state.queue_states(t).items())
        state.prefetch([k for k, q in queues if q.segments or q.commit > q.sealed])
        for key, q in queues:
            topic, queue_id = key
            if (b.topics is not None and topic not in b.topics) or (b.queues is not None and queue_id not in b.queues):
                continue
            lo, hi = max(q.low, b.offset[0]), min(q.commit, b.offset[1])
            if lo >= hi:
                continue
            for seg in state.segments_for(key, lo, hi, b.ts[0], b.ts[1]):
                parts.append(TierPartition(seg.name, seg.size, [(topic, queue_id, lo, hi)]))
            unsealed = max(lo, q.sealed)
            for info in state.staging_for(key) if q.commit > q.sealed else ():
                if info.first < hi and info.last >= unsealed and info.max_ts >= b.ts[0] and info.min_ts <= b.ts[1]:
                    part = staged.setdefault(info.name, TierPartition(info.name, info.size, []))
                    part.ranges.append((topic, queue_id, unsealed, hi))

    def read(self, partition: TierPartition) -> Iterator[pa.RecordBatch]:
        if not partition.ranges:
            return
        from connectors.tier import layout
        from connectors.tier.location import open_backend

        backend = open_backend(self.location)
        try:
            b = self.bounds
            filters = [("topic", "in", sorted({r[0] for r in partition.ranges})),
                       ("queue_offset", ">=", min(r[2] for r in partition.ranges)),
                       ("queue_offset", "<", max(r[3] for r in partition.ranges))]
            table = layout.read_object_rows(backend, partition.name, filters, size=partition.size)
        finally:
            backend.close()
        keep = None
        for topic, queue_id, lo, hi in partition.ranges:
            mine = pc.and_(pc.and_(pc.equal(table["topic"], topic), pc.equal(table["queue_id"], queue_id)),
                           pc.and_(pc.greater_equal(table["queue_offset"], lo), pc.less(table["queue_offset"], hi)))
            keep = mine if keep is None else pc.or_(keep, mine)
        ts = epoch_ms_array(table["store_ts"])
        keep = pc.and_(keep, pc.and_(pc.greater_equal(ts, b.ts[0]), pc.less_equal(ts, b.ts[1])))
        yield from table.filter(keep).cast(MESSAGE_SCHEMA).to_batches()


class TierDataSource(DataSource):
    """The ``tier`` format: the committed messages of a tier location, as message rows."""

    @classmethod
    def name(cls) -> str:
        return "tier"

    def schema(self) -> str:
        return MESSAGE_DDL

    def reader(self, schema) -> TierBatchReader:
        location = self.options.get("path")
        if not location:
            raise ConfigError('the tier source needs a location: spark.read.format("tier").load("data/tier") '
                              'or .load("s3://bucket/prefix")')
        return TierBatchReader(location)
