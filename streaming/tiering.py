"""The tiering query: commitlog -> staging objects -> commit record -> sealed segments.

Per micro-batch (``TieringHandler.process``, the foreachBatch):

1. **stage** (executors): each Spark partition is a byte range of the
   commitlog; its task reads the range itself with the Arrow fast path, sorts
   the rows by (topic, queue, queue offset) and uploads one staging object.
   Only (physical offset, size) references travel through Spark, as in
   RocketMQ's dispatcher, which hands the uploader references, never bodies.
2. **dispatch**: the driver records each queue's dispatch offset.
3. **commit**: one commit record in the tier makes the batch's objects
   visible atomically; then one synced WriteBatch updates the metadata store.
4. **seal** queues that reached the segment size, count or age, retire
   staging objects every queue of which is sealed, apply retention, and
   checkpoint the commit log into manifests now and then.

Exactly once: the tier remembers the physical offset its last commit reached
(``source_end``).  Rows below it are dropped before staging, so a replayed
batch, or a new checkpoint that starts over, commits nothing twice.  A batch
starting *above* it would skip messages and stops the query instead.
Staging objects are named by their first physical offset, so an upload that
is repeated after a crash overwrites itself.

It is longer than most modules because a batch's commit and the maintenance
that follows it (sealing, retention, the tier log's checkpoints) change the
same ``TierHead`` under one lock, in an order the crash tests pin down.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.brokers import DEFAULT_BROKER
from connectors.commitlog.arrow import dispatched_only
from connectors.commitlog.topics import filtered_counts
from connectors.errors import TierlogError
from connectors.tier import layout
from connectors.tier.backend import open_backend
from connectors.tier.log import TierLog
from connectors.tier.manifest import Segment, StagingObject, add_counts, record_keys
from connectors.tier.records import LastRecord, batch_record, expire_record, seal_record
from connectors.faults import crash_point

log = logging.getLogger("tierlog.tiering")

STAGED_SCHEMA = pa.schema(
    [("name", pa.string()), ("size", pa.int64()), ("first_phy", pa.int64()), ("end_phy", pa.int64()),
     ("rows", pa.int64()), ("bytes", pa.int64()), ("queues", pa.string()), ("upload_s", pa.float64()),
     ("filtered", pa.string()), ("last_phy", pa.int64())]
)
STAGED_DDL = ("name string, size bigint, first_phy bigint, end_phy bigint, rows bigint, bytes bigint, queues string, "
              "upload_s double, filtered string, last_phy bigint")


class SkippedMessagesError(TierlogError):
    """A batch starts above what the tier has committed: tiering it would leave a hole."""


@dataclass(frozen=True)
class TieringSettings:
    location: str
    commitlog_dir: str
    broker: str = DEFAULT_BROKER  # whose commitlog this is: the tier keeps its queues, metadata and rows apart
    key_property: str = "KEYS"
    check_crc: bool = True
    on_corrupt: str = "fail"  # "quarantine": skip corrupt records, recorded with the batch that passes them
    segment_bytes: int = 128 << 20
    segment_messages: int = 1_000_000
    segment_age_s: float = 600.0
    retention_s: dict | None = None  # topic -> seconds; "*" for every other topic; None keeps forever
    retention_bytes: dict | None = None  # topic -> bytes of segments each queue keeps
    retention_messages: dict | None = None  # topic -> messages each queue keeps
    retention_check_s: float = 30.0  # every queue is checked for retention this often
    checkpoint_every: int = 200  # commit records between checkpoints
    checkpoint_bytes: int = 8 << 20  # or this many bytes of records, whichever comes first
    filters: dict | None = None  # sink -> TopicFilter; the tier keeps what filters["tier"] accepts
    delete_grace_s: float = 60.0  # retired objects stay readable this long


# ---------------------------------------------------------------- executor side


def queue_stats(table: pa.Table) -> list[list]:
    """Per queue: [topic, queue, first, last, rows, bytes, min_ts, max_ts] (store times in ms)."""
    if table.num_rows == 0:
        return []
    grouped = table.group_by(["topic", "queue_id"]).aggregate(
        [("queue_offset", "min"), ("queue_offset", "max"), ("queue_offset", "count"), ("size", "sum"),
         ("store_ts", "min"), ("store_ts", "max")]
    )
    cols = [grouped[c].to_pylist() for c in (
        "topic", "queue_id", "queue_offset_min", "queue_offset_max", "queue_offset_count", "size_sum",
        "store_ts_min", "store_ts_max")]
    out = []
    for t, q, lo, hi, n, nbytes, tmin, tmax in zip(*cols):
        out.append([t, q, lo, hi, n, nbytes, int(tmin.timestamp() * 1000), int(tmax.timestamp() * 1000)])
    return out


def make_stager(settings: TieringSettings, floor: int):
    """The mapInArrow function: stage one partition's byte range, yield one summary row."""

    def stage(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from connectors.commitlog.reader import CommitLogReader

        lo = hi = last = None
        for b in batches:
            if b.num_rows == 0:
                continue
            phy = b.column("phy_offset").to_numpy()
            end = phy + b.column("size").to_numpy()
            keep = phy >= floor
            if not keep.any():
                continue
            blo, bhi = int(phy[keep].min()), int(end[keep].max())
            lo = blo if lo is None else min(lo, blo)
            if hi is None or bhi > hi:
                hi, last = bhi, int(phy[keep][np.argmax(end[keep])])
        if lo is None:
            return
        with CommitLogReader(settings.commitlog_dir, check_crc=settings.check_crc,
                             on_corrupt=settings.on_corrupt, broker=settings.broker) as reader:
            batches_ = list(reader.record_batches(lo, hi, key_property=settings.key_property))
        table = dispatched_only(pa.Table.from_batches(batches_, schema=batches_[0].schema if batches_ else None))
        # Every sink's filter is counted here, where each message passes exactly once.
        filtered = filtered_counts(table["topic"], settings.filters) if settings.filters and table.num_rows else {}
        if settings.filters and "tier" in filtered:
            table = table.filter(settings.filters["tier"].mask(table["topic"]))
        summary = {"name": "", "size": 0, "first_phy": lo, "end_phy": hi, "rows": 0, "bytes": 0, "queues": "[]",
                   "upload_s": 0.0, "filtered": json.dumps(filtered), "last_phy": last}
        if table.num_rows:  # else nothing to stage: the range still counts as tiered
            table = layout.sort_rows(table)
            data = layout.to_staging_parquet(table)
            name = layout.Names(settings.broker).staging(lo)
            backend = open_backend(settings.location)
            started = time.monotonic()
            try:
                backend.put(name, data)
            finally:
                backend.close()
            summary.update(name=name, size=len(data), rows=table.num_rows, bytes=int(pc.sum(table["size"]).as_py() or 0),
                           queues=json.dumps(queue_stats(table)), upload_s=time.monotonic() - started)
            crash_point("staged")
        yield pa.RecordBatch.from_pylist([summary], schema=STAGED_SCHEMA)

    return stage


# ---------------------------------------------------------------- driver side


@dataclass
class BatchReport:
    batch_id: int
    rows: int = 0
    bytes: int = 0
    objects: int = 0
    seals: int = 0
    source_end: int | None = None
    max_store_ts: int | None = None
    seconds: float = 0.0
    replay: bool = False
    phases: dict | None = None  # seconds per step: stage (Spark job + uploads), dispatch, commit, maintain
    uploads: list | None = None  # (kind, seconds) per object written: staging, segment, key_index


class TieringHandler:
    """The foreachBatch of the tiering query.  One instance per running query, on the driver.

    It holds the tier's head (every queue's offsets, the live staging objects, the records since
    the last root), never the tier's segments: those are in the tier's manifests and the metadata
    store, and the sink reads a queue's oldest ones only when retention asks.
    """

    def __init__(self, settings: TieringSettings, metadata, on_batch=None):
        self.settings = settings
        self.backend = open_backend(settings.location)
        self.log = TierLog(self.backend, settings.broker)
        self.metadata = metadata
        self.head = self.log.open_head()
        self.reconcile_metadata()
        self.lock = threading.RLock()  # held while a batch is processed; graceful stop waits on it
        self.on_batch = on_batch
        self.uploads: list[tuple[str, float]] = []  # (kind, seconds) since the last batch report
        self.swept_at = 0.0  # when retention last looked at every queue

    def reconcile_metadata(self) -> None:
        """Bring the metadata store up to the tier's commit log (a crash can leave it one record behind)."""
        meta_seq, head = self.metadata.last_seq(), self.head
        if meta_seq > head.seq:
            raise TierlogError(
                f"the metadata store ({self.metadata.path}) has commit record {meta_seq} but the tier "
                f"{self.settings.location} ends at {head.seq}: was the tier replaced? Run "
                "`tierlog tier rebuild-metadata` to rebuild the metadata from the tier"
            )
        if meta_seq == head.seq:
            return
        behind = [r for r in head.tail if r["seq"] > meta_seq]
        if not behind or behind[0]["seq"] != meta_seq + 1:  # the records it missed were checkpointed
            log.warning("metadata store is at commit record %d, the tier's last root past it: rebuilding it from "
                        "the tier", meta_seq)
            self.metadata.rebuild(self.log.view())
            return
        log.info("metadata store is at commit record %d, tier at %d: catching up", meta_seq, head.seq)
        now = time.time()
        for record in behind:
            sealed = [Segment.from_json(d) for d in record["segments"]] if record["type"] == "seal" else []
            expired = [Segment.from_json(d) for d in record["segments"]] if record["type"] == "expire" else []
            deletes = {n: now for n in record.get("retire", ())} | {n: now for s in expired for n in (s.name, s.keys) if n}
            self.metadata.record_commit(head, queues=record_keys(record), segments=sealed, removed_segments=expired,
                                        deletes=deletes, filtered=record.get("filtered"))

    # ------------------------------------------------------------ foreachBatch

    def process(self, df, batch_id: int) -> None:
        with self.lock:
            started = time.monotonic()
            try:
                report = self._process(df, batch_id)
            finally:
                self.uploads = []
            report.seconds = time.monotonic() - started
            if self.on_batch:
                self.on_batch(report)

    def _process(self, df, batch_id: int) -> BatchReport:
        report = BatchReport(batch_id, phases={}, uploads=self.uploads)  # seals below add theirs
        clock = _Clock(report.phases)
        floor = self.head.source_end if self.head.source_end is not None else 0
        staged = df.mapInArrow(make_stager(self.settings, floor), STAGED_DDL).toArrow().to_pylist()
        clock.lap("stage")
        if not staged:
            report.replay = True
            return report
        staged.sort(key=lambda r: r["first_phy"])
        report.uploads.extend(("staging", r["upload_s"]) for r in staged if r["name"])
        self._check_contiguous(staged, batch_id)
        filtered: dict = {}
        for r in staged:
            add_counts(filtered, json.loads(r["filtered"]))
        quarantined = self._quarantined(staged)
        crash_point("uploaded")
        now_ms = int(time.time() * 1000)
        objects = []
        for row in (r for r in staged if r["name"]):
            queues = {(t, q): {"first": lo, "last": hi, "rows": n, "bytes": b, "min_ts": tmin, "max_ts": tmax}
                      for t, q, lo, hi, n, b, tmin, tmax in json.loads(row["queues"])}
            objects.append(StagingObject(row["name"], row["size"], row["first_phy"], queues, now_ms))
        touched = {k for o in objects for k in o.queues}
        self.metadata.record_dispatch(
            {k: max(o.queues[k]["last"] + 1 for o in objects if k in o.queues) for k in touched}
        )
        clock.lap("dispatch")
        crash_point("dispatched")
        record = batch_record(batch_id, staged[0]["first_phy"], staged[-1]["end_phy"], [o.to_json() for o in objects],
                              self._fingerprint(staged[-1]["last_phy"], staged[-1]["end_phy"]), quarantined, filtered)
        self.log.append(self.head, record)
        crash_point("logged")
        self.metadata.record_commit(self.head, queues=touched, filtered=filtered)
        if quarantined:
            self.metadata.record_quarantine(quarantined)
        clock.lap("commit")
        crash_point("committed")
        report.rows = sum(r["rows"] for r in staged)
        report.bytes = sum(r["bytes"] for r in staged)
        report.objects = len(objects)
        report.source_end = self.head.source_end
        report.max_store_ts = max((s["max_ts"] for o in objects for s in o.queues.values()), default=None)
        report.seals = self.maintain()
        clock.lap("maintain")
        return report

    def _fingerprint(self, phy: int, end: int) -> LastRecord:
        """The batch's last record: where it is and the CRC-32 of its bytes.  A later start checks
        the commitlog (a replica after a failover, say) still holds exactly these bytes there."""
        from connectors.commitlog.reader import CommitLogReader

        with CommitLogReader(self.settings.commitlog_dir) as reader:
            data = reader.read_bytes(phy, end - phy)
        if data is None:
            raise TierlogError(f"the commitlog {self.settings.commitlog_dir} no longer holds physical offsets "
                               f"{phy}-{end}, which this batch just read: was it replaced while tierlog ran?")
        return {"phy": phy, "size": end - phy, "crc32": zlib.crc32(data)}

    def _check_contiguous(self, staged: list[dict], batch_id: int) -> None:
        """Each part must start where the tier (or the previous part) ended, blank markers aside."""
        expected = self.head.source_end
        for row in staged:
            if expected is not None and row["first_phy"] != expected:
                skipped = self._messages_between(expected, row["first_phy"])
                if skipped:
                    raise SkippedMessagesError(
                        f"batch {batch_id} would tier commitlog bytes from physical offset {row['first_phy']}, "
                        f"but the tier {self.settings.location} has committed up to {expected}: {skipped} "
                        "in between would be skipped. Was the commitlog truncated, or startingOffset moved? "
                        "Restore the missing commitlog files, or start a new tier location."
                    )
            expected = row["end_phy"]

    def _quarantined(self, staged: list[dict]) -> list[dict]:
        """Under ``on_corrupt = "quarantine"``: the corrupt ranges the batch passes over, from where the tier
        ended.  Every reader skips the same records (the bytes decide), so this one pass can speak for all."""
        if self.settings.on_corrupt != "quarantine":
            return []
        from connectors.commitlog.reader import CommitLogReader

        start = self.head.source_end if self.head.source_end is not None else staged[0]["first_phy"]
        with CommitLogReader(self.settings.commitlog_dir, check_crc=self.settings.check_crc,
                             on_corrupt="quarantine") as reader:
            for _ in reader.record_batches(start, staged[-1]["end_phy"], columns=["phy_offset"]):
                pass
        for q in reader.quarantined:
            log.error("quarantined commitlog bytes %d-%d of %s: %s. They are skipped by every sink and listed by "
                      "`tierlog status`; restore them from a replica if they matter", q.start, q.end, q.file, q.reason)
        return [q.to_json() for q in reader.quarantined]

    def _messages_between(self, start: int, end: int) -> str | None:
        """None when only blank markers lie in ``[start, end)``, else what would be skipped."""
        from connectors.commitlog.errors import CommitLogError
        from connectors.commitlog.reader import CommitLogReader

        if end < start:
            return f"{start - end} bytes (overlap)"
        try:
            with CommitLogReader(self.settings.commitlog_dir, on_corrupt=self.settings.on_corrupt) as reader:
                found = reader.scan(start, end).records
        except CommitLogError as exc:
            return f"an unreadable range ({exc})"
        return f"{found} message(s)" if found else None

    # ------------------------------------------------------------ sealing, retention, checkpoints

    def maintain(self, now_ms: int | None = None) -> int:
        """Seal due queues, expire old segments, delete retired objects, checkpoint the log."""
        now_ms = now_ms or int(time.time() * 1000)
        due = self.due_for_sealing(now_ms)
        seals = self.seal(due)
        self.expire(now_ms, due)
        self.delete_retired(now_ms)
        if len(self.head.tail) >= self.settings.checkpoint_every or self.head.tail_bytes >= self.settings.checkpoint_bytes:
            self.checkpoint()
        return seals

    def flush(self) -> None:
        """On a clean stop: fold the records since the last root into manifests, so readers and the
        next start read a root and nothing after it."""
        with self.lock:
            if self.head.tail:
                self.checkpoint()

    def checkpoint(self) -> None:
        """Fold the records since the last root into manifests; what it replaced is deleted after the grace."""
        garbage = self.log.checkpoint(self.head, before_root=lambda: crash_point("checkpoint_written"))
        crash_point("checkpointed")
        if garbage:
            self.metadata.schedule_deletes({n: time.time() for n in garbage})

    def due_for_sealing(self, now_ms: int) -> list[tuple[str, int]]:
        s = self.settings
        due = []
        for key, objs in self.head.unsealed().items():
            rows = sum(o.queues[key]["rows"] for o in objs)
            nbytes = sum(o.queues[key]["bytes"] for o in objs)
            oldest = min(o.time_ms for o in objs)
            if rows >= s.segment_messages or nbytes >= s.segment_bytes or now_ms - oldest >= s.segment_age_s * 1000:
                due.append(key)
        return sorted(due)

    def seal(self, keys: list[tuple[str, int]]) -> int:
        """Write one segment per queue in ``keys`` from its committed staging rows, then commit."""
        if not keys:
            return 0
        wanted = set(keys)
        parts: dict[tuple[str, int], list[pa.Table]] = {k: [] for k in keys}
        holding = sorted({o.name: o for k in keys for o in self.head.staging_for(k)}.values(), key=lambda o: o.first_phy)
        for obj in holding:
            table = layout.from_parquet(self.backend.read(obj.name))
            for key, piece in split_by_queue(table).items():
                if key in wanted:
                    sealed = self.head.queues[key].sealed
                    parts[key].append(piece.filter(pc.greater_equal(piece["queue_offset"], sealed)))
        segments = []
        for (topic, q), pieces in parts.items():
            table = pa.concat_tables(pieces).sort_by("queue_offset")
            if table.num_rows == 0:
                continue
            base = table["queue_offset"][0].as_py()
            end = table["queue_offset"][-1].as_py()
            data = layout.to_parquet(table)
            name = self.log.names.segment(topic, q, base)
            self._timed_put("segment", name, data)
            keys = self.log.names.key_index(topic, q, base)
            self._timed_put("key_index", keys, layout.key_index(table))
            crash_point("seal_uploaded")
            ts = table["store_ts"]
            segments.append(Segment(name, topic, q, base, end, table.num_rows, len(data),
                                    _ms(pc.min(ts)), _ms(pc.max(ts)), keys))
        sealed_after = {(s.topic, s.queue_id): s.end + 1 for s in segments}
        retire = [
            o.name for o in holding
            if all(st["last"] < sealed_after.get(k, self.head.queues[k].sealed) for k, st in o.queues.items())
        ]
        self.log.append(self.head, seal_record([s.to_json() for s in segments], retire))
        crash_point("sealed")
        now = time.time()
        self.metadata.record_commit(
            self.head, queues=list(sealed_after), segments=segments, deletes={n: now for n in retire}
        )
        return len(segments)

    def _timed_put(self, kind: str, name: str, data: bytes) -> None:
        started = time.monotonic()
        self.backend.put(name, data)
        self.uploads.append((kind, time.monotonic() - started))

    def expire(self, now_ms: int, sealed: list[tuple[str, int]] = ()) -> None:
        """Retention: drop each queue's oldest segments past its topic's time, bytes or message limit.

        Limits by bytes and messages can only be crossed by a seal, so the queues just sealed are
        checked every time; every queue is looked at once per ``retention_check_s`` (time passes
        for all of them).  Segments go oldest first, so a queue's retained offsets stay contiguous.
        """
        s = self.settings
        if not (s.retention_s or s.retention_bytes or s.retention_messages):
            return
        keys = set(sealed)
        if time.monotonic() - self.swept_at >= s.retention_check_s:
            keys = set(self.head.queues)
            self.swept_at = time.monotonic()
        expired = []
        for key in sorted(keys):
            expired.extend(self._expired(key, now_ms))
        if not expired:
            return
        self.log.append(self.head, expire_record([seg.to_json() for seg in expired]))
        now = time.time()
        self.metadata.record_commit(
            self.head, queues={seg.key for seg in expired}, removed_segments=expired,
            deletes={n: now for seg in expired for n in (seg.name, seg.keys) if n},
        )

    def _expired(self, key: tuple[str, int], now_ms: int) -> list[Segment]:
        s, q = self.settings, self.head.queues[key]
        ttl, max_bytes, max_messages = (_limit(s.retention_s, key[0]), _limit(s.retention_bytes, key[0]),
                                        _limit(s.retention_messages, key[0]))
        if ttl is None and max_bytes is None and max_messages is None:
            return []
        out, kept_bytes = [], q.bytes
        for seg in self.metadata.oldest_segments(*key):
            too_old = ttl is not None and now_ms - seg.max_ts > ttl * 1000
            too_big = max_bytes is not None and kept_bytes - seg.size >= max_bytes
            too_many = max_messages is not None and q.commit - (seg.end + 1) >= max_messages
            if not (too_old or too_big or too_many):
                break
            out.append(seg)
            kept_bytes -= seg.size
        return out

    def delete_retired(self, now_ms: int) -> None:
        """Delete objects retired more than ``delete_grace_s`` ago; readers still on them had time."""
        due = [n for n, when in self.metadata.pending_deletes().items()
               if now_ms / 1000 - when >= self.settings.delete_grace_s]
        for name in due:
            self.backend.delete(name)
        if due:
            self.metadata.forget_deletes(due)


def _limit(limits: dict | None, topic: str):
    return None if not limits else limits.get(topic, limits.get("*"))


class _Clock:
    """Seconds spent per step of a batch, for the batch's log line."""

    def __init__(self, into: dict):
        self.into, self.last = into, time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.into[name] = round(now - self.last, 3)
        self.last = now


def split_by_queue(table: pa.Table) -> dict[tuple[str, int], pa.Table]:
    """Slices of a table sorted by (topic, queue_id), one per queue, without copying."""
    if table.num_rows == 0:
        return {}
    topics = pc.dictionary_encode(table["topic"]).combine_chunks()
    codes = topics.indices.to_numpy().astype(np.int64)
    queues = table["queue_id"].to_numpy().astype(np.int64)
    combined = (codes << 32) | queues
    starts = np.flatnonzero(np.diff(combined)) + 1
    bounds = [0, *starts.tolist(), table.num_rows]
    names = topics.dictionary.to_pylist()
    return {
        (names[codes[a]], int(queues[a])): table.slice(a, b - a) for a, b in zip(bounds, bounds[1:])
    }


def _ms(scalar) -> int:
    return int(scalar.as_py().timestamp() * 1000)


def refs_stream(spark, opts: dict):
    """The tiering query's input: references (physical offset, size) to the commitlog's records."""
    reader = spark.readStream.format("commitlog").option("refsOnly", "true")
    for key, value in opts.items():
        if value is not None:
            reader = reader.option(key, str(value))
    return reader.load()
