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
  physical offset the view has applied through, are one WriteBatch, durable before
  ``apply`` returns.
* **A large value may be a reference** (``apply_table``'s ``referenced``): the view then keeps only
  where the message is (its queue, queue offset and physical offset, as for every value) and reads
  the body back from the tier it was opened with (``tier``, recorded in the view) whenever a value
  is read: ``get``, ``scan`` and the rest return whole values either way (``state.kv_refs``).
* **Time to live** (optional, per topic): a key whose latest put is older
  than its topic's TTL (by store time, against the wall clock) is expired by
  ``expire``, which writes a tombstone at that put's physical offset and
  returns the delete changes.  An expiry's tombstone is marked as one, and as
  not yet sent when no changelog took it (``unsent_expiries``).  An index
  ordered by expiry time keeps the sweep proportional to what expires, not to
  the number of keys; an update leaves its old index entry behind, to be
  dropped by the sweep that reaches it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rocksdict import WriteBatch

from connectors.changes import CHANGE_ROW
from connectors.commitlog.arrow import epoch_ms_array
from connectors.errors import TierlogError
from state import rocks

SEP = "\x00"
_HEAD = struct.Struct(">qiqqB")  # phy_offset, queue_id, queue_offset, store_ts (ms), tombstone
# The tombstone byte: 0 a live value, 1 a delete's tombstone, 2 an expiry's (at the expired put's
# offset), 3 an expiry's that no changelog has sent yet, 4 a live value kept in the tier (the head
# alone: its body is the message at the head's queue offset).  Views written before expiries were
# marked hold 1 for every tombstone.
_DELETED, _EXPIRED, _EXPIRED_UNSENT, _REFERENCED = 1, 2, 3, 4
_HEAD_DTYPE = np.dtype([("phy", ">i8"), ("queue_id", ">i4"), ("queue_offset", ">i8"), ("store_ts", ">i8"),
                        ("tombstone", "u1")])  # _HEAD as a packed numpy record, for whole batches
assert _HEAD_DTYPE.itemsize == _HEAD.size
_ROW_TYPES = (pa.string(), pa.string(), pa.int64(), pa.int32(), pa.int64(), pa.int64(), pa.bool_(), pa.binary())
# Bookkeeping keys start with \x01 and the TTL index with \x02; both sort before every
# "topic\x00key", because topics may not start with a control character.
_APPLIED = b"\x01applied"
_TTL_CONF = b"\x01ttl"
_UNSENT = b"\x01unsent_expiries"  # present while a tombstone is marked _EXPIRED_UNSENT
_REFS = b"\x01refs\x00"  # then a topic: the view holds references into the tier for that topic's values
_TTL_INDEX = b"\x02"
_EXPIRY = struct.Struct(">q")
_DATA_START = b"\x03"
# Why larger values live in RocksDB's blob files: a changed value is written once at flush either
# way (and, before ``_write`` dropped the WAL, once more to it), but in the LSM tree every
# compaction rewrote it again.  ``bench/bench_kv_apply.py`` found blob files cheaper for values of
# 2 KB and more and no gain at 1 KiB, hence the bound between; point reads stayed fast, and only a
# full scan, which only a snapshot does, was slower (docs/benchmarks.md).
BLOB_MIN_BYTES = 1536


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
    if not topic or topic[0] < "\x03":
        raise KVError(f"topic {topic!r} is empty or starts with a control character")
    return f"{topic}{SEP}{key}"


def _value(phy: int, queue_id: int, queue_offset: int, store_ts: int, deleted: bool, body: bytes | None,
           tombstone: int | None = None) -> bytes:
    """A stored value: the head, then the body (a tombstone has none); ``tombstone`` marks one
    other than a delete's."""
    tomb = tombstone if tombstone is not None else _DELETED if deleted else 0
    head = _HEAD.pack(phy, queue_id, queue_offset, store_ts, tomb)
    return head if tomb else head + (body or b"")


def _ttl_key(expiry_ms: int, dbkey: bytes) -> bytes:
    """The TTL index entry of ``dbkey``: ordered by expiry time."""
    return _TTL_INDEX + _EXPIRY.pack(expiry_ms) + dbkey


def _ttl_ms(ttl: dict[str, float] | None, topic: str) -> int | None:
    if not ttl:
        return None
    seconds = ttl.get(topic, ttl.get("*"))
    return None if seconds is None else int(seconds * 1000)


def _decode(dbkey: str, raw: bytes) -> Entry | None:
    """The live entry ``raw`` holds (None for a tombstone); a referenced value's body is None here,
    read from the tier by ``KVView.values_of``."""
    phy, queue_id, queue_offset, store_ts, tomb = _HEAD.unpack_from(raw)
    if tomb and tomb != _REFERENCED:
        return None
    topic, _, key = dbkey.partition(SEP)
    body = None if tomb == _REFERENCED else bytes(raw[_HEAD.size :])
    return Entry(topic, key, body, phy, queue_id, queue_offset, store_ts)


FILL_CHUNK = 4096  # referenced values read from the tier at a time by a walk of the view (scan, entries)


def _chunks(items: Iterable, most: int) -> Iterator[list]:
    """``items`` in lists of 16, then 4 times as many each time up to ``most``: a walk that stops
    early (``kv scan --limit 5``) reads few referenced values, a long one reads them in bulk."""
    chunk, size = [], min(16, most)
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk, size = [], min(most, size * 4)
    if chunk:
        yield chunk


def _latest_per_key(table: pa.Table) -> tuple[np.ndarray, list[bytes]]:
    """The row of each key's highest physical offset (the first of equal ones: the sort is
    stable), and the keys, in byte order (a batch handed to the view may hold a key more than once:
    docs/architecture.md, "Latest per key, four times"): RocksDB inserts a sorted batch into its memtable several
    times faster."""
    keys = pc.cast(pc.binary_join_element_wise(table.column("topic"), table.column("key"), SEP), pa.binary())
    order = pc.sort_indices(pa.table({"k": keys, "phy": table.column("phy_offset")}),
                            [("k", "ascending"), ("phy", "descending")])
    sorted_keys = keys.take(order)
    first = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        first[1:] = pc.not_equal(sorted_keys[1:], sorted_keys[:-1]).to_numpy(zero_copy_only=False)
    return order.to_numpy()[first], sorted_keys.filter(pa.array(first)).to_pylist()


def _values(table: pa.Table, picked: np.ndarray, referenced: np.ndarray | None = None
            ) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """The stored values of rows ``picked`` (``_value`` for a whole batch), in that order, with
    their store times (epoch ms) and whether each is a delete; of the rows ``referenced`` (a mask
    over the table's rows) only the head, marked as a reference.

    Why chunk by chunk: a batch's bodies are hundreds of MB, left by the reader in its row groups
    (``records_as_stored``).  Taking them in key order joined every chunk into one buffer first,
    then copied them again, in fresh memory each time.  Here each chunk's picked bodies are joined
    to their heads once and made bytes, and only the references are put in key order."""
    deleted = table.column("deleted").take(picked).to_numpy(zero_copy_only=False).astype(bool)
    refs = np.zeros(len(picked), dtype=bool) if referenced is None else referenced[picked] & ~deleted
    store_ts = epoch_ms_array(table.column("store_ts").take(picked)).to_numpy()
    heads = np.empty(len(picked), dtype=_HEAD_DTYPE)
    heads["phy"] = table.column("phy_offset").take(picked).to_numpy()
    heads["queue_id"] = table.column("queue_id").take(picked).to_numpy()
    heads["queue_offset"] = table.column("queue_offset").take(picked).to_numpy()
    heads["store_ts"] = store_ts
    heads["tombstone"] = np.where(deleted, _DELETED, np.where(refs, _REFERENCED, 0))
    slot = np.full(table.num_rows, -1, np.int64)  # where each row's value goes; -1: not picked or no body
    headless = deleted | refs  # a tombstone or a reference keeps no body
    slot[picked[~headless]] = np.flatnonzero(~headless)
    values: list[bytes] = [b""] * len(picked)
    start = 0
    for body in table.column("body").chunks:
        to = slot[start : start + len(body)]
        start += len(body)
        mine = to >= 0
        if not mine.all():
            body, to = body.filter(pa.array(mine)), to[mine]
        if not len(to):
            continue
        head = pa.FixedSizeBinaryArray.from_buffers(pa.binary(_HEAD.size), len(to),
                                                    [None, pa.py_buffer(heads[to].tobytes())])
        empty = pa.scalar(b"", body.type)  # a null body is an empty one
        joined = pc.binary_join_element_wise(head.cast(body.type), body, empty, null_handling="replace",
                                             null_replacement=b"")
        for i, value in zip(to.tolist(), joined.to_pylist()):
            values[i] = value
    if headless.any():
        raw, size = heads.tobytes(), _HEAD.size
        for i in np.flatnonzero(headless).tolist():
            values[i] = raw[i * size : (i + 1) * size]
    return values, store_ts, deleted


class KVView:
    """Open with ``read_only=True`` to query while the service writes (``tierlog kv get``).

    ``ttl`` maps topics (``*`` for every other topic) to seconds; keys of
    topics without one never expire.  Changing it re-indexes the view once.
    ``blob_min_bytes``: values of that size or more are written to blob files (0: none are).
    ``durable``: when a write is on disk (``_write``): ``"flush"`` (the default) before it returns,
    by a memtable flush; ``"wal"`` before it returns, through RocksDB's WAL, synced; ``"close"`` once
    the view is closed, for a view built from scratch that a crash throws away (``tierlog kv rebuild``).
    ``tier`` and ``broker``: where the values the view keeps as references are read (a tier
    location; the broker whose messages they are).  A writable view records them; a view opened
    without them reads from the tier it recorded.
    """

    def __init__(self, path: str, *, read_only: bool = False, ttl: dict[str, float] | None = None,
                 blob_min_bytes: int = BLOB_MIN_BYTES, durable: str = "flush", tier: str | None = None,
                 broker: str | None = None):
        if durable not in ("flush", "wal", "close"):  # before anything is opened or made on disk
            raise ValueError(f"durable: {durable!r} is none of flush, wal, close")
        self.path = path
        self.read_only = read_only
        self.ttl = dict(ttl or {})
        if read_only and not rocks.exists(path):
            raise KVError(f"no KV view at {path}: has the compaction query run with this config?")
        try:
            self.db = rocks.open_rdict(path, read_only=read_only, raw_mode=True, blob_min_bytes=blob_min_bytes)
        except Exception as exc:  # rocksdict raises a plain Exception carrying RocksDB's message
            raise KVError(f"cannot open the KV view at {path}: {exc}") from None
        self._durable = durable
        self._options = rocks.synced_writes() if durable == "wal" else rocks.unlogged_writes()
        self._tier_values = None  # state.kv_refs.TierValues, opened at the first referenced value read
        self._tier = self._recorded_tier(tier, broker)
        self._ref_topics = {bytes(k[len(_REFS):]).decode() for k in self._keys_from(_REFS)}
        if not read_only:
            self._reindex_if_ttl_changed()

    def close(self) -> None:
        if self._tier_values is not None:
            self._tier_values.close()
        if self._durable == "close" and not self.read_only:
            self.db.flush(wait=True)
        self.db.close()

    def _keys_from(self, prefix: bytes) -> list[bytes]:
        out = []
        for raw_key in self.db.keys(from_key=prefix):
            if not raw_key.startswith(prefix):
                break
            out.append(raw_key)
        return out

    def _recorded_tier(self, tier: str | None, broker: str | None) -> dict | None:
        """Where referenced values are read: the ``tier`` given (recorded by a writable view when it
        differs from what the view recorded), else the one recorded."""
        raw = self.meta("tier")
        recorded = json.loads(raw) if raw else None
        if tier is None:
            return recorded
        given = {"location": tier if "://" in tier else os.path.abspath(tier), "broker": broker}
        if given != recorded and not self.read_only:
            self.put_meta("tier", json.dumps(given))
        return given

    def _write(self, wb: WriteBatch) -> None:
        """Write ``wb`` as ``durable`` says: by default into the memtable, which is then flushed (its
        SST and blob files synced) before this returns.

        Why no WAL: every value went to disk twice, once into the WAL and once more when its
        memtable was flushed.  A flush after each write keeps the view's contract (a batch and the
        offset applied through are durable at once, or not at all) and needs no replay: a crash
        before the flush loses the whole batch, which the tier keeps until it is applied.  So
        ``tierlog kv get`` reads every applied batch from the files, as before from the WAL.
        It costs less CPU than the WAL did (``bench/bench_kv_apply.py``, docs/benchmarks.md), the
        flush now on the apply thread.  A rebuild (``"close"``) flushes only at the end: it applies
        a queue at a time, and a flush per small apply was most of its time."""
        self.db.write(wb, self._options)
        if self._durable == "flush":
            self.db.flush(wait=True)

    def __enter__(self) -> "KVView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ writing

    def apply(self, changes: Iterable[Change], applied_through: int | None = None) -> int:
        """Apply newer changes in one durable WriteBatch (``_write``); returns how many took effect.

        ``applied_through`` (a physical offset) is recorded in the same batch.
        """
        rows = []
        for c in changes:
            if c.op not in ("put", "delete"):
                raise KVError(f"change for key {c.key!r} at physical offset {c.phy_offset}: unknown op {c.op!r}")
            rows.append((c.topic, c.key, c.phy_offset, c.queue_id, c.queue_offset, c.store_ts, c.op == "delete", c.body))
        table = pa.table([pa.array(col, t) for col, t in zip(zip(*rows), _ROW_TYPES)] if rows else
                         [pa.array([], t) for t in _ROW_TYPES], names=list(CHANGE_ROW))
        return self._apply(table, applied_through)

    def apply_table(self, table, applied_through: int | None = None, referenced=None) -> int:
        """``apply`` for an Arrow table of ``CHANGE_ROW`` columns (``connectors.changes``;
        store_ts a timestamp or epoch ms); the rows ``referenced`` marks (a boolean array, or None:
        none) are kept as references into the view's tier, their bodies not stored (nor needed)."""
        mask = None if referenced is None else np.asarray(referenced, dtype=bool)
        if mask is not None and mask.any() and self._tier is None:
            raise KVError(f"the KV view at {self.path} was opened without its tier: it cannot keep values there")
        return self._apply(table, applied_through, mask if mask is not None and mask.any() else None)

    def _apply(self, table: pa.Table, applied_through: int | None, referenced: np.ndarray | None = None) -> int:
        """Why columnar: the compaction query hands over 100k changes a batch, and the same work row
        by row in Python (a dict of latest rows, a struct per value) took twice the apply thread's
        time, competing with Spark's own job for the driver's cores; half of it now is RocksDB's write.  Checked against an oracle by
        ``tests/test_kv_view.py::test_random_batches_in_any_order_equal_the_oracle``."""
        if self.read_only:
            raise KVError("the KV view was opened read-only")
        for name in CHANGE_ROW[:-1]:  # a null body is an empty one
            if table.column(name).null_count:
                raise KVError(f"a change has no {name}: the KV view needs every field but the body")
        for topic in pc.unique(table.column("topic")).to_pylist():
            _dbkey(topic, "")
        floor = self.applied_through()
        picked, keys = _latest_per_key(table)
        picked, keys = self._newer_than_held(table, picked, keys, floor)
        values, store_ts, deleted = _values(table, picked, referenced)
        wb = WriteBatch(raw_mode=True)
        new_refs = set() if referenced is None else \
            set(table.column("topic").filter(pa.array(referenced)).unique().to_pylist()) - self._ref_topics
        for topic in new_refs:  # the topics the view now keeps values of in the tier, with their first one
            wb.put(_REFS + topic.encode(), b"")
        for k, v in zip(keys, values):
            wb.put(k, v)
        if self.ttl:
            self._index_ttl(wb, keys, table.column("topic").take(picked).to_pylist(), store_ts, deleted)
        if applied_through is not None:
            wb.put(_APPLIED, struct.pack(">q", max(applied_through, floor if floor is not None else -1)))
        self._write(wb)
        self._ref_topics |= new_refs
        return len(keys)

    def referenced_topics(self) -> set[str]:
        """The topics some of whose values the view keeps in the tier (or did, until ``take_inline``)."""
        return set(self._ref_topics)

    def take_inline(self, topic: str, progress: Callable[[str], None] | None = None) -> int:
        """Read every value of ``topic`` the view keeps in the tier and keep it in the view instead
        (before the tier's retention may drop its segments); returns how many.  Each chunk is one
        durable WriteBatch; a key changed meanwhile is a write of the same value, never an older one."""
        if self.read_only:
            raise KVError("the KV view was opened read-only")
        start, moved = _dbkey(topic, "").encode(), 0
        chunk: list[tuple[bytes, bytes]] = []

        def write(chunk) -> None:
            entries = self.values_of([_decode(k.decode(), raw) for k, raw in chunk])
            wb = WriteBatch(raw_mode=True)
            for (k, raw), e in zip(chunk, entries):
                wb.put(k, _value(e.phy_offset, e.queue_id, e.queue_offset, e.store_ts, False, e.body))
            self._write(wb)

        for raw_key, raw in self.db.items(from_key=start):
            if not raw_key.startswith(start):
                break
            if _HEAD.unpack_from(raw)[4] == _REFERENCED:
                chunk.append((raw_key, raw))
                if len(chunk) == FILL_CHUNK:
                    write(chunk)
                    moved += len(chunk)
                    chunk = []
                    if progress:
                        progress(f"{moved} value(s) of topic {topic} read from the tier into the KV view so far")
        if chunk:
            write(chunk)
            moved += len(chunk)
        wb = WriteBatch(raw_mode=True)
        wb.delete(_REFS + topic.encode())
        self._write(wb)
        self._ref_topics.discard(topic)
        return moved

    def values_of(self, entries: list[Entry | None]) -> list[Entry | None]:
        """``entries`` with the body of every value the view keeps in the tier read from there
        (``entries(bodies=False)`` leaves them None)."""
        missing = [i for i, e in enumerate(entries) if e is not None and e.body is None]
        if not missing:
            return entries
        if self._tier_values is None:
            if self._tier is None:
                raise KVError(f"the KV view at {self.path} keeps the value of key {entries[missing[0]].key!r} in "
                              "a tier it has no record of: open it with its tier (KVView(..., tier=, broker=))")
            from state.kv_refs import TierValues

            self._tier_values = TierValues(self._tier["location"], self._tier["broker"])
        got = self._tier_values.bodies([entries[i].topic for i in missing], [entries[i].key for i in missing],
                                       [(entries[i].phy_offset, entries[i].queue_id, entries[i].queue_offset)
                                        for i in missing])
        out = list(entries)
        for i, body in zip(missing, got):
            out[i] = dataclasses.replace(entries[i], body=body)
        return out

    def _newer_than_held(self, table: pa.Table, picked: np.ndarray, keys: list[bytes],
                         floor: int | None) -> tuple[np.ndarray, list[bytes]]:
        """The rows newer than what the view holds for their keys.  The view only ever holds
        values from below its applied offset (``floor``), so a row at or above it needs no read;
        only rows below it (a replay, a rebuild) are checked against the view."""
        phy = table.column("phy_offset").take(picked).to_numpy()
        maybe_older = np.arange(len(picked)) if floor is None else np.flatnonzero(phy < floor)
        if not len(maybe_older):
            return picked, keys
        keep = np.ones(len(picked), dtype=bool)
        for i, old in zip(maybe_older, self.db.get([keys[i] for i in maybe_older])):
            # What the view holds is as new or newer: a replay or a late change.
            keep[i] = old is None or _HEAD.unpack_from(old)[0] < phy[i]
        return picked[keep], [k for k, kept in zip(keys, keep) if kept]

    def _index_ttl(self, wb: WriteBatch, keys: list[bytes], topics: list[str], store_ts, deleted) -> None:
        ttl = {topic: _ttl_ms(self.ttl, topic) for topic in set(topics)}
        entries = [_ttl_key(int(ts) + ttl[topic], k) for k, topic, ts, gone in zip(keys, topics, store_ts, deleted)
                   if not gone and ttl[topic] is not None]
        # The entry for an older value stays behind; expire() skips entries that no longer match.
        for entry in sorted(entries):
            wb.put(entry, b"")

    # ------------------------------------------------------------ time to live

    def _reindex_if_ttl_changed(self) -> None:
        wanted = json.dumps(self.ttl, sort_keys=True).encode()
        if (self.db.get(_TTL_CONF) or b"{}") == wanted:
            return
        wb = WriteBatch(raw_mode=True)
        for raw_key, _ in self.db.items(from_key=_TTL_INDEX):
            if not raw_key.startswith(_TTL_INDEX):
                break
            wb.delete(raw_key)
        for raw_key, raw in self.db.items(from_key=_DATA_START):
            entry = _decode(raw_key.decode(), raw)
            ttl = None if entry is None else _ttl_ms(self.ttl, entry.topic)
            if ttl is not None:
                wb.put(_ttl_key(entry.store_ts + ttl, raw_key), b"")
        wb.put(_TTL_CONF, wanted)
        self._write(wb)

    def expire(self, now_ms: int, before_write: Callable[[list[Change]], None] | None = None) -> list[Change]:
        """Expire every key whose TTL has passed at ``now_ms``; returns the delete changes written.

        ``before_write`` sees the changes before they are written (the changelog sends
        its tombstones there); if it raises, nothing is expired.  Without it, the tombstones are
        marked unsent, for a changelog turned on later (``unsent_expiries``).
        """
        if self.read_only:
            raise KVError("the KV view was opened read-only")
        wb = WriteBatch(raw_mode=True)
        out = []
        for raw_key, _ in self.db.items(from_key=_TTL_INDEX):
            if not raw_key.startswith(_TTL_INDEX):
                break
            expiry = _EXPIRY.unpack_from(raw_key, len(_TTL_INDEX))[0]
            if expiry > now_ms:
                break
            wb.delete(raw_key)
            k = raw_key[len(_TTL_INDEX) + _EXPIRY.size :]
            raw = self.db.get(k)
            entry = None if raw is None else _decode(k.decode(), raw)
            if entry is None or entry.store_ts + (_ttl_ms(self.ttl, entry.topic) or 0) != expiry:
                continue  # deleted or updated since: the index entry is stale
            gone = Change(entry.topic, entry.key, "delete", entry.phy_offset, entry.queue_id,
                          entry.queue_offset, entry.store_ts)
            mark = _EXPIRED if before_write is not None else _EXPIRED_UNSENT
            wb.put(k, _value(gone.phy_offset, gone.queue_id, gone.queue_offset, gone.store_ts, True, None, mark))
            if mark == _EXPIRED_UNSENT:
                wb.put(_UNSENT, b"")
            out.append(gone)
        if out and before_write is not None:
            before_write(out)
        if len(wb):
            self._write(wb)
        return out

    # ------------------------------------------------------------ reading

    def meta(self, name: str) -> str | None:
        """A bookkeeping value the service keeps beside the data (e.g. when it last snapshotted)."""
        raw = self.db.get(b"\x01meta:" + name.encode())
        return None if raw is None else raw.decode()

    def put_meta(self, name: str, value: str) -> None:
        if self.read_only:
            raise KVError("the KV view was opened read-only")
        wb = WriteBatch(raw_mode=True)
        wb.put(b"\x01meta:" + name.encode(), value.encode())
        self._write(wb)

    def estimated_keys(self) -> int:
        """RocksDB's estimate of the keys held (as Kafka Streams exports it): exact once compacted,
        higher while overwrites still sit in the memtable."""
        return self.db.property_int_value("rocksdb.estimate-num-keys") or 0

    def memory_bytes(self) -> int:
        """Memory the view's RocksDB holds: memtables, block cache, index and filter blocks."""
        return rocks.memory_bytes(self.db)

    def applied_through(self) -> int | None:
        raw = self.db.get(_APPLIED)
        return None if raw is None else struct.unpack(">q", raw)[0]

    def get(self, topic: str, key: str) -> Entry | None:
        k = _dbkey(topic, key)
        raw = self.db.get(k.encode())
        return None if raw is None else self.values_of([_decode(k, raw)])[0]

    def tombstone(self, topic: str, key: str) -> tuple[str, int, int] | None:
        """Why ``key`` has no value, when the view keeps a tombstone for it: ("deleted" or "expired",
        the physical offset and store time (ms) of the delete, or of the put that expired); None for
        a live key or one the view never had."""
        raw = self.db.get(_dbkey(topic, key).encode())
        if raw is None:
            return None
        phy, _queue_id, _queue_offset, store_ts, tomb = _HEAD.unpack_from(raw)
        if tomb in (0, _REFERENCED):
            return None
        return ("deleted" if tomb == _DELETED else "expired"), phy, store_ts

    def multi_get(self, topic: str, keys: list[str]) -> dict[str, Entry | None]:
        raw_keys = [_dbkey(topic, key).encode() for key in keys]
        values = self.db.get(raw_keys) if raw_keys else []
        entries = self.values_of([None if raw is None else _decode(k.decode(), raw) for k, raw in zip(raw_keys, values)])
        return dict(zip(keys, entries))

    def scan(self, topic: str, prefix: str = "") -> Iterator[Entry]:
        """Live entries of ``topic`` whose key starts with ``prefix``, in key (byte) order."""
        start = _dbkey(topic, prefix).encode()

        def live():
            for raw_key, raw in self.db.items(from_key=start):
                if not raw_key.startswith(start):
                    break
                entry = _decode(raw_key.decode(), raw)
                if entry is not None:
                    yield entry
        for chunk in _chunks(live(), FILL_CHUNK):
            yield from self.values_of(chunk)

    def topics(self) -> list[str]:
        """Every topic the view has keys of (tombstones included), jumping from one topic to the next:
        one seek per topic, not a read per key."""
        out, start = [], _DATA_START
        while True:
            first = next(iter(self.db.keys(from_key=start)), None)
            if first is None:
                return out
            topic = first.decode().partition(SEP)[0]
            out.append(topic)
            start = f"{topic}\x01".encode()  # just past every "<topic>\x00<key>"

    def has_topic(self, topic: str) -> bool:
        start = _dbkey(topic, "").encode()
        first = next(iter(self.db.keys(from_key=start)), None)
        return first is not None and first.startswith(start)

    def latest_rows(self, tombstones: bool = False) -> Iterator[tuple]:
        """Every key's latest change in (topic, key) order, as a ``CHANGE_ROW`` tuple: the live keys,
        and with ``tombstones`` the deletes' tombstones too (body None).  An expiry's tombstone is
        never among them: it holds the expired put's physical offset, not one of its own."""
        return self._rows({0, _DELETED} if tombstones else {0})

    def unsent_expiries(self) -> list[Change]:
        """The keys expired while no changelog took their tombstones (one walk of every key, only
        when there are any)."""
        if self.db.get(_UNSENT) is None:
            return []
        return [Change(row[0], row[1], "delete", *row[2:6]) for row in self._rows({_EXPIRED_UNSENT})]

    def _rows(self, kinds: set[int]) -> Iterator[tuple]:
        """The ``CHANGE_ROW`` tuple of every key whose tombstone byte is in ``kinds`` (0, a live
        value, takes the referenced ones too, their bodies read from the tier)."""
        kinds = kinds | {_REFERENCED} if 0 in kinds else kinds

        def rows():
            for raw_key, raw in self.db.items(from_key=_DATA_START):
                if _HEAD.unpack_from(raw)[4] in kinds:
                    yield raw_key.decode(), raw
        for chunk in _chunks(rows(), FILL_CHUNK):
            live = self.values_of([_decode(k, raw) for k, raw in chunk])
            for (dbkey, raw), entry in zip(chunk, live):
                if entry is not None:
                    yield (entry.topic, entry.key, entry.phy_offset, entry.queue_id, entry.queue_offset,
                           entry.store_ts, False, entry.body)
                else:
                    phy, queue_id, queue_offset, store_ts, _ = _HEAD.unpack_from(raw)
                    topic, _, key = dbkey.partition(SEP)
                    yield topic, key, phy, queue_id, queue_offset, store_ts, True, None

    def mark_expiries_sent(self, changes: list[Change]) -> None:
        """``changes`` (from ``unsent_expiries``) reached a changelog: those still unsent tombstones
        at the same physical offset are marked sent, in one durable WriteBatch."""
        if self.read_only:
            raise KVError("the KV view was opened read-only")
        keys = [_dbkey(c.topic, c.key).encode() for c in changes]
        wb = WriteBatch(raw_mode=True)
        for c, k, raw in zip(changes, keys, self.db.get(keys) if keys else []):
            held = None if raw is None else _HEAD.unpack_from(raw)
            if held is not None and held[4] == _EXPIRED_UNSENT and held[0] == c.phy_offset:  # not put again since
                wb.put(k, _value(c.phy_offset, c.queue_id, c.queue_offset, c.store_ts, True, None, _EXPIRED))
        wb.delete(_UNSENT)
        self._write(wb)

    def entries(self, times: dict[str, int] | None = None, bodies: bool = True,
                topics: set[str] | None = None) -> Iterator[tuple[str, Entry | None]]:
        """Every key of every topic (of ``topics``, if given) in (topic, key) order: ``(topic,
        entry)``, entry None for a tombstone.

        ``times``, when given, takes each topic's newest store time (ms) of any key, a tombstone's
        included, as the walk passes it: the moment a snapshot of these entries stands as of.
        Without ``bodies``, a value kept in the tier has body None (``connectors.tier.snapshots``
        reads it from the previous snapshot where it can)."""
        def keys():
            if topics is None:
                yield from self.db.items(from_key=_DATA_START)
                return
            for topic in sorted(topics):
                start = _dbkey(topic, "").encode()
                for raw_key, raw in self.db.items(from_key=start):
                    if not raw_key.startswith(start):
                        break
                    yield raw_key, raw

        def walk():
            for raw_key, raw in keys():
                dbkey = raw_key.decode()
                topic = dbkey.partition(SEP)[0]
                entry = _decode(dbkey, raw)
                if times is not None:  # a live entry has its time decoded already; a tombstone only its head
                    store_ts = entry.store_ts if entry is not None else _HEAD.unpack_from(raw)[3]
                    if store_ts > times.get(topic, -1):
                        times[topic] = store_ts
                yield topic, entry
        if not bodies:
            yield from walk()
            return
        for chunk in _chunks(walk(), FILL_CHUNK):
            yield from zip((t for t, _ in chunk), self.values_of([e for _, e in chunk]))

