"""Latest-per-key tables: one Iceberg table per topic whose data file, per broker, is that broker's
newest compacted snapshot of the topic (``connectors.tier.snapshots``).

The contract: after ``commit(through, names)`` returns, each named topic's table holds exactly one
file of this broker, ``names[topic]``: every live key of the topic below physical offset
``through`` (deleted and expired keys absent), registered in place.  Each commit is one table
snapshot, so an older table snapshot gives the values as of an earlier compacted snapshot (time
travel), for as long as the tier keeps that snapshot's file (``compaction.snapshot_keep``).

Why this shape: a compacted snapshot already is the table's content, written once by the
compaction query, so registering it costs one commit and no copy; the snapshot's writer lets go of
an older file only after ``release``, which expires the table snapshots that list it, so no table
snapshot ever names a deleted file.  A crash between a snapshot and its commit leaves the table one
snapshot behind, and the next snapshot's commit replaces the file either way.
"""

from __future__ import annotations

import logging

from connectors.faults import crash_point
from connectors.tables.base import TopicTables, data_files
from connectors.tier import snapshots
from connectors.tier.layout import escape_topic

log = logging.getLogger(__name__)
THROUGH = "tierlog.through-phy."  # + broker: the snapshot's physical offset the table reflects


class LatestTables(TopicTables):
    """Keeps one broker's newest compacted snapshot of each topic in that topic's latest-per-key
    table.  Implements ``connectors.tier.snapshots.SnapshotTables``.  Not thread-safe."""

    kind = "latest"

    def commit(self, through_phy: int, names: dict[str, str]) -> None:
        for topic, name in sorted(names.items()):
            self._commit(topic, (name, through_phy))

    def release(self, doomed: list[snapshots.Snapshot]) -> set[str]:
        """Expire every table snapshot but the current that lists one of ``doomed``; returns the
        doomed names a current snapshot still lists."""
        needed: set[str] = set()
        by_topic: dict[str, set[str]] = {}
        for snap in doomed:
            by_topic.setdefault(snap.topic, set()).add(self._uri(snap.name))
        for topic, uris in sorted(by_topic.items()):
            ident = self._identifier(topic)
            if not self.catalog.table_exists(ident):  # only the doomed snapshots' tables are loaded
                continue
            table = self._tables[topic] = self.catalog.load_table(ident)
            current = table.current_snapshot()
            expired = []
            for snap in table.metadata.snapshots:
                listed_uris = uris & {f.file_path for f in data_files(table, snap)}
                if not listed_uris:
                    continue
                if current is not None and snap.snapshot_id == current.snapshot_id:
                    needed |= {u[len(self._uri("")):] for u in listed_uris}
                else:
                    expired.append(snap)
            self._expire(topic, expired)
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
        have = self._files(topic, f"{snapshots.PREFIX}broker={escape_topic(self.broker)}/")
        if list(have) == [name]:
            return
        summary = {"tierlog.broker": self.broker, "tierlog.through-phy": str(through)}
        with table.transaction() as tx:
            with tx.update_snapshot(snapshot_properties=summary).overwrite() as overwrite:
                for old in sorted(set(have) - {name}):
                    overwrite.delete_data_file(have[old])
                if name not in have:
                    overwrite.append_data_file(parquet_file_to_data_file(table.io, tx.table_metadata, self._uri(name)))
            tx.set_properties({THROUGH + self.broker: str(through)})
            crash_point("latest_table_committing")
        log.info("table %s: the snapshot through physical offset %d of broker %s", self._name(topic), through,
                 self.broker)

    def _schema_and_spec(self):
        from pyiceberg.io.pyarrow import _pyarrow_to_schema_without_ids
        from pyiceberg.partitioning import PartitionField, PartitionSpec
        from pyiceberg.schema import assign_fresh_schema_ids
        from pyiceberg.transforms import IdentityTransform

        schema = assign_fresh_schema_ids(_pyarrow_to_schema_without_ids(snapshots.SNAPSHOT_SCHEMA))
        spec = PartitionSpec(PartitionField(schema.find_field("broker").field_id, 1000, IdentityTransform(), "broker"))
        return schema, spec

