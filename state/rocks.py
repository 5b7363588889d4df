"""Opening the RocksDB stores (rocksdict) the same way everywhere."""

from __future__ import annotations

import os

from rocksdict import AccessType, Options, Rdict, WriteOptions


def exists(path: str) -> bool:
    return os.path.exists(os.path.join(path, "CURRENT"))


def open_rdict(path: str, *, read_only: bool = False, raw_mode: bool = False, secondary: str | None = None,
               blob_min_bytes: int = 0) -> Rdict:
    """Open the store at ``path``, creating it unless ``read_only``.

    Read-only opens do not take RocksDB's lock, so they work while a writer
    has the store open.  ``secondary`` (a scratch directory) opens it as a
    RocksDB secondary instead: no lock either, and ``try_catch_up_with_primary()``
    brings it up to the writer without replaying the whole WAL again, as a
    new read-only open would.  Failures raise rocksdict's exception with
    RocksDB's message (a held lock says "lock").

    ``blob_min_bytes`` (0: off) writes values of that size or more to RocksDB's blob files
    (integrated BlobDB): the LSM tree then holds only a reference, so compaction rewrites keys,
    not values.  Any open reads blob files, with or without it.
    """
    os.makedirs(path, exist_ok=True)
    opts = Options(raw_mode=raw_mode)
    opts.create_if_missing(True)
    if blob_min_bytes:
        opts.set_enable_blob_files(True)
        opts.set_min_blob_size(blob_min_bytes)
        opts.set_enable_blob_gc(True)  # live values move out of the oldest blob files, which are then deleted
    if secondary is not None:
        access = AccessType.secondary(secondary)
    else:
        access = AccessType.read_only() if read_only else AccessType.read_write()
    return Rdict(path, opts, access_type=access)


# What a store holds in memory, as Kafka Streams' RocksDB metrics count it: memtables (the live one
# and those waiting to be flushed), the block cache (32 MiB at most by default), and table readers'
# index and filter blocks.  RocksDB's defaults bound the memtables at 2 x 64 MiB.
MEMORY_PROPERTIES = ("rocksdb.size-all-mem-tables", "rocksdb.block-cache-usage", "rocksdb.estimate-table-readers-mem")


def memory_bytes(db: Rdict) -> int:
    """Bytes of memory the store ``db`` uses (``MEMORY_PROPERTIES``)."""
    return sum(db.property_int_value(p) or 0 for p in MEMORY_PROPERTIES)


def synced_writes() -> WriteOptions:
    """Write options for WriteBatches that must survive a crash: WAL on and synced."""
    options = WriteOptions()
    options.sync = True
    return options


def unlogged_writes() -> WriteOptions:
    """Write options for a store that flushes its memtable after each write instead (the KV view):
    no WAL, so nothing is written twice."""
    options = WriteOptions()
    options.disable_wal = True
    return options
