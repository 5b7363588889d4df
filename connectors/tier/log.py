"""The tier's commit log: which objects are visible, and the committed offsets.

A commit record is one small JSON object, written with the backend's atomic
``put`` under ``_log/``.  Records are numbered 0, 1, 2, ...; an object is
visible exactly when a record that adds it is, and stops being visible when a
later record removes it.  Readers trust nothing else: an object in the tier
that no record names (an upload whose commit never happened) is invisible.

Record types (each carries ``"v": 2``, the layout):

``batch``   staging objects of one micro-batch, and each queue's new commit offset
``seal``    segments sealed from staging data, and the staging objects they retire
``expire``  segments removed by retention, oldest first per queue

A *fold* writes a new *root*: it folds the records into per-queue manifests and
compacts the log; its cost is the queues the records touched, never the tier's
history (``connectors.tier.manifest`` has the layout and why).

Crash safety: a fold writes pages, manifests and buckets under new
names first, then the root, and only then deletes the records the root covers.
A crash before the root leaves the old root and every record in place; the
objects it wrote are referenced by nothing, so no reader sees them.

It is longer than most modules because appending, folding and upgrading
write the same objects and must agree on their order of writes and deletes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from connectors.brokers import DEFAULT_BROKER
from connectors.tier import layout
from connectors.tier.backend import Backend
from connectors.tier.errors import ObjectNotFound, TierRecordError
from connectors.tier.manifest import (
    DEFAULT_BUCKETS, FORMAT, PAGE_SEGMENTS, PageRef, QueueKey, QueueManifest, QueueState, Segment, StagingObject,
    StagingPart, add_counts, apply_to_manifest, apply_to_state, bucket_of, by_queue, check_record, dropped_pages, home_bucket,
    record_keys,
)
from connectors.tier.pool import io_map
from connectors.tier.records import CommitRecord
from connectors.tier.committed import CommittedTier

log = logging.getLogger("tierlog.tier")

CACHE_OBJECTS = 4096  # parsed metadata objects a TierLog keeps (every name it caches is immutable)


class TierLayoutError(TierRecordError):
    """The tier was written by an older tierlog, in a layout this one reads only to upgrade."""


class BeforeBrokersError(TierLayoutError):
    """The tier was written before tierlog knew brokers; ``tierlog tier upgrade`` moves it."""


@dataclass
class Listing:
    records: list[int] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)
    legacy: list[int] = field(default_factory=list)
    before_brokers: bool = False  # the tier also holds a commit log without a broker level


def empty_root(buckets: int = DEFAULT_BUCKETS) -> dict:
    return {"type": "root", "v": FORMAT, "seq": -1, "source_end": None, "last_batch_id": -1, "quarantined": [],
            "buckets": buckets, "versions": {}}


class TierHead:
    """The writer's working set: every queue's offsets and counts, the live staging objects, and
    the records since the last root.  It never holds a segment: that is what keeps the service's
    memory bounded by its queues and its unsealed data, not by the tier's history."""

    def __init__(self, root: dict):
        self.bucket_versions: dict[int, int] = {int(b): v for b, v in root["versions"].items()}
        self.seq = root["seq"]
        self.source_end = root["source_end"]
        self.last_record = root.get("last_record")  # where the last committed record is, and its CRC
        self.last_batch_id = root["last_batch_id"]
        self.buckets = root["buckets"]
        self.quarantined = {q["start_phy"]: q for q in root.get("quarantined", ())}
        self.topics: dict[str, int] = {}  # topic -> one past its highest queue id
        self.topics_by_home: dict[int, set[str]] = {}
        self.changed_buckets: set[int] = set()  # buckets to rewrite at the next fold
        self.filtered: dict[str, dict[str, int]] = {k: dict(v) for k, v in root.get("filtered", {}).items()}
        self.queues: dict[QueueKey, QueueState] = {}
        self.versions: dict[QueueKey, int] = {}  # each queue's manifest version at the root
        self.by_bucket: dict[int, set[QueueKey]] = {}
        self.staging: dict[str, StagingObject] = {}  # live: holding a queue's unsealed rows
        # Live staging of a queue, oldest first; a dict as an ordered set, so a seal that retires
        # hundreds of objects removes each at once, not by a walk of the queue's list.
        self.staging_by_queue: dict[QueueKey, dict[str, None]] = {}
        # (rows, bytes, oldest time_ms) of each queue's live staging, as a maintenance asks whether
        # it is due: kept up as batches add objects, dropped for a queue a seal or expiry changes.
        # Why: summed afresh at every maintenance, a quiet broker's queues over the hundreds of
        # objects of a segment age cost a visible part of its CPU just before each seal wave.
        self._totals: dict[QueueKey, tuple[int, int, int]] = {}
        self.tail: list[dict] = []  # records since the root
        self.tail_bytes = 0

    def _add_queue(self, key: QueueKey) -> None:
        b = bucket_of(key, self.buckets)
        self.by_bucket.setdefault(b, set()).add(key)
        self.changed_buckets.add(b)
        self._count_topic(key[0], key[1] + 1)

    def _count_topic(self, topic: str, n: int) -> None:
        if n > self.topics.get(topic, 0):
            self.topics[topic] = n
            home = home_bucket(topic, self.buckets)
            self.topics_by_home.setdefault(home, set()).add(topic)
            self.changed_buckets.add(home)

    def _add_staging(self, obj: StagingObject) -> None:
        self.staging[obj.name] = obj
        for key, st in obj.queues.items():
            self.staging_by_queue.setdefault(key, {})[obj.name] = None  # batches commit in offset order
            totals = self._totals.get(key)
            if totals is not None and key in self.queues and st["last"] >= self.queues[key].sealed:
                rows, nbytes, oldest = totals
                self._totals[key] = (rows + st["rows"], nbytes + st["bytes"], min(oldest, obj.time_ms))

    def check(self, record: dict) -> None:
        """Refuse a record that does not follow the head (a bad record is never written)."""
        check_record(record)
        if record["seq"] != self.seq + 1:
            raise TierRecordError(f"commit record {record['seq']} follows {self.seq}: the tier's commit log has a gap")
        if record["type"] != "batch":
            for key in record_keys(record):
                if key not in self.queues:
                    raise TierRecordError(f"commit record {record['seq']} ({record['type']}) names queue "
                                       f"{key[0]}/{key[1]}, which the tier does not hold")

    def apply(self, record: dict, size: int = 0) -> None:
        self.check(record)
        for key, part in by_queue(record).items():
            if key not in self.queues:
                self._add_queue(key)
            self.queues[key] = apply_to_state(self.queues.get(key), key, part)
            self.changed_buckets.add(bucket_of(key, self.buckets))
        kind = record["type"]
        if kind == "batch":
            for obj in record["staging"]:
                self._add_staging(StagingObject.from_json(obj))
            self.quarantined.update({q["start_phy"]: q for q in record.get("quarantined", ())})
            add_counts(self.filtered, record.get("filtered", {}))
            self.source_end, self.last_batch_id = record["source_end"], record["batch_id"]
            self.last_record = record.get("last_record", self.last_record)
        else:
            for key in record_keys(record):
                self._totals.pop(key, None)
        if kind == "seal":
            for name in record["retire"]:
                obj = self.staging.pop(name, None)
                for key in obj.queues if obj else ():
                    self.staging_by_queue.get(key, {}).pop(name, None)
                    self._totals.pop(key, None)
            for key in record_keys(record):
                sealed = self.queues[key].sealed
                live = {n: None for n in self.staging_by_queue.get(key, ()) if self.staging[n].queues[key]["last"] >= sealed}
                if live:
                    self.staging_by_queue[key] = live
                else:
                    self.staging_by_queue.pop(key, None)
        self.seq = record["seq"]
        self.tail.append(record)
        self.tail_bytes += size

    def staging_for(self, key: QueueKey) -> list[StagingObject]:
        """Live staging objects holding unsealed rows of ``key``, oldest first."""
        sealed = self.queues[key].sealed
        return [self.staging[n] for n in self.staging_by_queue.get(key, ())
                if self.staging[n].queues[key]["last"] >= sealed]

    def unsealed(self) -> dict[QueueKey, list[StagingObject]]:
        """Every queue with unsealed rows, and the staging objects holding them."""
        return {key: objs for key in list(self.staging_by_queue) if (objs := self.staging_for(key))}

    def unsealed_totals(self) -> dict[QueueKey, tuple[int, int, int]]:
        """Every queue with unsealed rows: the rows, bytes and oldest ``time_ms`` of the staging
        objects holding them (the sums ``staging_for`` would give, without walking them again)."""
        out = {}
        for key in list(self.staging_by_queue):
            totals = self._totals.get(key)
            if totals is None:
                objs = self.staging_for(key)
                if not objs:
                    continue
                totals = self._totals[key] = (sum(o.queues[key]["rows"] for o in objs),
                                              sum(o.queues[key]["bytes"] for o in objs), min(o.time_ms for o in objs))
            out[key] = totals
        return out


