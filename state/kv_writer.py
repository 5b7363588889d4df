"""The KV writer: a micro-batch's changed keys -> the KV view, the changelog, compacted snapshots.

No engine in it: the compaction query (``streaming.queries.compaction.handler``) hands it each batch's changed keys
as Arrow (``CHANGE_REF``: topic, key, the physical offset of its latest message) and the offset the
batch ends at; a test, a benchmark or an offline tool can do the same.  Per batch (``apply``):

1. read the changed keys' latest messages by physical offset (body, queue offset, store time, put
   or delete): ``resolve``, from the tier's committed batch in the service
   (``connectors.tier.feed.FeedMessages``), from the commitlog where no tier is (a test, a tool);
   a large value the view keeps as a reference into the tier (``state.kv_refs``) is not read at
   all, unless the changelog sends it;
2. send them to the changelog first, when Kafka is on (a crash in between sends again, never loses);
3. apply them to the KV view in one durable WriteBatch with the batch's end offset;
4. expire keys whose time to live has passed, record the ``kv`` (and ``changelog``) sink's
   applied offset (it bounds the safepoint), and write a compacted snapshot when one is due.

Replays are no-ops: the view takes a change only if it is newer (by physical offset) than what it
holds, so a batch applied again after a crash changes nothing twice.  ``catch_up`` closes the gap
at start between what the query committed and what the view applied, from the same messages (the
tier keeps the batches the view has not applied), with the same latest-wins rule.

Not thread-safe but for ``resolve``: one thread applies, sweeps and snapshots (the handler's apply
thread), while another may resolve the next batch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.changes import CHANGE_REF, CHANGE_ROW
from connectors.commitlog.reader import ReaderOptions
from connectors.errors import ConfigError, TierlogError
from connectors.faults import crash_point
from connectors.sinks import CHANGELOG, KV
from connectors.tier import snapshots
from connectors.tier.location import open_backend
from state.kv import Change, KVView
from state.kv_refs import ReferencePolicy

log = logging.getLogger("tierlog.compaction")


@dataclass(frozen=True)
class CompactionSettings:
    reader: ReaderOptions  # its broker names the snapshots too: each broker's tierlog keeps its own keys
    tier_location: str
    ttl: dict[str, float] | None = None  # topic -> seconds; "*" for every other topic
    snapshot_interval_s: float = 30.0  # 0: only on demand
    snapshot_keep: int = 2
    topics: object = None  # the TopicFilter of [topics] compaction; None takes every topic
    tables: object = None  # TableSettings: each snapshot is committed to the latest-per-key tables; None: off
    # Which values the view keeps as references into the tier (the service's); none by default, and
    # never when the writer reads the commitlog (a test, a tool): those messages may not be in the tier.
    references: ReferencePolicy = field(default_factory=ReferencePolicy)


@dataclass
class CompactionReport:
    batch_id: int
    changes: int  # changed keys the batch emitted
    applied: int  # of which the view took (fewer on a replay)
    expired: int
    source_end: int
    seconds: float
    snapshot_rows: int | None = None
    phases: dict = field(default_factory=dict)


# What the KV view needs of each changed key's latest message, read from the commitlog.
RECORD_COLUMNS = ("queue_id", "queue_offset", "store_ts", "op", "body")
# The same without the body, with the stored size that decides whether the view keeps a reference.
HEAD_COLUMNS = ("queue_id", "queue_offset", "store_ts", "op", "size")


def resolve(changes: pa.Table, reader, references: ReferencePolicy | None = None) -> pa.Table:
    """Changed keys (``CHANGE_REF``) with their latest message's fields: ``CHANGE_ROW``s, for
    ``KVView.apply_table`` and the changelog; ``reader``: a ``CommitLogReader`` or ``FeedMessages``.
    With ``references``, also ``referenced``: whether the view keeps the value as a reference (its
    body is not read: null), and ``size``, the message's stored size."""
    # The rows come in the order the reader stores them, and the changed keys are put in that
    # order: the keys are a few bytes a row, the bodies hundreds of MB a batch (records_as_stored).
    columns = RECORD_COLUMNS if not references else HEAD_COLUMNS
    records, at = reader.records_as_stored(changes["phy_offset"].to_numpy(), columns)
    table = changes.select(list(CHANGE_REF)).take(pa.array(at))
    for name in ("queue_id", "queue_offset", "store_ts"):
        table = table.append_column(name, records[name])
    table = table.append_column("deleted", pc.equal(records["op"], "delete"))
    if not references:
        return table.append_column("body", records["body"]).select(list(CHANGE_ROW))
    referenced = references.mask(table["topic"], records["size"], table["deleted"])
    body = _bodies_of(table, reader, ~referenced & ~table["deleted"].to_numpy(zero_copy_only=False))
    return table.append_column("body", body).select(list(CHANGE_ROW)).append_column(
        "referenced", pa.array(referenced)).append_column("size", records["size"])


