"""Reading what a tier holds, from its location alone.

``TierReader`` trusts only the commit log: it reads the committed state, then
the segments and staging objects that state names.  An object being written,
or written but never committed, is never read; rows past a queue's commit
offset are never returned.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from connectors.commitlog.arrow import MESSAGE_SCHEMA
from connectors.tier import layout
from connectors.tier.backend import Backend, open_backend
from connectors.tier.log import QueueKey, TierLog, TierState


class TierReader:
    def __init__(self, location: str | Backend):
        self.backend = open_backend(location) if isinstance(location, str) else location
        self.log = TierLog(self.backend)

    def state(self) -> TierState:
        return self.log.read_state()

    def queues(self, state: TierState | None = None) -> list[QueueKey]:
        return sorted((state or self.state()).queues)

    def _object(self, name: str, cache: dict | None) -> pa.Table:
        if cache is not None and name in cache:
            return cache[name]
        table = layout.from_parquet(self.backend.read(name))
        if cache is not None:
            cache[name] = table
        return table

    def read_queue(
        self, topic: str, queue_id: int, state: TierState | None = None, cache: dict | None = None
    ) -> pa.Table:
        """Every committed message of one queue, in queue-offset order."""
        state = state or self.state()
        key = (topic, queue_id)
        if key not in state.queues:
            return MESSAGE_SCHEMA.empty_table()
        q = state.queues[key]
        parts = [self._object(seg.name, None) for seg in state.segments_for(key)]
        for obj in state.staging_for(key):
            table = self._object(obj.name, cache)
            mask = pc.and_(
                pc.and_(pc.equal(table["topic"], topic), pc.equal(table["queue_id"], queue_id)),
                pc.and_(pc.greater_equal(table["queue_offset"], q.sealed), pc.less(table["queue_offset"], q.commit)),
            )
            parts.append(table.filter(mask))
        if not parts:
            return MESSAGE_SCHEMA.empty_table()
        table = pa.concat_tables(parts)
        table = table.filter(pc.greater_equal(table["queue_offset"], q.low))
        return table.sort_by("queue_offset")

    def read_all(self, state: TierState | None = None) -> pa.Table:
        """Every committed message, queue by queue."""
        state = state or self.state()
        cache: dict = {}  # staging objects hold many queues: read each once
        tables = [self.read_queue(t, q, state, cache) for t, q in self.queues(state)]
        return pa.concat_tables(tables) if tables else MESSAGE_SCHEMA.empty_table()
