"""The KV view: the latest value of every (topic, key), in RocksDB (rocksdict).

It is fed by the change stream of the compaction query: one change per
changed key per batch, a put (the latest body) or a delete.  Contract:

* **Latest wins by physical offset.**  A change is applied only if it is newer
  (higher physical offset) than what the view holds for that key, so a
  replayed or late change can never move a key backwards.
* **Deletes leave a tombstone** holding the delete's physical offset, so an
  older put replayed later cannot bring the key back.  ``get`` and ``scan``
  never return tombstones.
* **Applying a batch is idempotent and atomic**: all of its changes, and the
  physical offset the view has applied through, are one synced WriteBatch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

from rocksdict import WriteBatch

from connectors.errors import TierlogError
from state import rocks

SEP = "\x00"
_HEAD = struct.Struct(">qiqqB")  # phy_offset, queue_id, queue_offset, store_ts (ms), tombstone
_APPLIED = "\x01applied"  # sorts apart from every "topic\x00key"


class KVError(TierlogError):
    """The KV view cannot be opened or was given a malformed change."""


@dataclass(frozen=True)
class Entry:
    """The latest value of one key, with where it came from."""

    topic: str
    key: str
    body: bytes
    phy_offset: int
    queue_id: int
    queue_offset: int
    store_ts: int  # epoch milliseconds


@dataclass(frozen=True)
class Change:
    """One changed key: ``op`` is ``put`` or ``delete``."""

    topic: str
    key: str
    op: str
    phy_offset: int
    queue_id: int = 0
    queue_offset: int = 0
    store_ts: int = 0
    body: bytes = b""


def _dbkey(topic: str, key: str) -> str:
    if SEP in topic:
        raise KVError(f"topic {topic!r} contains NUL, which the KV view uses as a separator")
    return f"{topic}{SEP}{key}"


def _encode(c: Change) -> bytes:
    tomb = c.op == "delete"
    return _HEAD.pack(c.phy_offset, c.queue_id, c.queue_offset, c.store_ts, int(tomb)) + (b"" if tomb else c.body)


def _decode(dbkey: str, raw: bytes) -> Entry | None:
    phy, queue_id, queue_offset, store_ts, tomb = _HEAD.unpack_from(raw)
    if tomb:
        return None
    topic, _, key = dbkey.partition(SEP)
    return Entry(topic, key, bytes(raw[_HEAD.size :]), phy, queue_id, queue_offset, store_ts)


class KVView:
    """Open with ``read_only=True`` to query while the service writes (``tierlog kv get``)."""

    def __init__(self, path: str, *, read_only: bool = False):
        self.path = path
        self.read_only = read_only
        if read_only and not rocks.exists(path):
            raise KVError(f"no KV view at {path}: has the compaction query run with this config?")
        try:
            self.db = rocks.open_rdict(path, read_only=read_only, raw_mode=True)
        except Exception as exc:  # rocksdict raises a plain Exception carrying RocksDB's message
            raise KVError(f"cannot open the KV view at {path}: {exc}") from None
        self._sync = rocks.synced_writes()

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "KVView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ writing

    def apply(self, changes: Iterable[Change], applied_through: int | None = None) -> int:
        """Apply newer changes in one synced WriteBatch; returns how many took effect.

        ``applied_through`` (a physical offset) is recorded in the same batch.
        """
        if self.read_only:
            raise KVError("the KV view was opened read-only")
        latest: dict[str, Change] = {}
        for c in changes:
            if c.op not in ("put", "delete"):
                raise KVError(f"change for key {c.key!r} at physical offset {c.phy_offset}: unknown op {c.op!r}")
            k = _dbkey(c.topic, c.key)
            if k not in latest or latest[k].phy_offset < c.phy_offset:
                latest[k] = c
        wb = WriteBatch(raw_mode=True)
        applied = 0
        for k, c in latest.items():
            current = self.db.get(k.encode())
            if current is not None and _HEAD.unpack_from(current)[0] >= c.phy_offset:
                continue  # what the view holds is as new or newer: a replay or a late change
            wb.put(k.encode(), _encode(c))
            applied += 1
        if applied_through is not None:
            wb.put(_APPLIED.encode(), struct.pack(">q", max(applied_through, self.applied_through() or -1)))
        self.db.write(wb, self._sync)
        return applied

    # ------------------------------------------------------------ reading

    def applied_through(self) -> int | None:
        raw = self.db.get(_APPLIED.encode())
        return None if raw is None else struct.unpack(">q", raw)[0]

    def get(self, topic: str, key: str) -> Entry | None:
        k = _dbkey(topic, key)
        raw = self.db.get(k.encode())
        return None if raw is None else _decode(k, raw)

    def multi_get(self, topic: str, keys: list[str]) -> dict[str, Entry | None]:
        return {key: self.get(topic, key) for key in keys}

    def scan(self, topic: str, prefix: str = "") -> Iterator[Entry]:
        """Live entries of ``topic`` whose key starts with ``prefix``, in key (byte) order."""
        start = _dbkey(topic, prefix).encode()
        for raw_key, raw in self.db.items(from_key=start):
            if not raw_key.startswith(start):
                break
            entry = _decode(raw_key.decode(), raw)
            if entry is not None:
                yield entry