def _bodies_of(table: pa.Table, reader, wanted: np.ndarray) -> pa.Array:
    """A body column for ``table``: the bodies of the rows ``wanted`` read (a second, narrower read of
    the same objects: values the view keeps whole beside those it references), null elsewhere."""
    if not wanted.any():
        return pa.nulls(table.num_rows, pa.binary())
    read = reader.records_at(table["phy_offset"].filter(pa.array(wanted)).to_numpy(), ["body"])["body"]
    at = np.full(table.num_rows, -1, np.int64)
    at[wanted] = np.arange(int(wanted.sum()))
    return read.take(pa.array(at, mask=at < 0))


def retained_topics(topics, retention) -> list[str]:
    """Of ``topics`` (that the KV view references), those a tier retention (``retention``) could drop
    values of, sorted: what ``take_inline_where_retained`` takes in."""
    return sorted(t for t in topics if not retention.keeps_forever(t))


def take_inline_where_retained(kv: KVView, journal, retention) -> None:
    """Take into ``kv`` every value it keeps in the tier of a topic whose tier retention
    (``tier.retention*``, ``retention``) could drop it (set since the view took it), then let that
    retention go on: until then the tier keeps those topics' segments (``SinkJournal.references``,
    ``journal``; None: a view without the service's metadata store).  The compaction query's start
    does it, and a service start with compaction off, where no query would."""
    for topic in retained_topics(kv.referenced_topics(), retention):
        log.info("topic %s has a tier retention now: the KV view reads the values it kept in the tier into "
                 "itself first", topic)
        moved = kv.take_inline(topic, progress=log.info)
        log.info("topic %s: the KV view took %d value(s) from the tier; its tier retention applies from now on",
                 topic, moved)
    if journal is not None and journal.references() != kv.referenced_topics():
        journal.record_references(kv.referenced_topics())


