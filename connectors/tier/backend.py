"""The storage backend interface: the few operations a tier needs from a store.

Like RocketMQ tieredstore's ``FileSegmentProvider``, backends differ only in
I/O.  Names are ``/``-separated paths relative to the tier root; a backend
never lets a name escape that root.  ``put`` is atomic: readers see the whole
new object or none of it, never a part.  ``connectors.tier.location.open_backend`` picks the
backend a location names; ``connectors.tier.retry`` is how the backends wait out a store that is away.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

from connectors.tier.errors import InvalidObjectName

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
