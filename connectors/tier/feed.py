"""The tier feed, read side: the messages of the tier's committed batches, for the queries that
consume the tier instead of the commitlog (the compaction query, the Kafka mirror).

A consumer's position is the end of a batch the tier committed (its ``source_end``), so what it
still needs is exactly the staging objects of the batches after it.  Those objects are read back
as they were committed: already decoded and CRC-checked by the stager, so nothing reads or decodes
the commitlog a second time.  The tier keeps them until every consumer has applied them
(``state.tier_feed.TierFeed`` lists them; ``TierWriter.delete_retired`` holds back their deletion).

A *backfill* batch stands for what the tier committed before the feed listed anything (a mirror
turned on for a tier that holds messages, or one whose position the listing lost): its messages
are read from the committed tier, queue by queue, sealed segments and staging alike.

Contract of :func:`read_batches`: every message of the listed batches in ``[start, end)`` (by
physical offset) that the tier holds, once, and every queue's messages in queue order: each
staging object's rows in physical order and the objects in the order the tier committed them.
``FeedMessages`` offers the same to the KV writer in the commitlog reader's terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.commitlog.arrow import MESSAGE_SCHEMA, in_given_order, project_schema
from connectors.errors import TierlogError
from connectors.tier.backend import Backend


@dataclass(frozen=True)
class FeedBatch:
    """One batch the tier committed: the commitlog range ``[start, end)`` it covered and its
    staging objects as ``(name, size, first_phy)``, in physical order (none when the tier's topic
    filter left nothing of it)."""

    start: int
    end: int
    objects: tuple[tuple[str, int, int], ...]
    backfill: bool = False  # read from the committed tier, not from listed objects

    def to_json(self) -> dict:
        out = {"start": self.start, "end": self.end, "objects": [list(o) for o in self.objects]}
        return {**out, "backfill": True} if self.backfill else out

    @classmethod
    def from_json(cls, d: dict) -> "FeedBatch":
        return cls(d["start"], d["end"], tuple(tuple(o) for o in d["objects"]), d.get("backfill", False))

    @classmethod
    def from_record(cls, record: dict) -> "FeedBatch":
        """The batch a tier ``batch`` commit record made visible."""
        objects = sorted(((o["name"], o["size"], o["first_phy"]) for o in record["staging"]), key=lambda o: o[2])
        return cls(record["source_start"], record["source_end"], tuple(objects))


def read_batches(backend: Backend, batches: Iterable[FeedBatch], start: int, end: int,
                 columns: tuple[str, ...] | None = None, broker: str | None = None) -> Iterator[pa.RecordBatch]:
    """The messages of ``batches`` whose physical offset is in ``[start, end)`` (see the module's
    contract); ``columns``: the message columns to read (``phy_offset`` is always read);
    ``broker``: whose part of the tier a backfill batch reads."""
    for part in read_unsorted(backend, batches, start, end, columns, broker):
        yield from part.sorted().to_batches()


class Unsorted(NamedTuple):
    """Messages as a staging object was read (``table``) and the order that puts them in physical
    order: ``table.take(order)``, or ``table`` itself where ``order`` is None."""

    table: pa.Table
    order: pa.Array | None

    @classmethod
    def of(cls, table: pa.Table) -> "Unsorted":
        phy = table["phy_offset"].to_numpy()
        return cls(table, None if bool(np.all(phy[1:] > phy[:-1])) else pc.sort_indices(table["phy_offset"]))

    def sorted(self) -> pa.Table:
        return self.table if self.order is None else self.table.take(self.order)


def read_unsorted(backend: Backend, batches: Iterable[FeedBatch], start: int, end: int,
                  columns: tuple[str, ...] | None = None, broker: str | None = None) -> Iterator[Unsorted]:
    """``read_batches``' messages, each part with the order that sorts it instead of sorted.

    Why: the sort copies every column, each body too, into memory the allocator has just been given
    back by the kernel.  The mirror turns its bodies into Python objects anyway, and reorders those
    instead: with large bodies, the sort was most of its thread's time, and the mirror fell behind
    (docs/benchmarks.md, the mirror at 100 MB/s of 16 KiB)."""
    wanted = None if columns is None else list(dict.fromkeys((*columns, "phy_offset")))
    for table in _tables(backend, batches, start, end, wanted, broker, within=True):
        yield Unsorted.of(table)


def _tables(backend: Backend, batches: Iterable[FeedBatch], start: int, end: int, columns: list[str] | None,
            broker: str | None, within: bool) -> Iterator[pa.Table]:
    """``read_batches``' messages a table at a time, each in the order it was staged (queue order;
    ``read_unsorted`` adds the physical one): with ``within``, only the rows in ``[start, end)``;
    without, with the rows outside it too, for a caller that picks rows by offset anyway."""
    for batch in batches:
        if batch.end <= start or batch.start >= end:
            continue
        if batch.backfill:  # read queue by queue, already within the range and in queue order
            yield from (pa.Table.from_batches([b]) for b in _backfill(backend, broker, max(start, batch.start),
                                                                      min(end, batch.end), columns))
            continue
        for name, size, _first in batch.objects:
            # One GET for the whole object: the mirror needs nearly every byte of it (the bodies), and
            # a ranged read per column chunk of each queue's row group was hundreds of GETs on S3.
            table = pq.read_table(backend.read_whole(name), schema=MESSAGE_SCHEMA, columns=columns)
            if within and (batch.start < start or batch.end > end):
                table = _within(table, start, end)
            yield table  # staged by (topic, queue, offset): queue order, not yet physical order


BACKFILL_CHUNK = 20_000  # messages of one queue read at a time


def _backfill(backend: Backend, broker: str | None, start: int, end: int,
              columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    """The committed messages of ``broker`` with physical offsets in ``[start, end)``, queue by queue."""
    from connectors.tier.reader import TierReader

    reader = TierReader(backend, broker)
    committed = reader.committed()
    for topic, queue_id in committed.queue_keys():
        offset = committed.queue((topic, queue_id)).low
        while True:
            got = reader.get(topic, queue_id, offset, BACKFILL_CHUNK, committed=committed)
            if got.messages.num_rows == 0:
                break
            table = got.messages if columns is None else got.messages.select(columns)
            yield from _within(table, start, end).to_batches()
            offset = got.next_offset


def _within(table: pa.Table, start: int, end: int) -> pa.Table:
    """The rows whose physical offset is in ``[start, end)``."""
    phy = table["phy_offset"]
    return table.filter(pc.and_(pc.greater_equal(phy, start), pc.less(phy, end)))


class FeedMessages:
    """The messages of the tier's committed batches, read as the KV writer reads the commitlog
    (``record_batches``, ``records_at``): the compaction query's changed keys resolved from the
    batches the tier committed, never from a second decode of the commitlog.

    ``listing(start, end)`` gives the listed ``FeedBatch``es that hold anything of ``[start, end)``
    (``state.tier_feed.TierFeed.batches``); ``first`` is where the consumer's listing starts."""

    def __init__(self, backend: Backend, listing, broker: str | None, first: int = 0):
        self.backend = backend
        self.listing = listing
        self.broker = broker
        self.first = first

    def first_offset(self) -> int:
        return self.first

    def close(self) -> None:
        self.backend.close()

    def record_batches(self, start: int, end: int, *, columns: tuple[str, ...], key_property: str | None = None,
                       **_) -> Iterator[pa.RecordBatch]:
        """The messages in ``[start, end)``, ``columns`` in that order; ``key_property`` is the
        stager's (the tier's ``key`` column was filled with it)."""
        for batch in read_batches(self.backend, self.listing(start, end), start, end, columns, self.broker):
            yield batch.select(list(columns)) if batch.schema.names != list(columns) else batch

    def records_at(self, phy_offsets: np.ndarray, columns) -> pa.Table:
        """``columns`` of the messages at ``phy_offsets`` (distinct), in that order; raises
        TierlogError naming an offset the tier's listed batches do not hold."""
        return in_given_order(*self.records_as_stored(phy_offsets, columns))

    def records_as_stored(self, phy_offsets: np.ndarray, columns) -> tuple[pa.Table, np.ndarray]:
        """``columns`` of the messages at ``phy_offsets`` (distinct) in the order the tier stores
        them, and for each, where its offset stands in ``phy_offsets``; raises as ``records_at``.

        Why not in the caller's order: a batch's bodies are hundreds of MB, and putting them in
        another order made Arrow join every staging object's bodies into one buffer first, then
        grow a second one row by row: two copies in fresh memory, whose page faults were most of
        the KV writer's resolve.  Kept where they lie, the wanted rows are picked out of each row
        group once.  The KV writer orders the changed keys to match instead, a few bytes a row:
        less than half the CPU and a third of the page faults (docs/benchmarks.md)."""
        columns = list(columns)
        if len(phy_offsets) == 0:
            return project_schema(columns).empty_table(), np.empty(0, np.int64)
        lo, hi = int(phy_offsets.min()), int(phy_offsets.max()) + 1
        wanted = pa.array(phy_offsets, pa.int64())
        read = list(dict.fromkeys((*columns, "phy_offset")))
        tables = list(_tables(self.backend, self.listing(lo, hi), lo, hi, read, self.broker, within=False))
        found = pa.concat_tables(tables) if tables else project_schema(read).empty_table()
        at = pc.index_in(found["phy_offset"], value_set=wanted)  # null where a row is not wanted
        held = pc.is_valid(at)
        at = at.filter(held).to_numpy()
        seen = np.zeros(len(wanted), dtype=bool)
        seen[at] = True
        if not seen.all():
            missing = int(phy_offsets[np.flatnonzero(~seen)[0]])
            raise TierlogError(
                f"the message at physical offset {missing} is not in the tier's committed batches {lo}..{hi} "
                f"(tier {self.backend.location}): the KV view "
                "cannot take its value; was the tier or the metadata store replaced under a running service?")
        records = found.filter(held).select(columns)
        if len(at) > len(wanted):  # an offset stored twice: its first row, as a lookup would find
            _, first = np.unique(at, return_index=True)
            first.sort()
            records, at = records.take(pa.array(first)), at[first]
        return records, at.astype(np.int64)
