"""One Iceberg commit that adds and removes data files of two partition specs at once, and data files
described from Parquet footers tierlog already holds.

A message table lists the tier's sealed segments under the *segment spec* (``broker``,
``queue_id``: each segment is one queue) and its fresh files, which hold several queues, under the
*fresh spec* (``broker``).  Replacing fresh files by segments is one commit that removes files of
one spec and adds files of the other.  pyiceberg 0.12 writes every added file into one manifest
of the table's default spec, so ``replace`` writes one added manifest per spec instead, and leaves
the rest to pyiceberg: its overwrite reads only the manifests whose spec and partitions may hold a
removed file, so removing fresh files never reads the segments' manifests, and a commit's cost
stays flat in the table's history.  Manifests are merged per spec as a merge-append merges them.

Contract: ``replace(tx, add, remove, properties)`` stages one snapshot in the transaction ``tx``:
APPEND when nothing is removed, else OVERWRITE.  ``described(...)`` is a ``DataFile`` of a spec
from a Parquet footer, the statistics computed as pyiceberg's ``add_files`` computes them.
"""

from __future__ import annotations

from collections import defaultdict

from pyiceberg.io.pyarrow import compute_statistics_plan, data_file_statistics_from_parquet_metadata, \
    parquet_path_to_id_mapping
from pyiceberg.manifest import DataFile, DataFileContent, FileFormat, ManifestContent, ManifestEntry, \
    ManifestEntryStatus, ManifestFile
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update.snapshot import _ManifestMergeManager, _OverwriteFiles
from pyiceberg.utils.properties import property_as_bool, property_as_int


class _Replace(_OverwriteFiles):
    """pyiceberg's overwrite, with the added files' manifests written one per partition spec."""

    def _manifests(self) -> list[ManifestFile]:
        self._build_delete_files_partition_predicate()
        deleted = self._deleted_entries()
        manifests = []
        added: dict[int, list[DataFile]] = defaultdict(list)
        for data_file in self._added_data_files:
            added[data_file.spec_id].append(data_file)
        for spec_id, files in sorted(added.items()):
            with self.new_manifest_writer(spec=self.spec(spec_id)) as writer:
                for data_file in files:
                    writer.add(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=self._snapshot_id,
                                                       sequence_number=None, file_sequence_number=None,
                                                       data_file=data_file))
            manifests.append(writer.to_manifest_file())
        removed: dict[int, list[ManifestEntry]] = defaultdict(list)
        for entry in deleted:
            removed[entry.data_file.spec_id].append(entry)
        for spec_id, entries in sorted(removed.items()):
            with self.new_manifest_writer(self.spec(spec_id)) as writer:
                for entry in entries:
                    writer.add_entry(entry)
            manifests.append(writer.to_manifest_file())
        manifests += self._existing_manifests()
        return self._process_manifests(manifests)

    def _process_manifests(self, manifests: list[ManifestFile]) -> list[ManifestFile]:
        from pyiceberg.table import TableProperties

        props = self._transaction.table_metadata.properties
        merger = _ManifestMergeManager(
            target_size_bytes=property_as_int(props, TableProperties.MANIFEST_TARGET_SIZE_BYTES,
                                              TableProperties.MANIFEST_TARGET_SIZE_BYTES_DEFAULT),
            min_count_to_merge=property_as_int(props, TableProperties.MANIFEST_MIN_MERGE_COUNT,
                                               TableProperties.MANIFEST_MIN_MERGE_COUNT_DEFAULT),
            merge_enabled=property_as_bool(props, TableProperties.MANIFEST_MERGE_ENABLED,
                                           TableProperties.MANIFEST_MERGE_ENABLED_DEFAULT),
            snapshot_producer=self)
        data = [m for m in manifests if m.content == ManifestContent.DATA]
        return merger.merge_manifests(data) + [m for m in manifests if m.content != ManifestContent.DATA]


def replace(tx, add: list[DataFile], remove: list[DataFile], properties: dict[str, str]) -> None:
    """Stage one snapshot in ``tx`` that adds ``add`` and removes ``remove`` (files as the table lists them)."""
    has_snapshot = tx.table_metadata.current_snapshot() is not None
    operation = Operation.OVERWRITE if remove and has_snapshot else Operation.APPEND
    producer = _Replace(operation=operation, transaction=tx, io=tx._table.io, snapshot_properties=properties)
    for data_file in add:
        producer.append_data_file(data_file)
    for data_file in remove:
        producer.delete_data_file(data_file)
    producer.commit()


def described(table_metadata, spec_id: int, uri: str, footer, size: int) -> DataFile:
    """The ``DataFile`` of the Parquet file at ``uri`` (``size`` bytes, ``footer`` its
    ``pyarrow.parquet.FileMetaData``) under the spec ``spec_id`` of the table."""
    schema = table_metadata.schema()
    stats = data_file_statistics_from_parquet_metadata(
        parquet_metadata=footer, stats_columns=compute_statistics_plan(schema, table_metadata.properties),
        parquet_column_mapping=parquet_path_to_id_mapping(schema))
    data_file = DataFile.from_args(content=DataFileContent.DATA, file_path=uri, file_format=FileFormat.PARQUET,
                                   partition=stats.partition(table_metadata.specs()[spec_id], schema),
                                   file_size_in_bytes=size, sort_order_id=None, equality_ids=None,
                                   key_metadata=None, **stats.to_serialized_dict())
    data_file.spec_id = spec_id  # not a field of the file's record: pyiceberg keeps it beside
    return data_file


def spec_files(table, snapshot, spec_id: int) -> list[DataFile]:
    """The data files ``snapshot`` lists under spec ``spec_id``: only that spec's manifests are read."""
    return [entry.data_file for manifest in snapshot.manifests(table.io) if manifest.partition_spec_id == spec_id
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True)]
