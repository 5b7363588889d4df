"""Replaying messages into changed keys: the view's catch-up after a crash (the compaction query,
from the tier's committed batches), the changelog's catch-up, and the offline rebuild
(``state.rebuild``, from the commitlog) share it.  ``reader`` is anything with the commitlog
reader's ``record_batches``: a ``CommitLogReader`` or ``connectors.tier.feed.FeedMessages``."""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pyarrow.compute as pc

from connectors.changes import CHANGE_ROW
from connectors.commitlog.arrow import dispatched_mask, project_schema
from connectors.commitlog.topics import TopicFilter
from state.kv import KVView

log = logging.getLogger("tierlog.kv")

REPLAY_COLUMNS = ("topic", "key", "phy_offset", "queue_id", "queue_offset", "store_ts", "sysflag", "op", "body")


def keyed_mask(table) -> pa.Array:
    """The Arrow twin of ``streaming.queries.compaction.latest_per_key.keyed_messages``: true for a keyed message that
    entered a queue."""
    return pc.and_(pc.is_valid(table["key"]), dispatched_mask(table["sysflag"]))


def keyed_rows(table: pa.Table, topics: TopicFilter | None = None) -> pa.Table:
    """Keyed messages that entered a queue (``keyed_mask``, of the topics ``topics`` accepts), with
    ``deleted`` in place of ``op``."""
    keep = keyed_mask(table)
    if topics is not None and table.num_rows:
        keep = pc.and_(keep, topics.mask(table["topic"]))
    table = table.filter(keep)
    return table.append_column("deleted", pc.equal(table["op"], "delete"))


def replay_messages(kv: KVView, reader, start: int, end: int, key_property: str = "KEYS",
                     topics: TopicFilter | None = None) -> int:
    """Apply every keyed message in ``[start, end)`` of ``reader`` to ``kv``; returns how many were read."""
    count, next_report = 0, time.monotonic() + 5
    for batch in reader.record_batches(start, end, key_property=key_property, columns=REPLAY_COLUMNS):
        kv.apply_table(keyed_rows(pa.Table.from_batches([batch]), topics))
        count += batch.num_rows
        if time.monotonic() >= next_report:
            done = batch.column("phy_offset")[-1].as_py() - start
            log.info("replaying messages into the KV view: %d message(s), %.0f%% of %d bytes",
                     count, 100 * done / max(1, end - start), end - start)
            next_report = time.monotonic() + 5
    return count


def latest_changes(reader, start: int, end: int, key_property: str = "KEYS",
                   topics: TopicFilter | None = None) -> pa.Table:
    """Each key's latest change in ``[start, end)`` of ``reader``, in physical order, as
    ``CHANGE_ROW``s: for a rebuild from the commitlog, without Spark (docs/architecture.md, "Latest
    per key, four times")."""
    parts = [keyed_rows(pa.Table.from_batches([b]), topics)
             for b in reader.record_batches(start, end, key_property=key_property, columns=REPLAY_COLUMNS)]
    columns = list(CHANGE_ROW)
    if not parts:
        return keyed_rows(project_schema(REPLAY_COLUMNS).empty_table()).select(columns)
    table = pa.concat_tables(parts)
    last = {tk: i for i, tk in enumerate(zip(table["topic"].to_pylist(), table["key"].to_pylist()))}
    return table.take(sorted(last.values())).select(columns)