class KVWriter:
    """Applies changed keys to the KV view (and the changelog), expires keys, records the sinks
    and writes compacted snapshots; see the module docstring."""

    def __init__(self, settings: CompactionSettings, kv: KVView, metadata=None, changelog=None, messages=None):
        self.settings = settings
        self.kv = kv
        self.metadata = metadata  # a state.metadata.MetadataStore, or None (no sink is recorded)
        self.changelog = changelog  # a connectors.kafka.changelog.ChangelogSink, or None
        self.key_property = settings.reader.key_property
        # Where a changed key's message is read: the tier's committed batches (``FeedMessages``), or
        # the commitlog.  The stager checked every body's CRC on its way to the tier; reading one
        # again here by its offset does not check it twice.
        self._messages = messages if messages is not None else settings.reader.open(check_crc=False)
        # References only to messages read from the tier: one read from the commitlog may not be there.
        self.references = settings.references if messages is not None else ReferencePolicy()
        self._last_snapshot = self._last_snapshot_time()
        self._tables = None  # LatestTables, opened at the first snapshot (pyiceberg loads only then)
        # Topics whose keys changed since their last snapshot, and when they first did: only they are
        # written again.  None: every topic (``_changed_before``).
        self._changed: dict[str, float] | None = self._changed_before()

    def catch_up(self, committed: int | None) -> int:
        """Replay what the query committed (through ``committed``, where its last committed batch
        ends) but the view (or the changelog) has not applied; returns messages replayed into the view.
        First, the values the view keeps in the tier of a topic whose tier retention could now drop
        them are taken into the view (``take_inline_where_retained``)."""
        from state.replay import replay_messages

        self.take_inline_where_retained()
        applied = self.kv.applied_through()
        if self.changelog is not None:
            self._catch_up_changelog(applied, committed)
        if committed is None or (applied is not None and applied >= committed):
            return 0
        start = self._messages.first_offset() if applied is None else applied
        count = replay_messages(self.kv, self._messages, start, committed, self.key_property, self.settings.topics)
        self.kv.apply([], applied_through=committed)
        self._record_sink(KV, committed)
        log.info("the KV view was behind the compaction checkpoint: replayed %d message(s) from physical "
                 "offset %d to %d", count, start, committed)
        return count

    def _catch_up_changelog(self, applied: int | None, committed: int | None) -> None:
        """Bring the changelog to the query's last commit.  A changelog new to a view that has data
        starts from the view's keys, so its compacted topic holds every live key.  One that was
        off for a while also gets the tombstones of what the view deleted or expired meanwhile."""
        from state.replay import latest_changes

        sent_through = self.metadata.journal.sinks().get(CHANGELOG) if self.metadata is not None else None
        new = sent_through is None
        again = not new and applied is not None and sent_through < self._messages.first_offset()
        if again:  # what it missed is no longer there to read
            log.info("changelog: its last record (physical offset %d) is older than what is left to read from; it "
                     "starts again from the KV view", sent_through)
            sent_through = None
        if sent_through is None and applied is not None:
            rows = sorted(self.kv.latest_rows(tombstones=again), key=lambda row: row[2])
            self.changelog.publish_rows(rows)  # a partition that holds a row's position skips it
            live = sum(not row[6] for row in rows)
            log.info("changelog: started from the KV view's %d live key(s) and %d tombstone(s)", live, len(rows) - live)
            sent_through = applied
            self._record_sink(CHANGELOG, applied)
        if sent_through is not None:
            self.changelog.floor = sent_through - 1
        if committed is not None:
            start = self._messages.first_offset() if sent_through is None else sent_through
            if start < committed:
                changes = latest_changes(self._messages, start, committed, self.key_property, self.settings.topics)
                self.changelog.publish(changes)
                log.info("changelog: caught up %d changed key(s) from physical offset %d to %d", changes.num_rows,
                         start, committed)
            self._record_sink(CHANGELOG, max(start, committed))
        if applied is not None:  # after the replay: a key put again and then expired ends deleted
            self._send_unsent_expiries(applied, send=not new)

    def _send_unsent_expiries(self, applied: int, send: bool) -> None:
        """Keys that expired while the changelog was off: a replay of the messages cannot find them
        (an expiry has no message), so their tombstones go now, as expiries; a changelog new to
        the view never held those keys, and takes none.  Marked sent after, so a crash in between
        sends them again (a tombstone twice is still one delete in a compacted topic)."""
        unsent = self.kv.unsent_expiries()
        if not unsent:
            return
        if send:
            self.changelog.expire(unsent, applied)
            log.info("changelog: sent the tombstones of %d key(s) that expired while it was off", len(unsent))
        self.kv.mark_expiries_sent(unsent)

    def resolve(self, changes: pa.Table) -> pa.Table:
        """The messages of a batch's changed keys (``resolve``).  It only reads, so it may run on
        another thread while this writer applies the batch before (the compaction handler's
        resolve thread).  The values the view keeps in the tier are not read: the changelog reads
        those it sends itself, a slice at a time (``ChangelogSink.publish``)."""
        return resolve(changes, self._messages, self.references)

    def _read_bodies(self, phy_offsets: np.ndarray) -> pa.ChunkedArray:
        """The bodies of the messages at ``phy_offsets``, in that order: for the changelog."""
        return self._messages.records_at(phy_offsets, ["body"])["body"]

    def take_inline_where_retained(self) -> None:
        """``take_inline_where_retained`` for this writer's view, by its settings' retention."""
        take_inline_where_retained(self.kv, self.metadata.journal if self.metadata is not None else None,
                                   self.settings.references.retention)

    def _hold_retention(self, table: pa.Table) -> None:
        """Before the view keeps a topic's first value in the tier: the tier's retention waits on it."""
        if self.metadata is None or "referenced" not in table.column_names:
            return
        topics = set(table["topic"].filter(table["referenced"]).unique().to_pylist())
        if topics - self.kv.referenced_topics():
            self.metadata.journal.record_references(self.kv.referenced_topics() | topics)

    def apply(self, batch_id: int, changes: pa.Table, end: int, collect_s: float = 0.0,
              resolved: tuple[pa.Table, float] | None = None) -> CompactionReport:
        """Apply one batch's changed keys (``CHANGE_REF``) that ends at physical offset ``end``;
        ``resolved``: their messages (``resolve``) and the seconds that took, when already read."""
        t0 = time.monotonic()
        if resolved is None:
            resolved = resolve(changes, self._messages), time.monotonic() - t0
        table, resolve_s = resolved
        t1 = time.monotonic()
        if self.changelog is not None:  # before the view: a crash in between re-sends, never loses
            self.changelog.publish(table, self._read_bodies)
            crash_point("changelogged")
        t2 = time.monotonic()
        self._hold_retention(table)
        referenced = table["referenced"].to_numpy(zero_copy_only=False) if "referenced" in table.column_names else None
        applied = self.kv.apply_table(table, applied_through=end, referenced=referenced)
        crash_point("kv_applied")
        if self._changed is not None and table.num_rows:
            self._touched(pc.unique(table.column("topic")).to_pylist())
        expired = self.expire()
        self._record_sink(KV, end)
        if self.changelog is not None:
            self._record_sink(CHANGELOG, end)
            self.changelog.floor = end - 1
        t3 = time.monotonic()
        snapshot_rows = self.maybe_snapshot(end)
        return CompactionReport(
            batch_id, changes.num_rows, applied, len(expired), end,
            collect_s + resolve_s + time.monotonic() - t1, snapshot_rows,
            {"collect": round(collect_s, 3), "resolve": round(resolve_s, 3), "changelog": round(t2 - t1, 3),
             "apply": round(t3 - t2, 3)},
        )

    def _record_sink(self, name: str, end: int) -> None:
        if self.metadata is not None:
            self.metadata.journal.record_sink(name, end)

    def expire(self) -> list[Change]:
        """Forget the keys past their topic's time to live (tombstones to the changelog first)."""
        if not self.settings.ttl:
            return []
        tombstones = None
        if self.changelog is not None:  # sent before the view forgets the keys
            applied = self.kv.applied_through()
            tombstones = lambda changes: self.changelog.expire(changes, applied)  # noqa: E731
        expired = self.kv.expire(int(time.time() * 1000), before_write=tombstones)
        if expired:
            log.info("expired %d key(s) past their time to live", len(expired))
            if self._changed is not None:
                self._touched({c.topic for c in expired})
        return expired

    def close(self) -> None:
        try:
            self._messages.close()
        finally:
            if self.changelog is not None:
                self.changelog.close()

    # ------------------------------------------------------------ snapshots

    def _last_snapshot_time(self) -> float:
        """When the last snapshot was written; for a view that has none, when a service first
        started on it.  So the first snapshot comes an interval in, not at the first batch of a
        view still catching up (a full snapshot there held the apply thread, and the next batch,
        for seconds), and restarts do not put it off."""
        raw = self.kv.meta("snapshot") or self.kv.meta("snapshot_clock")
        if raw:
            return json.loads(raw)["at"]
        now = time.time()
        if self.settings.snapshot_interval_s > 0:
            self.kv.put_meta("snapshot_clock", json.dumps({"at": now}))
        return now

    def _changed_before(self) -> dict[str, float] | None:
        """What changed before this process: the topics the last snapshot round left for the next,
        if the view applied nothing since it; else (or with no snapshot yet) every topic."""
        raw = self.kv.meta("snapshot")
        last = json.loads(raw) if raw else {}
        applied = self.kv.applied_through()
        if last.get("through_phy") is None or (applied is not None and applied > last["through_phy"]):
            return None
        return {topic: last["at"] for topic in last.get("deferred", ())}

    def _touched(self, topics) -> None:
        now = time.time()
        for topic in topics:
            self._changed.setdefault(topic, now)

    def snapshot_due(self) -> bool:
        """Whether the interval is up and a topic changed since its last snapshot (or this process
        wrote none yet)."""
        interval = self.settings.snapshot_interval_s
        return interval > 0 and time.time() - self._last_snapshot >= interval and self._changed != {}

    def maybe_snapshot(self, through_phy: int | None = None) -> int | None:
        """A snapshot through ``through_phy`` (what the view applied, by default) of the topics whose
        keys changed since their last one, once due: none when nothing changed (a quiet topic's
        newest snapshot still stands as of now).  After each batch, and between batches (the last
        changes before a quiet spell reach the tables too).  With the latest-per-key tables on, each
        topic's snapshot is a table commit, so a round takes at most half the tables' request
        budget's share of the interval (``tables.commits_per_minute``), the topics that changed
        first first; the others wait for the next."""
        if not self.snapshot_due():
            return None
        return self._snapshot(through_phy, self.settings.snapshot_interval_s)

    def snapshot_changed(self) -> int | None:
        """A snapshot of every topic that changed since its last one, now, whatever the interval and
        the budget: at the end of ``tierlog run --until-caught-up``, so the latest-per-key tables
        then hold what the view holds."""
        if self.settings.snapshot_interval_s <= 0 or self._changed == {}:
            return None
        return self._snapshot(None, None)

    def _snapshot(self, through_phy: int | None, interval: float | None) -> int | None:
        """Write the changed topics' snapshots; ``interval``: the round's share of the budget, or None: no cap."""
        through_phy = self.kv.applied_through() if through_phy is None else through_phy
        if through_phy is None:
            return None
        if self.settings.tables is not None and self._tables is None:
            self._tables = open_latest_tables(self.settings.tables, self.settings.tier_location,
                                              self.settings.reader.broker)
        topics = None
        if self._changed is not None:
            by_age = sorted(self._changed, key=lambda t: (self._changed[t], t))
            if self.settings.tables is not None and interval is not None:
                by_age = by_age[:max(1, int(self.settings.tables.commits_per_minute * interval / 120))]
            topics = set(by_age)
        left = {} if topics is None else {t: at for t, at in self._changed.items() if t not in topics}
        rows = write_snapshot(self.kv, self.settings.tier_location, self.settings.reader.broker, through_phy,
                              self.settings.snapshot_keep, self._tables, topics=topics, deferred=sorted(left))
        self._changed = left
        self._last_snapshot = time.time()
        return rows


