"""The embedded producer: appends messages to a commitlog directory.

It writes what a RocketMQ broker writes (§3-§9 of docs/commitlog-format.md):
pre-sized mapped files named by their start offset, records that never span
two files, a blank marker at the end of each full file, and per-(topic, queue)
queue offsets.

Readers in other processes may read while it appends.  Each append writes a
batch with its first TOTALSIZE negated (pending), then the real TOTALSIZE, so a
reader sees either nothing or the whole batch; a writer killed in between
leaves a pending record that readers wait at and the next writer zeroes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import time
from typing import Iterable

import numpy as np

from connectors.commitlog import format as fmt
from connectors.commitlog.errors import WriterLockedError
from connectors.commitlog.reader import CommitLogReader, list_files
from connectors.faults import crash_point

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
QUEUE_OFFSETS_FILE = ".queue_offsets.json"
FSYNC_POLICIES = ("always", "interval", "never")


class CommitLogWriter:
    """Appends messages; the only writer of its directory while open.

    ``fsync``: ``always`` syncs before ``append`` returns (RocketMQ's SYNC_FLUSH);
    ``interval`` syncs at most every ``fsync_interval_s`` and on close (ASYNC_FLUSH);
    ``never`` leaves it to the OS.

    Queue offsets resume after a restart: from the ``.queue_offsets.json``
    checkpoint written at every file roll and on close, plus a scan of what
    was appended after it.
    """

    def __init__(
        self,
        directory: str,
        *,
        file_size: int = fmt.DEFAULT_FILE_SIZE,
        fsync: str = "interval",
        fsync_interval_s: float = 1.0,
        store_host: str = "127.0.0.1:10911",
    ):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        if file_size < 4096:
            raise ValueError(f"file_size {file_size} is too small; use at least 4096 bytes")
        self.directory = directory
        self.file_size = file_size
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.store_host = store_host
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = self._take_lock()
        self._fd: int | None = None
        self._base = 0
        self._pos = 0
        self._dirty = False
        self._last_sync = time.monotonic()
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self._recover()

    # ------------------------------------------------------------ open / recover

    def _take_lock(self) -> int:
        fd = os.open(os.path.join(self.directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WriterLockedError(
                f"commitlog {self.directory} is already open for writing by process {holder}; "
                "only one writer may append to a commitlog. Stop the other producer first."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _recover(self) -> None:
        files = list_files(self.directory)
        if files and files[0].length != self.file_size:
            log.info("commitlog %s uses %d-byte files; keeping that size", self.directory, files[0].length)
            self.file_size = files[0].length
        if not files:
            self._open_file(0)
            return
        start = self._load_checkpoint(files)
        with CommitLogReader(self.directory, check_crc=False) as reader:  # a walk of headers
            end = start
            for span in reader.spans(start):
                buf = reader._map(span.file)
                for pos in span.starts:
                    m = fmt.decode(buf, pos)
                    if m.dispatched:
                        self.queue_offsets[(m.topic, m.queue_id)] = m.queue_offset + 1
                end = span.end
        last = max((f for f in files if f.base <= end), key=lambda f: f.base)
        if end == last.end:  # ended exactly at a file boundary: start the next one
            self._open_file(last.end)
        else:
            self._open_file(last.base)
            self._pos = end - last.base
            self._discard_torn_tail()

    def _load_checkpoint(self, files) -> int:
        path = os.path.join(self.directory, QUEUE_OFFSETS_FILE)
        try:
            with open(path) as fh:
                data = json.load(fh)
            offset = int(data["offset"])
            queues = {(t, int(q)): int(n) for t, q, n in data["queues"]}
        except FileNotFoundError:
            if files[0].base > 0:
                log.warning(
                    "commitlog %s has no %s and starts at %d: queue offsets are recovered from the "
                    "retained files only", self.directory, QUEUE_OFFSETS_FILE, files[0].base
                )
            return files[0].base
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s (%s); rescanning the log", path, exc)
            return files[0].base
        if not files[0].base <= offset <= files[-1].end:
            log.warning("ignoring %s: its offset %d is outside the log; rescanning", path, offset)
            return files[0].base
        self.queue_offsets = queues
        return offset

    def _discard_torn_tail(self) -> None:
        """Zero whatever a crashed append left after the last complete record."""
        head = os.pread(self._fd, 16, self._pos)
        if not any(head):
            return
        last_nonzero = self._pos
        chunk = 16 << 20
        for off in range(self._pos, self.file_size, chunk):
            data = np.frombuffer(os.pread(self._fd, min(chunk, self.file_size - off), off), np.uint8)
            nz = np.flatnonzero(data)
            if len(nz):
                last_nonzero = off + int(nz[-1]) + 1
        n = last_nonzero - self._pos
        log.warning(
            "commitlog %s: discarding %d bytes of an incomplete append at physical offset %d "
            "(a producer stopped mid-write); no complete message is affected",
            self._path(self._base), n, self._base + self._pos,
        )
        os.pwrite(self._fd, bytes(n), self._pos)
        os.fsync(self._fd)

    def _path(self, base: int) -> str:
        return os.path.join(self.directory, fmt.file_name(base))

    def _open_file(self, base: int) -> None:
        fd = os.open(self._path(base), os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size < self.file_size:
            os.ftruncate(fd, self.file_size)  # pre-sized and sparse, like a broker's mapped file
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._base, self._pos = fd, base, 0

    # ------------------------------------------------------------ appending

    @property
    def offset(self) -> int:
        """Physical offset the next record will get."""
        return self._base + self._pos

    def append(self, msg: fmt.Message) -> fmt.Message:
        return self.append_many([msg])[0]

    def append_many(self, msgs: Iterable[fmt.Message]) -> list[fmt.Message]:
        """Append messages in order; returns them with queue and physical offsets assigned.

        All messages are encoded (and so validated) before any byte is written,
        so a bad message in the list leaves the log and the queue offsets as
        they were.  The records are stored as one contiguous write per file.
        """
        msgs = list(msgs)
        records = self._encode_all(msgs)
        pending: list[bytes] = []
        pending_start = self._pos
        for msg, record in zip(msgs, records):
            if self._pos + len(record) + fmt.END_FILE_MIN_BLANK_LENGTH > self.file_size:
                self._write(pending_start, pending)
                pending, pending_start = [], 0
                self._roll()
            msg.phy_offset = self._base + self._pos
            struct.pack_into(">q", record, fmt.POS_PHY_OFFSET, msg.phy_offset)
            pending.append(record)
            self._pos += len(record)
            if msg.dispatched:
                self.queue_offsets[(msg.topic, msg.queue_id)] = msg.queue_offset + 1
        self._write(pending_start, pending)
        self._maybe_sync()
        return msgs

    def _encode_all(self, msgs: list[fmt.Message]) -> list[bytearray]:
        now = int(time.time() * 1000)
        next_offsets: dict[tuple[str, int], int] = {}
        records = []
        for msg in msgs:
            if not msg.topic or "\x00" in msg.topic:
                # RocketMQ's topic validator refuses both, and a reader finding the end of a
                # record being written relies on a topic never ending in a NUL byte.
                raise ValueError(f"topic {msg.topic!r} is empty or contains a NUL character")
            if msg.dispatched:
                key = (msg.topic, msg.queue_id)
                msg.queue_offset = next_offsets.get(key, self.queue_offsets.get(key, 0))
                next_offsets[key] = msg.queue_offset + 1
            else:
                msg.queue_offset = 0  # §8: PREPARED and ROLLBACK records take no queue offset
            msg.store_ts = msg.store_ts or now
            msg.born_ts = msg.born_ts or now
            if msg.store_host == fmt.Message.store_host:
                msg.store_host = self.store_host
            record = bytearray(fmt.encode(msg))
            if len(record) + fmt.END_FILE_MIN_BLANK_LENGTH > self.file_size:
                raise ValueError(f"a {len(record)}-byte record cannot fit a {self.file_size}-byte commitlog file")
            msg.size = len(record)
            (msg.sysflag,) = struct.unpack_from(">i", record, fmt.POS_SYSFLAG)  # with the IPv6 bits encode set
            records.append(record)
        return records

    def _write(self, start: int, records: list[bytes]) -> None:
        if not records:
            return
        data = bytearray(b"".join(records))
        published = bytes(data[:4])
        # Pending: the first TOTALSIZE negated, so a reader (and the next writer) can tell an append cut
        # short by a crash from corruption: nothing else writes a negative size that matches its record.
        struct.pack_into(">i", data, 0, -len(records[0]))
        os.pwrite(self._fd, data, start)
        crash_point("torn_append")
        os.pwrite(self._fd, published, start)  # publishes the first record, and so the batch
        self._dirty = True

    def _roll(self) -> None:
        """§9: blank marker, then continue at offset 0 of the next file."""
        old_fd, old_pos, next_base = self._fd, self._pos, self._base + self.file_size
        self._fd = None
        fd = os.open(self._path(next_base), os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size < self.file_size:
            os.ftruncate(fd, self.file_size)
        os.pwrite(old_fd, fmt.blank_record(self.file_size - old_pos), old_pos)
        if self.fsync != "never":
            os.fsync(old_fd)
        os.close(old_fd)
        self._fd, self._base, self._pos = fd, next_base, 0
        self._write_checkpoint()

    def _maybe_sync(self) -> None:
        if self.fsync == "always" or (
            self.fsync == "interval" and time.monotonic() - self._last_sync >= self.fsync_interval_s
        ):
            self.flush()

    def flush(self) -> None:
        """Make everything appended so far durable."""
        if self._dirty and self._fd is not None:
            os.fdatasync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def _write_checkpoint(self) -> None:
        path = os.path.join(self.directory, QUEUE_OFFSETS_FILE)
        tmp = path + ".tmp"
        data = {"offset": self.offset, "queues": [[t, q, n] for (t, q), n in sorted(self.queue_offsets.items())]}
        with open(tmp, "w") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def close(self) -> None:
        if self._fd is None:
            return
        self.flush()
        self._write_checkpoint()
        os.close(self._fd)
        self._fd = None
        os.close(self._lock_fd)

    def __enter__(self) -> "CommitLogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
