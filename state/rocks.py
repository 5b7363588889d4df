"""Opening the RocksDB stores (rocksdict) the same way everywhere."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, TypeVar

from rocksdict import AccessType, Options, Rdict, WriteOptions

log = logging.getLogger("tierlog.state")

# What RocksDB says when a store is opened without its lock just as its writer replaces the MANIFEST
# (a restart's open): it read a MANIFEST half written or already gone.  CI met the first in a
# compaction query's feed and in `tierlog commitlog gc` beside a restarting service; a moment later
# the same open succeeds.
_TRANSIENT = ("does not match existing comparator", "No such file or directory", "MANIFEST")
OPEN_ATTEMPTS = 8

T = TypeVar("T")


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is RocksDB meeting its writer replacing the MANIFEST (``_TRANSIENT``)."""
    return any(m in str(exc) for m in _TRANSIENT)


def tried_again(open_once: Callable[[], T], what: str, *, attempts: int = OPEN_ATTEMPTS,
                retriable: Callable[[BaseException], bool] = transient) -> T:
    """``open_once()``, tried again after 0.2 s, 0.4 s, ... while it raises what ``retriable`` takes,
    ``attempts`` times in all (8: about 6 s); the last try's error is raised as it is.  ``what``
    names the store in the log line of each retry."""
    for attempt in range(attempts - 1):
        try:
            return open_once()
        except Exception as exc:  # noqa: BLE001 - rocksdict raises plain Exception with RocksDB's message
            if not retriable(exc):
                raise
            log.info("%s did not open (%s): trying again", what, exc)
            time.sleep(0.2 * (attempt + 1))
    return open_once()


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
    RocksDB's message (a held lock says "lock"); a read-only open that meets
    the writer replacing its MANIFEST (``_TRANSIENT``) is tried again first, for
    about 6 s in all (``tried_again``; a secondary's caller tries again with a new scratch
    directory).

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
    if not read_only or secondary is not None:
        # The writer's open holds the lock; a secondary's caller tries again with a new scratch
        # directory (streaming.sources.tierfeed).
        return Rdict(path, opts, access_type=access)
    return tried_again(lambda: Rdict(path, opts, access_type=access),
                       f"RocksDB store {path} (its writer may be replacing its MANIFEST)")


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
