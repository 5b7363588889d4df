"""The storage backend interface: the few operations a tier needs from a store.

Like RocketMQ tieredstore's ``FileSegmentProvider``, backends differ only in
I/O.  Names are ``/``-separated paths relative to the tier root; a backend
never lets a name escape that root.  ``put`` is atomic: readers see the whole
new object or none of it, never a part.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from connectors.errors import StopRequested
from connectors.tier.errors import InvalidObjectName

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_DEADLINE_S = 600.0  # how long a backend keeps retrying a transient failure before it gives up

_SEGMENT = re.compile("^[A-Za-z0-9._=%+\\-\u00a0-\U0010ffff]+$")  # escaped topics keep characters above U+009F


def check_name(name: str, *, max_part_bytes: int | None = None, max_bytes: int | None = None,
               where: str = "this store") -> str:
    """Refuse names that are absolute, climb out with ``..``, hold characters a store may mangle,
    or are longer (per ``/``-separated part, or whole, in UTF-8 bytes) than the store can hold."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") or not _SEGMENT.match(p) for p in parts):
        raise InvalidObjectName(f"object name {name!r} is not a plain relative path inside the tier")
    # A RocketMQ retry or dead-letter topic may have 255 characters; escaped, '%' takes three.
    if max_part_bytes is not None:
        size, longest = max((len(p.encode()), p) for p in parts)
        if size > max_part_bytes:
            raise InvalidObjectName(
                f"object name {name!r}: its part {longest[:60]!r}... is {size} bytes, more than the "
                f"{max_part_bytes} a file name in {where} can hold; a topic this long needs an S3 tier "
                "(keys of up to 1024 bytes) or a file system with longer names"
            )
    if max_bytes is not None and len(name.encode()) > max_bytes:
        raise InvalidObjectName(f"object name {name!r} is {len(name.encode())} bytes, more than the {max_bytes} "
                                f"{where} can hold; use a shorter tier.location prefix")
    return name


# Set when the service was asked to stop (SIGTERM, Ctrl-C): a retry gives up at its next wait,
# raising StopRequested, instead of waiting out its deadline with the stop held behind it.  What it
# was writing belongs to a batch not committed yet, which the next start runs again.  In the
# driver an event; Spark's Python workers, other processes, see a file the service names in
# TIERLOG_STOP_FILE (set before Spark starts, so they inherit it) and creates on the stop.
_STOPPING = threading.Event()
STOP_FILE = "TIERLOG_STOP_FILE"


def request_stop() -> None:
    _STOPPING.set()
    path = os.environ.get(STOP_FILE)
    if path:
        open(path, "w").close()


def clear_stop() -> None:
    _STOPPING.clear()
    path = os.environ.get(STOP_FILE)
    if path and os.path.exists(path):
        os.remove(path)


def _stop_requested(wait_s: float = 0.0) -> bool:
    """Whether a stop was requested, waiting up to ``wait_s`` for one."""
    deadline = time.monotonic() + wait_s
    path = os.environ.get(STOP_FILE)
    while True:
        if _STOPPING.is_set() or (path and os.path.exists(path)):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        _STOPPING.wait(min(0.2, left))


def retry_transient(call: Callable[[], T], deadline_s: float = RETRY_DEADLINE_S) -> T:
    """``call()``, again after each retriable ``TierError`` (S3 throttling, a 5xx, a timeout, a full
    disk) with jittered exponential backoff, until ``deadline_s`` has passed, or until a stop is
    requested (``request_stop``: ``StopRequested``).

    Each retry is a warning in the log, so an operator sees why tiering waits.
    A store that is down for a while delays tiering instead of failing it.
    """
    deadline = time.monotonic() + deadline_s
    attempt = 0
    while True:
        try:
            return call()
        except InvalidObjectName:
            raise
        except Exception as exc:
            attempt += 1
            if not getattr(exc, "retriable", False) or time.monotonic() >= deadline:
                raise
            if _stop_requested():
                raise StopRequested(f"stop requested while retrying: {exc}") from None
            delay = min(30.0, 0.1 * 2**attempt) * (0.5 + random.random() / 2)
            log.warning("%s; retrying in %.1fs (attempt %d)", exc, delay, attempt)
            if _stop_requested(delay):
                raise StopRequested(f"stop requested while retrying: {exc}") from None


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int


class Backend(ABC):
    """Where tier objects live.  Implementations: ``PosixBackend``, ``S3Backend``."""

    location: str

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name``, replacing any object of that name, atomically and durably."""

    @abstractmethod
    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[start, start + length)`` of ``name`` (to the end when ``length`` is None)."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes; raises ``ObjectNotFound``."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose names start with ``prefix``, in name order."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; removing a missing object is not an error."""

    def open_input(self, name: str, size: int | None = None):
        """A seekable, read-only file over ``name`` for Parquet readers: they fetch only the footer and
        the row groups they need.  This default makes ranged ``read`` calls; a backend with a
        faster native path (a memory map) overrides it."""
        import io

        from connectors.tier.layout import ObjectFile

        return io.BufferedReader(ObjectFile(self, name, size), buffer_size=256 << 10)

    def read_whole(self, name: str):
        """All of ``name`` as a pyarrow file, for a reader that wants most of it: one ``read`` (one
        GET on S3).  A backend that can read it in place (a memory map) overrides this."""
        import pyarrow as pa

        return pa.BufferReader(self.read(name))

    def exists(self, name: str) -> bool:
        from connectors.tier.errors import ObjectNotFound

        try:
            self.size(name)
            return True
        except ObjectNotFound:
            return False

    def close(self) -> None:
        """Release connections; the backend must not be used afterwards."""


def open_backend(location: str, *, create: bool = True, copies=None) -> Backend:
    """A backend for ``location``: ``s3://bucket/prefix`` or a directory path; ``create=False``
    (readers) never makes the directory; ``copies`` (a ``connectors.tier.copies.CopySettings``):
    keep local copies of the staging objects an S3 tier's consumers read back."""
    if location.startswith("s3://"):
        from connectors.tier.s3 import S3Backend

        if copies is not None and copies.max_bytes > 0:
            from connectors.tier.copies import LocalCopies

            return LocalCopies(S3Backend(location), copies)
        return S3Backend(location)
    from connectors.tier.posix import PosixBackend

    return PosixBackend(location, create=create)
