"""Local copies of the staging objects just uploaded, for the tier's consumers to read back.

Why: the compaction query and the mirror read every committed batch back from the tier
(``connectors.tier.feed``), a moment after the stager uploaded it.  On S3 that was two GETs per
staging object for compaction (its Spark partition, then the changed keys' bodies) and one per
sender slot for the mirror, all for bytes the stager had in memory.  The stager keeps them on the
service's local disk instead, and those reads cost no request.  A directory tier is already local:
it is never wrapped.

Contract: a copy is only ever a shortcut.  When one is present it holds the bytes of the object
of that name as last uploaded: the old copy goes before an object is replaced, and the new one
appears (a rename) only after the upload succeeded.  When one is missing (evicted by the byte
bound, written on another host, a crash between upload and copy, a full local disk), the read
goes to the tier; so no bound, crash or error here changes what a reader gets.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from connectors.tier.backend import Backend, ObjectInfo
from connectors.tier.layout import STAGING_PREFIX

log = logging.getLogger("tierlog.tier")
STALE_TMP_S = 600.0  # a copy being written is seconds old; one this old was left by a crash


@dataclass(frozen=True)
class CopySettings:
    """Where the copies live (``tier.local_copy_bytes`` of them at most, oldest out first)."""

    directory: str
    max_bytes: int


class LocalCopies(Backend):
    """``inner``, with a local copy of every staging object put through it (see the module)."""

    def __init__(self, inner: Backend, settings: CopySettings):
        self.inner = inner
        self.location = inner.location
        self.max_bytes = settings.max_bytes
        # One directory per tier location, so two tiers (a test's, a second service's) never share names.
        digest = hashlib.sha256(inner.location.encode()).hexdigest()[:16]
        self.directory = os.path.join(settings.directory, digest)

    def _path(self, name: str) -> str | None:
        if not name.startswith(STAGING_PREFIX):
            return None
        return os.path.join(self.directory, name[len(STAGING_PREFIX):].replace("/", "%"))

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        if path is not None:
            _remove(path)  # before the upload: a stale copy must never outlive the object it copied
        self.inner.put(name, data)
        if path is not None:
            self._keep(path, data)

    def _keep(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:  # the disk the copies share is full, say: the tier has the object
            _remove(tmp)
            log.warning("no local copy of a staging object (%s: %s); its consumers read it from the tier",
                        path, exc.strerror)
            return
        self._trim()

    def _trim(self) -> None:
        """Oldest copies out until the rest fit in ``max_bytes``; a copy a crash left half-written goes too."""
        try:
            entries = list(os.scandir(self.directory))
            held = [(e.stat().st_mtime_ns, e.stat().st_size, e.path) for e in entries if ".tmp-" not in e.name]
            stale = [e.path for e in entries if ".tmp-" in e.name and time.time() - e.stat().st_mtime > STALE_TMP_S]
        except OSError:
            return  # another process trimmed at the same time
        for path in stale:
            _remove(path)
        total = sum(size for _, size, _ in held)
        for _, size, path in sorted(held):
            if total <= self.max_bytes:
                break
            _remove(path)
            total -= size

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        path = self._path(name)
        if path is not None:
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    return f.read() if length is None else f.read(length)
            except OSError:
                pass  # evicted, or never made here: the tier has it
        return self.inner.read(name, start, length)

    def delete(self, name: str) -> None:
        path = self._path(name)
        if path is not None:
            _remove(path)
        self.inner.delete(name)

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def open_input(self, name: str, size: int | None = None):
        path = self._path(name)
        if path is not None:
            try:
                return open(path, "rb")  # sealing reads a queue's row groups of it: no ranged GETs either
            except OSError:
                pass
        return self.inner.open_input(name, size)

    def read_whole(self, name: str):
        path = self._path(name)
        if path is not None:
            import pyarrow as pa

            try:
                return pa.memory_map(path)  # as the posix backend's: read in place, a file deleted meanwhile stays readable
            except OSError:
                pass
        return self.inner.read_whole(name)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, attr):  # what one backend adds (S3's bucket check, say)
        return getattr(self.inner, attr)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
