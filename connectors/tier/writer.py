"""``TierWriter``: the tier's write protocol (commit, seal, expire, retire, fold), with no Spark in it.

One writer per broker and tier owns that broker's commit log (``TierLog``), its working set
(``TierHead``) and a backend.  It is driven by whatever stages the data: ``tierlog run``'s tiering
query, a benchmark, a test.  The order of writes is the protocol, and the crash tests pin it down:

1. **commit** a batch: record each queue's dispatch offset in the index, write one commit record
   naming the batch's staging objects (visible from that moment, atomically), then update the
   index in one synced write;
2. **seal** queues due by size, count or age into segments and their key indexes, then a seal
   record that also retires the staging objects no queue needs any more;
3. **expire** segments past retention with an expire record;
4. keep the **tables** (``connectors.tables.MessageTables``) in step: each topic's committed rows,
   fresh or sealed, in its Iceberg table within seconds;
5. **delete** retired objects once their grace has passed (readers may still be on them) and the
   tables no longer need them;
6. **fold** the records since the last root into manifests now and then (``TierLog.fold``).

Exactly once: the tier remembers the physical offset its last commit reached (``source_end``).
Stagers drop rows below it, so a replayed batch commits nothing twice; a batch starting *above*
it would leave a hole and is refused (``SkippedMessagesError``).

Maintenance is bounded per call: at most ``delete_batch`` deletions and ``sweep_batch`` queues
looked at for retention, so the backlog a previous process left (a tier of 20,000 queues, say)
is spread over batches instead of holding up the first one.

The index (``TierIndex``) is the local metadata store: a fast copy of the log, brought up to it
at open (``reconcile``), never the source of truth.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from connectors.brokers import DEFAULT_BROKER
from connectors.errors import TierlogError
from connectors.faults import crash_point
from connectors.tier import layout
from connectors.tier.backend import Backend
from connectors.tier.location import open_backend
from connectors.tier.copies import CopySettings
from connectors.tier.log import TierHead, TierLog
from connectors.tier.manifest import Segment, add_counts
from connectors.tier.records import batch_record, expire_record, seal_record
from connectors.tier.retention import Retention
from connectors.tier.staging import Gap, StagedPart
from connectors.tier.committed import CommittedTier

log = logging.getLogger("tierlog.tier")

if TYPE_CHECKING:
    from connectors.tables.view import TierView


class SkippedMessagesError(TierlogError):
    """A batch starts above what the tier has committed: tiering it would leave a hole."""


class TierIndex(Protocol):
    """What the writer keeps in step with the log (``state.metadata.MetadataStore`` implements it)."""

    path: str

    def last_seq(self) -> int: ...
    def rebuild(self, committed: CommittedTier) -> None: ...
    def record_dispatch(self, offsets: dict[tuple[str, int], int]) -> None: ...
    def apply(self, head: TierHead, record: dict, now: float, counted: dict | None = None) -> None: ...
    def oldest_segments(self, topic: str, queue_id: int) -> Iterator[Segment]: ...
    def schedule_deletes(self, deletes: dict[str, float]) -> None: ...
    def pending_deletes(self) -> dict[str, float]: ...
    def held_from(self) -> int | None: ...
    def retention_holds(self) -> set[str]: ...
    def forget_deletes(self, names: list[str]) -> None: ...
    def table_state(self, topic: str) -> dict | None: ...
    def record_table_state(self, topic: str, state: dict) -> None: ...


# A seal filters and gathers the rows of consecutive staging objects by queue this many bytes of
# them at a time: once for hundreds of a quiet broker's small objects, while what a seal holds
# stays the rows it seals and one such group (bench/bench_seal.py).
SEAL_GATHER_BYTES = 16 << 20


@dataclass(frozen=True)
class WriterSettings:
    location: str
    broker: str = DEFAULT_BROKER  # whose commitlog this is: the tier keeps its queues, metadata and rows apart
    segment_bytes: int = 128 << 20
    segment_messages: int = 1_000_000
    segment_age_s: float = 600.0
    retention: Retention = field(default_factory=Retention)
    fold_every: int = 200  # commit records between folds
    fold_bytes: int = 8 << 20  # or this many bytes of records, whichever comes first
    delete_grace_s: float = 60.0  # retired objects stay readable this long
    delete_batch: int = 500  # retired objects deleted per maintenance call, at most
    sweep_batch: int = 2000  # queues looked at for retention per maintenance call, at most
    copies: CopySettings | None = None  # the stagers' local copies, deleted with their objects


@dataclass
class Committed:
    """What one batch commit made visible."""

    rows: int = 0
    bytes: int = 0
    objects: int = 0
    source_end: int | None = None
    max_store_ts: int | None = None


class TierWriter:
    """Commits, seals, expires, retires and folds one broker's part of a tier.  Not thread-safe:
    the caller serializes calls (the tiering query holds its lock around each batch)."""

    def __init__(self, settings: WriterSettings, index: TierIndex, backend: Backend | None = None, tables=None):
        self.settings = settings
        self.tables = tables  # connectors.tables.MessageTables: kept in step by maintain(), if set
        self.backend = backend or open_backend(settings.location, copies=settings.copies)
        if tables is not None:
            tables.states = index
            tables._backend = tables._backend or self.backend
        self.log = TierLog(self.backend, settings.broker)
        self.index = index
        self.head = self.log.open_head()
        self.uploads: list[tuple[str, float]] = []  # (kind, seconds) per object written, until taken
        self._sweep: list[tuple[str, int]] = []  # queues the current retention sweep has yet to look at
        self._warned_holds: set[str] = set()  # topics whose retention waits on the KV view, said once each
        self._swept_at = float("-inf")  # when the current sweep began
        self.reconcile()

    @property
    def source_end(self) -> int | None:
        return self.head.source_end

    def reconcile(self) -> None:
        """Bring the index up to the tier's commit log (a crash can leave it one record behind)."""
        meta_seq, head = self.index.last_seq(), self.head
        if meta_seq > head.seq:
            raise TierlogError(
                f"the metadata store ({self.index.path}) has commit record {meta_seq} but the tier "
                f"{self.settings.location} ends at {head.seq}: was the tier replaced? Run "
                "`tierlog tier rebuild-metadata` to rebuild the metadata from the tier"
            )
        if meta_seq == head.seq:
            return
        behind = [r for r in head.tail if r["seq"] > meta_seq]
        if not behind or behind[0]["seq"] != meta_seq + 1:  # the records it missed were folded
            log.warning("metadata store is at commit record %d, the tier's last root past it: rebuilding it from "
                        "the tier", meta_seq)
            self.index.rebuild(self.log.committed())
            return
        log.info("metadata store is at commit record %d, tier at %d: catching up", meta_seq, head.seq)
        now = time.time()
        for record in behind:
            self.index.apply(head, record, now)

    # ------------------------------------------------------------ commit

    def commit(self, batch_id: int, parts: list[StagedPart], gaps: Callable[[int, int], Gap] | None = None,
               lap: Callable[[str], None] = lambda phase: None) -> Committed | None:
        """Make ``parts`` (every staged range of one batch) visible with one commit record.

        ``gaps(start, end)`` says what lies between two parts, or between the tier's end and the
        first part; without it any gap is refused.  Returns None for a batch with nothing new (a
        replay).  ``lap(phase)`` is called after ``dispatch`` and ``commit``, for the batch's timing.
        """
        if not parts:
            return None
        parts = sorted(parts, key=lambda p: p.first_phy)
        gap_quarantined = self._check_contiguous(parts, batch_id, gaps)
        filtered: dict = {}
        for p in parts:
            add_counts(filtered, p.filtered)
        quarantined = gap_quarantined + [q for p in parts for q in p.quarantined]
        for q in quarantined:
            log.error("quarantined commitlog bytes %d-%d of %s: %s. They are skipped by every sink and listed by "
                      "`tierlog status`; restore them from a replica if they matter", q["start_phy"], q["end_phy"],
                      q["file"], q["reason"])
        crash_point("uploaded")
        self.uploads.extend(("staging", p.upload_s) for p in parts if p.name)
        now_ms = int(time.time() * 1000)
        objects = [p.staging_object(now_ms) for p in parts if p.name]
        touched = {k for o in objects for k in o.queues}
        self.index.record_dispatch(
            {k: max(o.queues[k]["last"] + 1 for o in objects if k in o.queues) for k in touched}
        )
        lap("dispatch")
        crash_point("dispatched")
        # The tier's record says what the tier left out; the other sinks' counts go to their journal.
        own = {"tier": filtered.pop("tier")} if "tier" in filtered else None
        record = batch_record(batch_id, parts[0].first_phy, parts[-1].end_phy, [o.to_json() for o in objects],
                              parts[-1].last_record, quarantined, own)
        self.log.append(self.head, record)
        crash_point("logged")
        self.index.apply(self.head, record, time.time(), counted=filtered)
        lap("commit")
        crash_point("committed")
        return Committed(rows=sum(p.rows for p in parts), bytes=sum(p.bytes for p in parts), objects=len(objects),
                         source_end=self.head.source_end,
                         max_store_ts=max((s["max_ts"] for o in objects for s in o.queues.values()), default=None))

    def _check_contiguous(self, parts: list[StagedPart], batch_id: int, gaps) -> list[dict]:
        """Each part must start where the tier (or the previous part) ended, blank markers and
        quarantined records aside; returns the corrupt ranges found in the gaps."""
        expected, quarantined = self.head.source_end, []
        for part in parts:
            if expected is not None and part.first_phy != expected:
                gap = gaps(expected, part.first_phy) if gaps else Gap("an unread range", [])
                if gap.skipped:
                    raise SkippedMessagesError(
                        f"batch {batch_id} would tier commitlog bytes from physical offset {part.first_phy}, "
                        f"but the tier {self.settings.location} has committed up to {expected}: {gap.skipped} "
                        "in between would be skipped. Was the commitlog truncated, or startingOffset moved? "
                        "Restore the missing commitlog files, or start a new tier location."
                    )
                quarantined.extend(gap.quarantined)
            expected = part.end_phy
        return quarantined

    # ------------------------------------------------------------ maintenance

    def maintain(self, now_ms: int | None = None) -> int:
        """Seal due queues, expire old segments, keep the tables in step, delete retired objects,
        fold the log; returns the segments sealed.  Each step is bounded (see the module's docstring)."""
        now_ms = now_ms or int(time.time() * 1000)
        seals = self.finish_seal(self.build_seal(self.plan_seal(now_ms)), now_ms)
        self.sync_tables(self.table_view())
        self.finish_maintenance(now_ms)
        return seals

    # A maintenance in five calls, so that a caller with a lock around the writer can let commits go
    # on while a seal reads its staging objects and writes its segments (``build_seal``) and while the
    # tables read rows and commit (``sync_tables``), neither of which touches the writer's state: on a
    # quiet broker every queue seals by age at once, reading hundreds of staging objects, and the
    # batches of those seconds waited for it (docs/benchmarks.md, "the seals of a quiet broker").
    # The caller holds its lock for ``plan_seal``, ``finish_seal`` with ``table_view``, and
    # ``finish_maintenance``.

    def plan_seal(self, now_ms: int) -> "SealPlan":
        """What a maintenance at ``now_ms`` seals: the queues due, where each is sealed up to, and
        the staging objects holding their rows."""
        keys = self.due_for_sealing(now_ms)
        holding = sorted({o.name: o for k in keys for o in self.head.staging_for(k)}.values(), key=lambda o: o.first_phy)
        return SealPlan(keys, {k: self.head.queues[k].sealed for k in keys}, holding)

    def build_seal(self, plan: "SealPlan") -> "BuiltSeal":
        """Read the plan's staging objects and write one segment and key index per queue; commits
        may run meanwhile (they add objects, which the plan does not hold, and seal nothing)."""
        built = BuiltSeal(plan, [], [])
        if not plan.keys:
            return built
        parts: dict[tuple[str, int], list[pa.Table]] = {k: [] for k in plan.keys}
        group: list[pa.Table] = []  # consecutive staging objects, filtered and gathered by queue together
        grouped = 0

        def gather() -> None:
            for key, piece in layout.unsealed_by_queue(group, plan.sealed_at).items():
                parts[key].append(piece)
            group.clear()

        for obj in plan.holding:
            group.append(layout.from_parquet(self.backend.read_whole(obj.name)))
            grouped += group[-1].nbytes
            if grouped >= SEAL_GATHER_BYTES:
                gather()
                grouped = 0
        gather()
        built.segments.extend(seg for key, pieces in parts.items() if (seg := self._write_segment(key, pieces, built.uploads)))
        return built

    def finish_seal(self, built: "BuiltSeal", now_ms: int) -> int:
        """Commit a built seal, then expire; returns the segments sealed.  ``now_ms`` is this call's
        clock (a seal built for seconds retires its staging objects now, not when it was planned)."""
        seals = self._commit_seal(built, now_ms)
        self.expire(now_ms, built.plan.keys)
        return seals

    def finish_maintenance(self, now_ms: int) -> None:
        """Delete and fold, as ``maintain`` does after the tables' round."""
        self.delete_due(now_ms)
        if len(self.head.tail) >= self.settings.fold_every or self.head.tail_bytes >= self.settings.fold_bytes:
            self.fold(now_ms)

    def table_view(self) -> "TierView | None":
        """What the tables' next round sees of the tier now (None without tables): taken under the
        caller's lock, read by ``sync_tables`` without it."""
        if self.tables is None:
            return None
        from connectors.tables.fresh import QueueNow
        from connectors.tables.view import TierView

        head = self.head
        return TierView(head.seq, time.time(), {k: QueueNow(s.commit, s.sealed, s.low) for k, s in head.queues.items()},
                        sorted(head.staging.values(), key=lambda o: o.first_phy), list(head.tail),
                        self.index.oldest_segments)

    def sync_tables(self, view: "TierView | None", hold: bool = True) -> bool:
        """One round of the tables at ``view``; whether they hold every row it has.  A catalog that
        fails is logged and waited out: tiering goes on, and deletes wait for the tables."""
        if view is None:
            return True
        try:
            return self.tables.sync(view, hold=hold)
        except Exception as exc:  # a catalog that is away must not stop tiering
            log.warning("the Iceberg tables are behind tier record %d (%s: %s); the tier goes on and deletes "
                        "wait until the tables catch up", view.seq, type(exc).__name__, exc)
            return False

    def delete_due(self, now_ms: int) -> None:
        """``delete_retired``, of what was retired before the tables last held every row (an
        expired segment's object goes only once no table lists it, a staging object only once the
        tables hold its rows)."""
        if self.tables is None:
            self.delete_retired(now_ms)
        elif self.tables.synced_at is not None:
            self.delete_retired(now_ms, before=self.tables.synced_at)

    def settle_tables(self, seconds: float = 30.0) -> None:
        """On a clean stop: rounds of the tables without holding anything back, a reconciliation
        included, until they hold every committed row (for at most ``seconds``), so a run that stops
        caught up leaves them so.  A catalog that fails ends it at once."""
        if self.tables is None:
            return
        deadline, behind = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            if self.sync_tables(self.table_view(), hold=False):
                return
            now = sum(n for n, _s in self.tables.lag().values())
            if not self.tables.reconciling and behind is not None and now >= behind:
                return  # no progress: a catalog that fails, and the next process takes it up
            behind = now

    def _segments(self) -> Iterator[Segment]:
        for key in sorted(self.head.queues):
            yield from self.index.oldest_segments(*key)

    def _topics(self) -> set[str]:
        return {topic for topic, _ in self.head.queues}

    def _topic_segments(self, topic: str) -> Iterator[Segment]:
        for key in sorted(k for k in self.head.queues if k[0] == topic):
            yield from self.index.oldest_segments(*key)

    def fold(self, now_ms: int | None = None) -> None:
        """Fold the records since the last root into manifests; what it replaced is deleted after the
        grace, counted from ``now_ms`` (a maintain's clock, which ``delete_retired`` compares with)."""
        if not self.head.tail:
            return
        garbage = self.log.fold(self.head, before_root=lambda: crash_point("fold_written"))
        crash_point("folded")
        if garbage:
            retired = time.time() if now_ms is None else now_ms / 1000
            self.index.schedule_deletes({n: retired for n in garbage})

    def due_for_sealing(self, now_ms: int) -> list[tuple[str, int]]:
        s = self.settings
        due = []
        for key, (rows, nbytes, oldest) in self.head.unsealed_totals().items():
            if rows >= s.segment_messages or nbytes >= s.segment_bytes or now_ms - oldest >= s.segment_age_s * 1000:
                due.append(key)
        return sorted(due)

    def _commit_seal(self, built: "BuiltSeal", now_ms: int) -> int:
        """The seal record of a built seal, retiring the staging objects no queue needs any more."""
        self.uploads.extend(built.uploads)
        if not built.plan.keys:
            return 0
        holding, segments = built.plan.holding, built.segments
        sealed_after = {(s.topic, s.queue_id): s.end + 1 for s in segments}
        retire = [
            o.name for o in holding
            if all(st["last"] < sealed_after.get(k, self.head.queues[k].sealed) for k, st in o.queues.items())
        ]
        record = seal_record([s.to_json() for s in segments], retire)
        self.log.append(self.head, record)
        crash_point("sealed")
        # Retired at the caller's clock, which delete_retired compares with (as expire() does): at
        # time.time() the retirement was later than now_ms, so with no grace the same call left the
        # objects, and a run whose last maintenance sealed stopped with them (a CI failure).
        self.index.apply(self.head, record, now_ms / 1000)
        return len(segments)

    def _write_segment(self, key: tuple[str, int], pieces: list[pa.Table], uploads: list) -> Segment | None:
        table = pa.concat_tables(pieces).combine_chunks()  # a chunk per staging object would write as many pages
        offsets = table["queue_offset"].to_numpy()
        if len(offsets) > 1 and not (offsets[1:] >= offsets[:-1]).all():  # pieces come in offset order
            table = table.sort_by("queue_offset")
        if table.num_rows == 0:
            return None
        topic, q = key
        base, end = table["queue_offset"][0].as_py(), table["queue_offset"][-1].as_py()
        data = layout.to_parquet(table)
        name = self.log.names.segment(topic, q, base)
        _timed_put(self.backend, uploads, "segment", name, data)
        keys = self.log.names.key_index(topic, q, base)
        _timed_put(self.backend, uploads, "key_index", keys, layout.key_index(table))
        crash_point("seal_uploaded")
        ts = table["store_ts"]
        return Segment(name, topic, q, base, end, table.num_rows, len(data), _ms(pc.min(ts)), _ms(pc.max(ts)), keys)

    def expire(self, now_ms: int, sealed: list[tuple[str, int]] = ()) -> None:
        """Retention: drop each queue's oldest segments past its topic's limits.  The queues just
        sealed are checked every time; every queue once per ``retention.check_s``, at most
        ``sweep_batch`` of them per call."""
        retention = self.settings.retention
        if not retention:
            return
        keys = set(sealed)
        if not self._sweep and time.monotonic() - self._swept_at >= retention.check_s:
            self._sweep = sorted(self.head.queues, reverse=True)  # popped from the end: name order
            self._swept_at = time.monotonic()
        for _ in range(min(len(self._sweep), self.settings.sweep_batch)):
            keys.add(self._sweep.pop())
        expired, holds = [], self.index.retention_holds()
        for key in sorted(keys):
            if key in self.head.queues:
                if key[0] in holds:
                    self._held_by_view(key[0])
                    continue
                # A segment whose rows a table's fresh file still holds stays until the file goes (at
                # most about tier.segment_age_s): no table ever lists a row retention dropped.
                table_holds = self.tables.holds(*key) if self.tables is not None else None
                expired.extend(s for s in retention.expired(key[0], self.head.queues[key],
                                                            self.index.oldest_segments(*key), now_ms)
                               if table_holds is None or s.end < table_holds)
        if not expired:
            return
        record = expire_record([seg.to_json() for seg in expired])
        self.log.append(self.head, record)
        # Retired at this maintain's own clock, which delete_retired compares with: time.time() here
        # could be later than the next maintain's whole-millisecond now_ms, so with no grace the next
        # call left the objects (a flaky test_retention_expires_old_segments).  fold() does the same.
        self.index.apply(self.head, record, now_ms / 1000)

    def _held_by_view(self, topic: str) -> None:
        if topic not in self._warned_holds:
            self._warned_holds.add(topic)
            log.warning("the tier keeps every segment of topic %s for now, past its retention: the KV view keeps "
                        "values of it in the tier, and takes them into itself when `tierlog run` next starts; then "
                        "the retention applies", topic)

    def delete_retired(self, now_ms: int, before: float | None = None) -> None:
        """Delete objects retired more than ``delete_grace_s`` ago (readers still on them had time),
        at most ``delete_batch`` of them; with ``before``, only those retired before it.  A staging
        object a consumer of the tier has yet to read (at or above ``index.held_from()``) waits until
        it has."""
        due, held = [], self.index.held_from()
        for name, when in self.index.pending_deletes().items():
            if held is not None and self._staged_from(name) >= held:
                continue
            if before is not None and when > before:
                continue
            if now_ms / 1000 - when >= self.settings.delete_grace_s:
                due.append(name)
                if len(due) >= self.settings.delete_batch:
                    break
        for name in due:
            self.backend.delete(name)
        if due:
            self.index.forget_deletes(due)

    def _staged_from(self, name: str) -> int:
        """The first physical offset of a staging object of this broker (its name says it); -1 for
        any other object."""
        prefix = self.log.names.staging_prefix
        stem = name[len(prefix):].removesuffix(".parquet")
        return int(stem) if name.startswith(prefix) and stem.isdigit() else -1

    def close(self) -> None:
        self.backend.close()


def _ms(scalar) -> int:
    return int(scalar.as_py().timestamp() * 1000)


def _timed_put(backend: Backend, uploads: list, kind: str, name: str, data: bytes) -> None:
    started = time.monotonic()
    backend.put(name, data)
    uploads.append((kind, time.monotonic() - started))


@dataclass(frozen=True)
class SealPlan:
    """The queues a seal takes, where each is sealed up to now, and the staging objects holding their
    unsealed rows, oldest first."""

    keys: list[tuple[str, int]]
    sealed_at: dict[tuple[str, int], int]
    holding: list  # connectors.tier.log.StagingObject


@dataclass
class BuiltSeal:
    """A seal's segments, written and not yet committed, and the uploads that wrote them."""

    plan: SealPlan
    segments: list[Segment]
    uploads: list[tuple[str, float]]
