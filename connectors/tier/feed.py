"""The tier feed, read side: the messages of the tier's committed batches, for the queries that
consume the tier instead of the commitlog (the Kafka mirror).

A consumer's position is the end of a batch the tier committed (its ``source_end``), so what it
still needs is exactly the staging objects of the batches after it.  Those objects are read back
as they were committed: already decoded and CRC-checked by the stager, so nothing reads or decodes
the commitlog a second time.  The tier keeps them until every consumer has applied them
(``state.feed.TierFeed`` lists them; ``TierWriter.delete_retired`` holds back their deletion).

Contract of :func:`read_batches`: every message of the listed batches in ``[start, end)`` (by
physical offset), once, each staging object's rows in physical order and the objects in the
order the tier committed them, so every queue's messages come in queue order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from connectors.tier.backend import Backend
from connectors.tier.layout import read_object_rows


@dataclass(frozen=True)
class FeedBatch:
    """One batch the tier committed: the commitlog range ``[start, end)`` it covered and its
    staging objects as ``(name, size, first_phy)``, in physical order (none when the tier's topic
    filter left nothing of it)."""

    start: int
    end: int
    objects: tuple[tuple[str, int, int], ...]

    def to_json(self) -> dict:
        return {"start": self.start, "end": self.end, "objects": [list(o) for o in self.objects]}

    @classmethod
    def from_json(cls, d: dict) -> "FeedBatch":
        return cls(d["start"], d["end"], tuple(tuple(o) for o in d["objects"]))

    @classmethod
    def from_record(cls, record: dict) -> "FeedBatch":
        """The batch a tier ``batch`` commit record made visible."""
        objects = sorted((o["name"], o["size"], o["first_phy"]) for o in record["staging"])
        return cls(record["source_start"], record["source_end"], tuple(sorted(objects, key=lambda o: o[2])))


def read_batches(backend: Backend, batches: Iterable[FeedBatch], start: int, end: int,
                 columns: tuple[str, ...] | None = None) -> Iterator[pa.RecordBatch]:
    """The messages of ``batches`` whose physical offset is in ``[start, end)`` (see the module's
    contract); ``columns``: the message columns to read (``phy_offset`` is always read)."""
    wanted = None if columns is None else list(dict.fromkeys((*columns, "phy_offset")))
    for batch in batches:
        if batch.end <= start or batch.start >= end:
            continue
        for name, size, _first in batch.objects:
            table = read_object_rows(backend, name, None, wanted, size=size)
            if batch.start < start or batch.end > end:
                phy = table["phy_offset"]
                table = table.filter(pc.and_(pc.greater_equal(phy, start), pc.less(phy, end)))
            table = table.sort_by("phy_offset")  # staged by (topic, queue, offset): queue order either way
            yield from table.to_batches()
