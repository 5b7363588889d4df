"""Named crash points, for the crash tests and the chaos harness.

``TIERLOG_FAULT=<point>:<n>`` makes the n-th pass through ``point`` (counted
across processes in ``TIERLOG_FAULT_DIR``) SIGKILL the service's driver
process, as an operator's ``kill -9`` or a power cut would.  Unset, a crash
point costs one dictionary lookup.

The driver is the process named by ``TIERLOG_DRIVER_PID``, which ``tierlog
run`` sets before it starts Spark, so Spark's Python workers (forked from a
JVM that inherited it) kill the driver too, not themselves; unset, the
current process.  It lives here, at the bottom of the packages, so that the
connectors that hold crash points need nothing from the Spark layer.

``TIERLOG_FAULT_LATE_WORKER`` fails a batch as a late Python worker fails it
(``late_worker_fault``).

``TIERLOG_FAULT_DISK_FULL=<file>`` makes every write to a posix tier fail
with ENOSPC while ``<file>`` exists: a full disk the chaos harness can fill
and free without root (a size-limited mount needs it).
"""

from __future__ import annotations

import errno
import os
import signal

POINTS = (
    "staged",  # executor: a staging object uploaded, the batch not yet committed
    "uploaded",  # driver: all staging objects uploaded, dispatch not yet recorded
    "dispatched",  # driver: dispatch offsets recorded, no commit record yet
    "logged",  # driver: commit record written, metadata not yet updated
    "committed",  # driver: metadata updated, Spark has not committed the batch
    "seal_uploaded",  # driver: a segment uploaded, no seal record yet
    "sealed",  # driver: seal record written, metadata not yet updated
    "table_committing",  # driver: a table commit's manifests written, the catalog not yet updated
    "table_committed",  # driver: a table commit in the catalog, the writer's deletes not yet done
    "latest_table_committing",  # apply thread: a latest-per-key table commit's manifests written, the catalog not yet
    "fold_written",  # driver: a fold's pages, manifests and buckets written, its root not yet
    "folded",  # driver: a new root written and the records it covers deleted; old versions not yet scheduled
    "collected",  # driver: a compaction batch's changes collected, the KV view not yet updated
    "kv_applied",  # apply thread: the KV view updated, the kv sink offset not yet (Spark may have committed)
    "snapshotted",  # apply thread: one topic's compacted snapshot written, the others not yet
    "mirrored",  # driver: a mirror batch is in Kafka, the mirror sink offset not yet recorded
    "changelogged",  # apply thread: a batch's changes are in Kafka, the KV view not yet updated
    "kafka_sending",  # a Kafka sink (driver, apply thread or mirror task): every 100th record sent, not flushed
    "torn_append",  # the commitlog writer: a batch's bytes written except its first TOTALSIZE (a torn tail)
)


DRIVER_PID = "TIERLOG_DRIVER_PID"


def crash_point(name: str) -> None:
    spec = os.environ.get("TIERLOG_FAULT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    directory = os.environ.get("TIERLOG_FAULT_DIR", "/tmp")
    counter = os.path.join(directory, f"tierlog-fault-{point}")
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b".")
        # This write's own end, not the file's size: two processes passing at once (the staging
        # processes) both read a size of N+1 after their writes, and the N-th pass never fired.
        passes = os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)
    if passes == int(nth or 1):
        os.kill(int(os.environ.get(DRIVER_PID) or os.getpid()), signal.SIGKILL)


def disk_full_fault() -> None:
    """Raise ENOSPC while the file named by ``TIERLOG_FAULT_DISK_FULL`` exists; each time, add a byte
    to ``<that file>.hits``, so a test can tell the service met the full disk, not only that it was full."""
    flag = os.environ.get("TIERLOG_FAULT_DISK_FULL")
    if flag and os.path.exists(flag):
        fd = os.open(flag + ".hits", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


_batches: dict[str, int] = {}  # query -> batches begun in this process, for late_worker_fault


def late_worker_fault(query: str) -> None:
    """With ``TIERLOG_FAULT_LATE_WORKER=<query>:<n>[,<query>:<n>...]``, the n-th batch of ``query``
    begun in this process fails with the error Spark raises when a Python worker connects back
    too late (which a test cannot time on a busy host): the service's restart of a query that had
    run batches, tested.  Unset, one dictionary lookup."""
    spec = os.environ.get("TIERLOG_FAULT_LATE_WORKER")
    if not spec:
        return
    passes = _batches[query] = _batches.get(query, 0) + 1
    if f"{query}:{passes}" in spec.split(","):
        raise RuntimeError("Python worker failed to connect back. (injected)")


READ_LOG = "TIERLOG_READ_LOG"


def note_decoded(start: int, end: int, records: int, crc_checked: bool) -> None:
    """With ``TIERLOG_READ_LOG=<file>`` set, append one line per decoded range of the commitlog
    (``start end records crc``), from whichever process decodes it: the read-counting test's
    witness that each commitlog byte is decoded once.  Unset, one dictionary lookup."""
    path = os.environ.get(READ_LOG)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{start} {end} {records} {int(crc_checked)} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