class TierLog:
    """Reads and appends one broker's commit log in a tier.  Only one process appends to it (see
    the metadata lock); other brokers' tierlogs append to their own, in the same tier.

    ``broker=None`` is the layout before brokers: read, and upgraded, never appended to.
    """

    def __init__(self, backend: Backend, broker: str | None = DEFAULT_BROKER, buckets: int = DEFAULT_BUCKETS):
        self.backend = backend
        self.broker = broker
        self.names = layout.Names(broker)
        self.new_buckets = buckets  # for a tier that has no root yet
        self.cache_objects = CACHE_OBJECTS
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._cache_lock = threading.Lock()

    # ------------------------------------------------------------ reading

    def read_json(self, name: str) -> dict:
        """A metadata object, parsed; cached, since every name this is asked for is never rewritten."""
        with self._cache_lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
        value = json.loads(self.backend.read(name))
        with self._cache_lock:
            self._cache[name] = value
            while len(self._cache) > self.cache_objects:
                self._cache.popitem(last=False)
        return value

    def _listing(self) -> Listing:
        """This broker's commit-log objects.  Lists every broker's (a fold keeps each one
        short), to notice a commit log from before brokers."""
        out = Listing()
        before = layout.Names(None)
        for obj in self.backend.list(layout.LOG_PREFIX):
            parsed = self.names.parse_log(obj.name)
            if parsed:
                {"record": out.records, "root": out.roots, "legacy": out.legacy}[parsed[1]].append(parsed[0])
            elif self.broker is not None and before.parse_log(obj.name):
                out.before_brokers = True
        out.records.sort(), out.roots.sort(), out.legacy.sort()
        return out

    def _is_legacy(self, listing: Listing) -> bool:
        if listing.roots:
            return False
        if listing.legacy:
            return True
        return bool(listing.records) and self.read_json(self.names.log(listing.records[0])).get("v") != FORMAT

    def committed(self, *, attempts: int = 5) -> CommittedTier:
        """The committed state: the newest root and every record after it.

        A fold running at the same time may delete what was just listed; the read
        is then started again.
        """
        for attempt in range(attempts):
            try:
                return self._committed_once()
            except ObjectNotFound:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _refuse_before_brokers(self, listing: Listing) -> None:
        if listing.before_brokers and not listing.roots and not listing.records:
            raise BeforeBrokersError(
                f"the tier at {self.backend.location} was written before tierlog knew brokers (its segments are "
                "under topic=<t>/queue=<q>/). Stop every tierlog writing it and run `tierlog tier upgrade` once, with "
                f"`broker.name` set to the broker whose commitlog it holds (now {self.broker!r}): it moves the "
                "tier's objects under broker=<name>/ and rewrites its metadata"
            )

    def _committed_once(self) -> CommittedTier:
        listing = self._listing()
        self._refuse_before_brokers(listing)
        if self._is_legacy(listing):
            raise TierLayoutError(
                f"the tier at {self.backend.location} was written by an older tierlog (one state object "
                "rewritten on every commit). Run `tierlog tier upgrade` (or start `tierlog run`, which upgrades "
                "it) once to rewrite its metadata as manifests; its data objects are kept as they are"
            )
        root = self.read_json(self.names.root(listing.roots[-1])) if listing.roots else empty_root(self.new_buckets)
        tail = [self.read_json(self.names.log(seq)) for seq in listing.records if seq > root["seq"]]
        _check_sequence(root["seq"], tail)
        return CommittedTier(self, root, tail)


    def open_head(self) -> TierHead:
        """The writer's working set, read from the newest root (an older layout is upgraded first):
        every bucket, and the manifests of the queues that have unsealed rows."""
        listing = self._listing()
        self._refuse_before_brokers(listing)
        if self._is_legacy(listing):
            self.upgrade(listing)
            listing = self._listing()
        root = self.read_json(self.names.root(listing.roots[-1])) if listing.roots else empty_root(self.new_buckets)
        head = TierHead(root)
        buckets = sorted(head.bucket_versions.items())
        for bucket in io_map(lambda bv: self.read_json(self.names.bucket(*bv)), buckets):
            for t, q, version, state in bucket["queues"]:
                head._add_queue((t, q))
                head.queues[(t, q)] = QueueState.from_json(state)
                head.versions[(t, q)] = version
            for t, n in bucket.get("topics", {}).items():
                head._count_topic(t, n)
        head.changed_buckets.clear()
        unsealed = [k for k, s in head.queues.items() if s.commit > s.sealed]
        objects: dict[str, StagingObject] = {}
        for key, m in zip(unsealed, io_map(lambda k: self._manifest(k, head.versions[k]), unsealed)):
            for p in m.staging:
                if p.last >= m.state.sealed:
                    obj = objects.setdefault(p.name, StagingObject(p.name, p.size, p.first_phy, {}, p.time_ms))
                    obj.queues[key] = {"first": p.first, "last": p.last, "rows": p.rows, "bytes": p.bytes,
                                       "min_ts": p.min_ts, "max_ts": p.max_ts}
        for obj in sorted(objects.values(), key=lambda o: o.first_phy):
            head._add_staging(obj)
        for seq in listing.records:
            if seq > head.seq:
                head.apply(self.read_json(self.names.log(seq)))
        return head

    def _manifest(self, key: QueueKey, version: int | None) -> QueueManifest | None:
        if version is None:
            return None
        return QueueManifest.from_json(self.read_json(self.names.queue_manifest(*key, version)))

    # ------------------------------------------------------------ writing

    def append(self, head: TierHead, record: CommitRecord) -> int:
        """Write ``record`` as the next commit record and apply it to ``head``; returns its seq.

        The record is checked against ``head`` first, so a bad record is never written.  The
        check and the write cost what the record names, not what the tier holds.
        """
        record = {**record, "v": FORMAT, "seq": head.seq + 1, "time_ms": int(time.time() * 1000)}
        head.check(record)
        data = json.dumps(record, separators=(",", ":")).encode()
        self.backend.put(self.names.log(record["seq"]), data)
        head.apply(record, len(data))
        return record["seq"]

    def fold(self, head: TierHead, before_root=None) -> list[str]:
        """Fold the records since the last root into the manifests of the queues they changed,
        write a new root, and delete the records it covers.  Returns the metadata objects the new
        root no longer names; the caller deletes them after a grace period (readers may be on them).
        """
        if not head.tail:
            return []
        seq = head.seq
        by_key: dict[QueueKey, list[dict]] = {}
        for record in head.tail:
            for key, part in by_queue(record).items():
                by_key.setdefault(key, []).append(part)

        def fold_queue(key: QueueKey) -> list[str]:
            m = self._manifest(key, head.versions.get(key))
            for record in by_key[key]:
                m = apply_to_manifest(m, key, record)
            if m.state != head.queues[key]:
                raise TierRecordError(f"queue {key[0]}/{key[1]}: its manifest folds to {m.state}, the head holds "
                                   f"{head.queues[key]}")
            garbage = [p.name for p in dropped_pages(m)]
            if len(m.recent) >= PAGE_SEGMENTS:
                name = self.names.page(*key, m.recent[0].base, seq)
                self.backend.put(name, compact_json({"v": FORMAT, "segments": [s.to_json() for s in m.recent]}))
                m.pages.append(PageRef.of(name, m.recent))
                m.recent = []
            self.backend.put(self.names.queue_manifest(*key, seq), compact_json(m.to_json()))
            if key in head.versions:
                garbage.append(self.names.queue_manifest(*key, head.versions[key]))
            return garbage

        garbage = [name for names in io_map(fold_queue, list(by_key)) for name in names]
        for key in by_key:
            head.versions[key] = seq
        garbage += self._write_buckets(head, head.changed_buckets, seq)
        if before_root:
            before_root()  # a test's crash point: everything but the root is written
        self._write_root(head)
        head.tail, head.tail_bytes = [], 0
        self._delete_covered(seq)
        return garbage

    def _write_root(self, head: TierHead) -> None:
        root = {"type": "root", "v": FORMAT, "broker": self.broker, "seq": head.seq, "source_end": head.source_end,
                "last_record": head.last_record,
                "last_batch_id": head.last_batch_id, "time_ms": int(time.time() * 1000),
                "quarantined": [q for _, q in sorted(head.quarantined.items())], "buckets": head.buckets,
                "versions": {str(b): v for b, v in sorted(head.bucket_versions.items())},
                "filtered": head.filtered}
        self.backend.put(self.names.root(head.seq), compact_json(root))

    def _write_buckets(self, head: TierHead, buckets: set[int], seq: int) -> list[str]:
        versions = head.bucket_versions
        garbage = [self.names.bucket(b, versions[b]) for b in buckets if b in versions]

        def write(b: int) -> None:
            rows = [[t, q, head.versions[(t, q)], head.queues[(t, q)].to_json()]
                    for t, q in sorted(head.by_bucket.get(b, ()))]
            topics = {t: head.topics[t] for t in sorted(head.topics_by_home.get(b, ()))}
            self.backend.put(self.names.bucket(b, seq), compact_json({"v": FORMAT, "queues": rows, "topics": topics}))

        io_map(write, sorted(buckets))
        versions.update({b: seq for b in buckets})
        head.changed_buckets = set()
        return garbage

    def _delete_covered(self, seq: int) -> None:
        listing = self._listing()
        for s in listing.records:
            if s <= seq:
                self.backend.delete(self.names.log(s))
        for s in listing.roots:
            if s < seq:
                self.backend.delete(self.names.root(s))
        for s in listing.legacy:
            self.backend.delete(self.names.legacy_checkpoint(s))

    # ------------------------------------------------------------ the first layout

    def upgrade(self, listing: Listing | None = None) -> int | None:
        """Rewrite a first-layout tier's metadata as manifests, in place.  Data objects stay; the
        old checkpoint and records are deleted only after the new root is written, so a crash
        leaves a tier that is upgraded again on the next start.  Returns the root's seq."""
        from connectors.tier import legacy

        listing = listing or self._listing()
        if not self._is_legacy(listing):
            return None
        started = time.monotonic()
        old = legacy.read_state(self.backend, listing.records, listing.legacy)
        head = TierHead({**empty_root(self.new_buckets), "seq": old.seq, "source_end": old.source_end,
                         "last_batch_id": old.last_batch_id,
                         "quarantined": [q for _, q in sorted(old.quarantined.items())]})
        segments: dict[QueueKey, list[Segment]] = {}
        for seg in old.segments.values():
            segments.setdefault(seg.key, []).append(seg)
        manifests: dict[QueueKey, QueueManifest] = {}
        for key, q in old.queues.items():
            segs = sorted(segments.get(key, ()), key=lambda s: s.base)
            state = QueueState(q.commit, q.sealed, q.low, len(segs), sum(s.size for s in segs))
            parts = sorted((StagingPart(o.name, o.size, o.first_phy, st["first"], st["last"], st["rows"],
                                        st.get("bytes", 0), st["min_ts"], st["max_ts"], o.time_ms)
                            for o in old.staging.values() for k, st in o.queues.items()
                            if k == key and st["last"] >= q.sealed), key=lambda p: p.first_phy)
            manifests[key] = QueueManifest(state, parts, segs)
            head._add_queue(key)
            head.queues[key] = state
            head.versions[key] = old.seq
        self.write_whole(head, manifests)
        self._delete_covered(old.seq)
        log.warning("upgraded the tier at %s to manifests: %d queues, %d segments, commit record %d (%.1f s)",
                    self.backend.location, len(manifests), len(old.segments), old.seq, time.monotonic() - started)
        return old.seq


    def write_whole(self, head: TierHead, manifests: dict[QueueKey, QueueManifest]) -> None:
        """Write a whole state at ``head.seq`` from scratch (an upgrade): every queue's manifest,
        its segments paged ``PAGE_SEGMENTS`` at a time, every bucket, then the root."""
        seq = head.seq

        def write(key: QueueKey) -> None:
            m = manifests[key]
            while len(m.recent) > PAGE_SEGMENTS:
                page, m.recent = m.recent[:PAGE_SEGMENTS], m.recent[PAGE_SEGMENTS:]
                name = self.names.page(*key, page[0].base, seq)
                self.backend.put(name, compact_json({"v": FORMAT, "segments": [s.to_json() for s in page]}))
                m.pages.append(PageRef.of(name, page))
            self.backend.put(self.names.queue_manifest(*key, seq), compact_json(m.to_json()))

        io_map(write, list(manifests))
        self._write_buckets(head, head.changed_buckets, seq)
        self._write_root(head)


def _check_sequence(root_seq: int, tail: list[dict]) -> None:
    expected = root_seq + 1
    for record in tail:
        check_record(record)
        if record["seq"] != expected:
            raise TierRecordError(f"commit record {record['seq']} follows {expected - 1}: the tier's commit log has a gap")
        expected += 1


def compact_json(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