def _snapshotted(topic: str, rows: int, through: int) -> None:
    log.info("snapshot of %s: %d key(s) through physical offset %d", topic, rows, through)
    crash_point("snapshotted")


def open_latest_tables(settings, tier_location: str, broker: str):
    """The latest-per-key tables, or None when their catalog is away: this snapshot goes on
    without them, and the next one tries again."""
    from connectors.tables.latest import LatestTables

    try:
        return LatestTables(settings, tier_location, broker)
    except ConfigError:
        raise
    except Exception as exc:
        log.warning("the latest-per-key tables missed a snapshot: their catalog %s could not be opened (%s: %s); "
                    "the next snapshot tries again", settings.catalog_uri, type(exc).__name__, exc)
        return None


def write_snapshot(kv: KVView, tier_location: str, broker: str, through_phy: int | None = None, keep: int = 2,
                   tables=None, topics: set[str] | None = None, deferred: list[str] = ()) -> int:
    """Write every topic's live keys from ``kv`` (``broker``'s; of ``topics`` only, if given) to the
    tier, and commit them to ``tables`` (``LatestTables``) if given; returns the rows written.
    ``deferred``: the changed topics this round leaves for the next, recorded with it for a new
    process (``KVWriter._changed_before``)."""
    through = kv.applied_through() if through_phy is None else through_phy
    if through is None:
        raise TierlogError("the KV view has applied nothing yet: there is nothing to snapshot")
    t0 = time.monotonic()
    backend = open_backend(tier_location)
    try:
        times: dict[str, int] = {}
        written = snapshots.write_snapshots(
            backend, broker, kv.entries(times, bodies=False, topics=topics), through, keep=keep,
            on_topic=lambda topic, n: _snapshotted(topic, n, through), tables=tables, times=times,
            values=kv.values_of,
        )
    finally:
        backend.close()
    if not kv.read_only:
        kv.put_meta("snapshot", json.dumps({"at": time.time(), "through_phy": through, "deferred": list(deferred)}))
    total = sum(written.values())
    log.info("compacted snapshot: %d topic(s), %d key(s) in %.1f s", len(written), total, time.monotonic() - t0)
    return total
