"""What every kind of table here shares: one Iceberg table per topic, created on first use, loaded
once per process, committed with retries that recompute the change from the table.

A subclass names its ``kind`` (the table property ``tierlog.kind``), its name template, and its
schema and partition spec; ``_commit_once`` is its commit.  Both kinds register files the tier
already holds (``add_files`` reads each footer for the column statistics), so a table commit never
copies a byte.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

from connectors.errors import ConfigError
from connectors.tables.catalog import TableSettings, data_location, open_catalog, table_name, warn_if_renamed

log = logging.getLogger(__name__)
KIND = "tierlog.kind"
TOPIC = "tierlog.topic"
# pyiceberg leaves manifest merging off: each add_files commit adds a manifest and planning slows
# with every one.
# Why a 256 KB manifest target (Iceberg's default is 8 MB): a merge rewrites every manifest in the
# bin it packs, so with 8 MB the one big manifest, which grows with the files the table holds, was
# rewritten every 20 commits, and commits grew slower with the table's history.  With 256 KB a
# full manifest is left alone and a commit's cost stays flat (./dev bench tables; docs/benchmarks.md).
# A scan opens more, smaller manifests, each pruned by its partitions.
TABLE_PROPERTIES = {"commit.manifest-merge.enabled": "true", "commit.manifest.min-count-to-merge": "20",
                    "commit.manifest.target-size-bytes": str(256 << 10),
                    "commit.retry.num-retries": "10", "format-version": "2",
                    # every commit writes a metadata file: keep the last few, as Iceberg's Java writers can
                    "write.metadata.delete-after-commit.enabled": "true", "write.metadata.previous-versions-max": "20"}
COMMIT_ATTEMPTS = 5  # our own retries around pyiceberg's, each recomputing the change from the table


class TopicTables(ABC):
    """One broker's tables of one kind, one per topic.  Not thread-safe."""

    kind = ""

    def __init__(self, settings: TableSettings, tier_location: str, broker: str, catalog=None):
        self.settings = settings
        self.tier_location = tier_location
        self.broker = broker
        self.catalog = catalog or open_catalog(settings)
        self._tables: dict[str, object] = {}

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def _name_template(self) -> str:
        """The table name template (``tables.name`` or ``tables.latest_name``)."""

    @abstractmethod
    def _schema_and_spec(self):
        """The Iceberg schema and partition spec of a new table of this kind."""

    @abstractmethod
    def _commit_once(self, topic: str, change) -> None:
        """One attempt at committing ``change`` to ``topic``'s table, measured against it as it is."""

    # ------------------------------------------------------------ shared

    def topics(self) -> list[str]:
        """Topics with a table of this kind in the namespace."""
        return sorted(self._listed())

    def table(self, topic: str):
        return self._table(topic)

    def _listed(self) -> dict[str, object]:
        """Every table of this kind in the namespace, by topic, each loaded once."""
        out = {}
        for ident in self.catalog.list_tables(self.settings.namespace):
            table = self.catalog.load_table(ident)
            if table.properties.get(KIND) == self.kind and TOPIC in table.properties:
                out[table.properties[TOPIC]] = table
        return out

    def _commit(self, topic: str, change) -> None:
        """Commit ``change``, measured against the table as it is at each attempt (so a retry after a
        lost race, or a sync repeated after a crash, adds and removes each file once)."""
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                self._commit_once(topic, change)
                return
            except Exception as exc:
                # A lost race that pyiceberg's own retries could not settle; or a table loaded before
                # another broker's commit expired its current snapshot and deleted that snapshot's
                # manifests (FileNotFoundError): loaded again, it is current.
                lost = type(exc).__name__ in ("CommitFailedException", "ValidationException")
                if attempt == COMMIT_ATTEMPTS - 1 or not (lost or isinstance(exc, FileNotFoundError)):
                    raise
                log.warning("table %s: commit lost a race (%s); recomputing from the table", self._name(topic), exc)
                time.sleep(0.1 * 2 ** attempt)
                self._tables.pop(topic, None)

    def _name(self, topic: str) -> str:
        return table_name(self._name_template(), topic)

    def _identifier(self, topic: str) -> tuple[str, str]:
        return self.settings.namespace, self._name(topic)

    def _table(self, topic: str):
        if topic not in self._tables:
            self._tables[topic] = self._create_or_load(topic)
        return self._tables[topic]

    def _create_or_load(self, topic: str):
        from pyiceberg.exceptions import TableAlreadyExistsError

        ident = self._identifier(topic)
        if self.catalog.table_exists(ident):
            table = self.catalog.load_table(ident)
            # Made by an older tierlog: the properties added since (a value someone set stays).
            missing = {k: v for k, v in TABLE_PROPERTIES.items() if k not in table.properties and k != "format-version"}
            if missing and table.properties.get(KIND) == self.kind:
                with table.transaction() as tx:
                    tx.set_properties(missing)
        else:
            schema, spec = self._schema_and_spec()
            props = {**TABLE_PROPERTIES, KIND: self.kind, TOPIC: topic,
                     "schema.name-mapping.default": schema.name_mapping.model_dump_json()}
            warn_if_renamed(self._name_template(), topic)
            try:
                table = self.catalog.create_table(ident, schema=schema, partition_spec=spec, properties=props)
            except TableAlreadyExistsError:  # another broker's tierlog made it first
                table = self.catalog.load_table(ident)
        if (table.properties.get(TOPIC), table.properties.get(KIND)) == (topic, self.kind):
            table = self._prepare(table)
        if (table.properties.get(TOPIC), table.properties.get(KIND)) != (topic, self.kind):
            raise ConfigError(f"settings tables.name and tables.latest_name: the {self.kind} table of topic "
                              f"{topic!r} would be {'.'.join(ident)}, which is the "
                              f"{table.properties.get(KIND)} table of topic {table.properties.get(TOPIC)!r}; "
                              "put the topic itself in each name template, and make the two templates differ")
        return table

    def _prepare(self, table):
        """Bring a table of this kind made by an older tierlog to what this one needs; the table."""
        return table

    def _uri(self, name: str) -> str:
        return data_location(self.tier_location, name)

    def _files(self, topic: str, prefix: str) -> dict[str, object]:
        """The data files in the table's current snapshot under tier ``prefix``, by tier object name."""
        table = self._table(topic)
        snapshot = table.current_snapshot()
        if snapshot is None:
            return {}
        root = len(data_location(self.tier_location, ""))
        start = data_location(self.tier_location, prefix)
        return {f.file_path[root:]: f for f in data_files(table, snapshot) if f.file_path.startswith(start)}

    def _expire(self, topic: str, expired: list) -> None:
        """Expire ``expired`` snapshots of the table, and delete the manifest lists and manifests only
        they referenced: the metadata JSON, and the planning of every read, would otherwise grow
        with every commit for months.  Data files are the tier's and are never deleted here."""
        table = self._tables[topic]
        if not expired:
            return
        ids = {s.snapshot_id for s in expired}
        kept = [s for s in table.metadata.snapshots if s.snapshot_id not in ids]
        in_use = {m.manifest_path for s in kept for m in s.manifests(table.io)}
        garbage = {s.manifest_list for s in expired}
        garbage |= {m.manifest_path for s in expired for m in s.manifests(table.io)} - in_use
        # The commit brings ``table`` itself to the new metadata, as a transaction's does.
        table.maintenance.expire_snapshots().by_ids(sorted(ids)).commit()
        for path in sorted(garbage):  # after the commit: a crash before it leaves files, never a hole
            try:
                table.io.delete(path)
            except FileNotFoundError:
                pass


def data_files(table, snapshot) -> list:
    """The data files ``snapshot`` of ``table`` lists."""
    return [entry.data_file for manifest in snapshot.manifests(table.io)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True)]


def spec_with(table, fields: tuple[str, ...]) -> int:
    """The id of ``table``'s partition spec of exactly ``fields`` (source column names, in order)."""
    found = find_spec(table, fields)
    if found is None:
        raise RuntimeError(f"table {table.name()} has no partition spec of {fields}")  # the subclass's _prepare adds it
    return found


def find_spec(table, fields: tuple[str, ...]) -> int | None:
    for spec_id, spec in sorted(table.specs().items()):
        if tuple(f.name for f in spec.fields) == fields:
            return spec_id
    return None
