"""A tier in a local (or mounted) directory."""

from __future__ import annotations

import errno
import os
import uuid
from typing import Iterator

from connectors.tier.backend import Backend, ObjectInfo, check_name
from connectors.tier.retry import patience, retry_transient
from connectors.tier.errors import ObjectNotFound, TierError, TransientTierError
from connectors.faults import disk_full_fault

_TMP_PREFIX = ".tmp-"

# Why large objects bypass the page cache: a stager's large objects, written through it, cost ten
# times the kernel time they cost with O_DIRECT (the copy into newly allocated page-cache folios,
# ``copy_folio_from_iter_atomic``; docs/benchmarks.md), and reading them back afterwards cost the
# same either way.  Objects this large come
# from a catch-up's batches and from seals, and are read back once, in bulk, if at all; the small
# objects of batches near the head stay in the page cache for the readers that follow at once.
DIRECT_MIN_BYTES = 16 << 20
_DIRECT_CHUNK = 8 << 20  # the aligned buffer a large object is copied through, a chunk at a time
_ALIGN = 4096  # O_DIRECT's alignment of buffer, offset and length: a page covers every block size


def _write(fd: int, data: memoryview) -> None:
    """All of ``data`` to ``fd``, at its current offset 0: objects of ``DIRECT_MIN_BYTES`` and more
    with O_DIRECT where the filesystem takes it, through an aligned buffer, the last chunk padded
    and the file cut back to its length; the rest, and every filesystem without O_DIRECT, buffered."""
    if len(data) >= DIRECT_MIN_BYTES and _direct(fd, True):
        import mmap

        with mmap.mmap(-1, _DIRECT_CHUNK) as buf:
            for off in range(0, len(data), _DIRECT_CHUNK):
                piece = data[off : off + _DIRECT_CHUNK]
                buf[: len(piece)] = piece
                padded = -(-len(piece) // _ALIGN) * _ALIGN
                buf[len(piece) : padded] = bytes(padded - len(piece))
                with memoryview(buf) as view:
                    _write_buffered(fd, view[:padded])
        os.ftruncate(fd, len(data))
        return
    _write_buffered(fd, data)


def _write_buffered(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        if written % _ALIGN and written < len(data):
            _direct(fd, False)  # a short write off the alignment: the rest goes through the page cache
        data = data[written:]


def _direct(fd: int, on: bool) -> bool:
    """Set or clear O_DIRECT on ``fd``; False where the filesystem refuses it (tmpfs before Linux 6.6)."""
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


class PosixBackend(Backend):
    """Objects are files under ``root``.

    ``put`` writes a temporary file in the target directory, fsyncs it,
    renames it over the name and fsyncs the directory: a reader or a crash
    sees the old object or the new one, never a partial file.  A full disk
    (or quota) is retried with backoff for ``retry_deadline_s``, like S3
    throttling: tiering waits for space instead of failing.
    """

    def __init__(self, root: str, *, retry_deadline_s: float | None = None, create: bool = True):
        """``create=False`` for readers: a missing root reads as an empty tier and is not made, since
        a read command pointed at the wrong place must not leave an empty tier behind."""
        self.location = root
        self.retry_deadline_s = patience() if retry_deadline_s is None else retry_deadline_s
        self.root = os.path.abspath(root)
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise TierError(f"tier.location {root!r} cannot be created: {exc.strerror}") from None
        existing = self.root
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing)
        self.name_max = os.pathconf(existing, "PC_NAME_MAX")  # 255 bytes on ext4, xfs, btrfs

    def _path(self, name: str) -> str:
        path = os.path.join(self.root, check_name(name, max_part_bytes=self.name_max, where=self.root))
        if os.path.commonpath([self.root, os.path.realpath(os.path.dirname(path))]) != self.root:
            raise TierError(f"object {name!r} resolves outside the tier root {self.root}")
        return path

    def put(self, name: str, data: bytes) -> None:
        retry_transient(lambda: self._put_once(name, data), self.retry_deadline_s)

    def _put_once(self, name: str, data: bytes) -> None:
        path = self._path(name)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            disk_full_fault()
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write(fd, memoryview(data).cast("B"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TransientTierError(
                    f"tier {self.root} is full writing {name!r}: free space or raise the quota; "
                    "tiering waits and retries, and loses nothing"
                ) from None
            raise TierError(f"cannot write {name!r} under tier {self.root}: {exc.strerror}") from None

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(name), "rb") as fh:
                fh.seek(start)
                return fh.read() if length is None else fh.read(length)
        except FileNotFoundError:
            raise ObjectNotFound(f"tier object {name!r} not found under {self.root}") from None

    def open_input(self, name: str, size: int | None = None):
        """A memory map: Parquet decodes straight from the page cache, on several threads (a
        Python file object would hold the GIL on every read).  A file deleted while mapped stays
        readable through the map."""
        import pyarrow as pa

        try:
            return pa.memory_map(self._path(name))
        except FileNotFoundError:
            raise ObjectNotFound(f"tier object {name!r} not found under {self.root}") from None

    def read_whole(self, name: str):
        """The memory map of ``open_input``: a whole-object read first copied each object into a
        fresh buffer, which took several times as long as reading it mapped."""
        return self.open_input(name)

    def size(self, name: str) -> int:
        try:
            return os.stat(self._path(name)).st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"tier object {name!r} not found under {self.root}") from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = os.path.join(self.root, os.path.dirname(prefix))
        found = []
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = os.path.relpath(dirpath, self.root)
            for f in files:
                if f.startswith(_TMP_PREFIX):
                    continue
                name = f if rel_dir == "." else f"{rel_dir}/{f}"
                if name.startswith(prefix):
                    found.append(name)
        for name in sorted(found):
            try:
                yield ObjectInfo(name, os.stat(os.path.join(self.root, name)).st_size)
            except FileNotFoundError:
                continue  # deleted while listing

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
