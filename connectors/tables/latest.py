"""Latest-per-key tables: one Iceberg table per topic whose data file, per broker, is that broker's
newest compacted snapshot of the topic (``connectors.tier.snapshots``).

The contract: after ``commit(through, names)`` returns, each named topic's table holds exactly one
file of this broker, ``names[topic]``: every live key of the topic below physical offset
``through`` (deleted and expired keys absent), registered in place.  Each commit is one table
snapshot, so an older table snapshot gives the values as of an earlier compacted snapshot (time
travel), for as long as the tier keeps that snapshot's file (``compaction.snapshot_keep``).

A topic with typed columns (``topics.body_format``) lists a typed copy of the snapshot instead
(``connectors.tables.typed``): its rows and its bodies' typed columns, the table's schema grown (or
widened) in the same transaction that lists it, so a reader never meets a file the schema does not
fit.  Each copy parses the topic's live keys once more: the table follows the snapshots, every
``compaction.snapshot_interval_s``, not each message.

Why this shape: a compacted snapshot already is the table's content, written once by the
compaction query, so registering it costs one commit and no copy; the snapshot's writer lets go of
an older file only after ``release``, which expires the table snapshots that list it, so no table
snapshot ever names a deleted file.  A crash between a snapshot and its commit leaves the table one
snapshot behind, and the next snapshot's commit replaces the file either way.
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.bodies.base import ERRORS, ERRORS_TYPE
from connectors.bodies.formats import BodyFormats
from connectors.faults import crash_point
from connectors.tables.base import TopicTables, data_files
from connectors.tables.typed import TYPED_PREFIX, copy_name, grow, source_of, typed_parquet, typed_schema, widening
from connectors.tier import snapshots
from connectors.tier.layout import escape_topic

log = logging.getLogger(__name__)
THROUGH = "tierlog.through-phy."  # + broker: the snapshot's physical offset the table reflects


class LatestTables(TopicTables):
    """Keeps one broker's newest compacted snapshot of each topic in that topic's latest-per-key
    table.  Implements ``connectors.tier.snapshots.SnapshotTables``.  Not thread-safe."""

    kind = "latest"

    def __init__(self, settings, tier_location: str, broker: str, catalog=None, backend=None):
        super().__init__(settings, tier_location, broker, catalog)
        self.formats = BodyFormats(settings.body_formats)
        self._backend = backend

    @property
    def backend(self):
        if self._backend is None:
            from connectors.tier.location import open_backend

            self._backend = open_backend(self.tier_location)
        return self._backend

    def commit(self, through_phy: int, names: dict[str, str]) -> None:
        for topic, name in sorted(names.items()):
            self._commit(topic, (name, through_phy))

    def release(self, doomed: list[snapshots.Snapshot]) -> set[str]:
        """Expire every table snapshot but the current that lists one of ``doomed``; returns the
        doomed names a current snapshot still lists."""
        needed: set[str] = set()
        by_topic: dict[str, set[str]] = {}
        for snap in doomed:
            by_topic.setdefault(snap.topic, set()).add(snap.name)
        for topic, uris in sorted(by_topic.items()):
            ident = self._identifier(topic)
            if not self.catalog.table_exists(ident):  # only the doomed snapshots' tables are loaded
                continue
            table = self._tables[topic] = self.catalog.load_table(ident)
            current = table.current_snapshot()
            expired = []
            root = len(self._uri(""))
            for snap in table.metadata.snapshots:
                listed = uris & {source_of(f.file_path[root:]) for f in data_files(table, snap)}
                if not listed:
                    continue
                if current is not None and snap.snapshot_id == current.snapshot_id:
                    needed |= listed
                else:
                    expired.append(snap)
            self._expire(topic, expired)
            for name in sorted(uris - needed):  # their typed copies go with them (the tables' own files)
                for info in list(self.backend.list(TYPED_PREFIX + name.removesuffix(".parquet") + ".s")):
                    self.backend.delete(info.name)
        return needed

    def rebuild(self, backend) -> int:
        """Commit the tier's newest snapshot of each topic of this broker; returns the tables committed."""
        newest = snapshots.latest_snapshots(backend, self.broker)
        for topic, snap in sorted(newest.items()):
            self._commit(topic, (snap.name, snap.through_phy))
        return len(newest)

    def info(self) -> list[dict]:
        """One row per latest-per-key table: what ``tierlog table info`` prints."""
        rows = []
        for topic, table in sorted(self._listed().items()):
            snapshot = table.current_snapshot()
            through = table.properties.get(THROUGH + self.broker)
            rows.append({"table": ".".join(self._identifier(topic)), "kind": self.kind, "topic": topic,
                         "metadata_location": table.metadata_location,
                         "snapshot_id": snapshot.snapshot_id if snapshot else None, "tier_seq": None,
                         "through_phy": int(through) if through is not None else None})
        return rows

    # ------------------------------------------------------------ TopicTables

    def _name_template(self) -> str:
        return self.settings.latest_name

    def _commit_once(self, topic: str, name_at: tuple[str, int]) -> None:
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        name, through = name_at
        table = self._table(topic)
        mine = f"{snapshots.PREFIX}broker={escape_topic(self.broker)}/"
        have = {**self._files(topic, mine), **self._files(topic, TYPED_PREFIX + mine)}
        if [source_of(n) for n in have] == [name]:
            return
        summary = {"tierlog.broker": self.broker, "tierlog.through-phy": str(through)}
        with table.transaction() as tx:
            listed = name
            if self.formats.typed(topic):
                listed = self._typed_copy(topic, tx, name)
            with tx.update_snapshot(snapshot_properties=summary).overwrite() as overwrite:
                for old in sorted(set(have) - {listed}):
                    overwrite.delete_data_file(have[old])
                if listed not in have:
                    overwrite.append_data_file(parquet_file_to_data_file(table.io, tx.table_metadata, self._uri(listed)))
            tx.set_properties({THROUGH + self.broker: str(through)})
            crash_point("latest_table_committing")
        log.info("table %s: the snapshot through physical offset %d of broker %s", self._name(topic), through,
                 self.broker)

    def _typed_copy(self, topic: str, tx, name: str) -> str:
        """Write the typed copy of snapshot ``name`` and grow the table's schema to it, in ``tx``;
        the copy's name.  A widened column needs no rewrite here: the copy replaces this broker's
        only file in the same commit."""
        rows = pq.read_table(pa.BufferReader(self.backend.read(name)), schema=snapshots.SNAPSHOT_SCHEMA)
        known = typed_schema(tx.table_metadata)
        typed = self.formats.of(topic).typed(rows["body"], known)
        if typed.schema != known:
            full = pa.schema([*snapshots.SNAPSHOT_SCHEMA, *typed.schema, pa.field(ERRORS, ERRORS_TYPE)])
            grow(tx, full, widening(tx.table_metadata.schema(), typed.widened))
        copy = copy_name(name, tx.table_metadata.current_schema_id)
        self.backend.put(copy, typed_parquet(rows, typed.columns, schema=snapshots.SNAPSHOT_SCHEMA))
        crash_point("latest_typed_copy_written")
        return copy

    def _schema_and_spec(self):
        from pyiceberg.io.pyarrow import _pyarrow_to_schema_without_ids
        from pyiceberg.partitioning import PartitionField, PartitionSpec
        from pyiceberg.schema import assign_fresh_schema_ids
        from pyiceberg.transforms import IdentityTransform

        schema = assign_fresh_schema_ids(_pyarrow_to_schema_without_ids(snapshots.SNAPSHOT_SCHEMA))
        spec = PartitionSpec(PartitionField(schema.find_field("broker").field_id, 1000, IdentityTransform(), "broker"))
        return schema, spec

