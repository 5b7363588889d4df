"""A key's value at any moment, and its changes over a window, from the tier alone: object storage,
no local state, so any machine that can read the tier can ask.

The value of a key at time T is its last change (by physical offset, the broker's order) among its
messages stored at or before T: a put gives the value, a delete (``KV_OP=DELETE``) or a time to live
passed (the topic's ``compaction.ttl``) leaves the key absent, and the answer says which.

How it is found, per broker (physical offsets are each broker's own):

1. the newest compacted snapshot of the topic that stands as of T or before: its ``THROUGH_TS``
   (the newest store time of any change it reflects) is at or before T.  It holds the key's last
   change below its ``through_phy``, or says the key had none live there;
2. the key's changes in the tier from ``through_phy`` up to T, found through the sealed segments'
   key indexes (``TierReader.by_key``).  The tier must still hold every message of the topic from
   ``through_phy`` on: each queue's first retained message is at or below it (or the queue never
   lost one);
3. without such a snapshot, the key's whole history in the tier answers, where no queue of the topic
   has lost a message.  A topic with a time to live needs only the window ``(T - ttl, T]``: a change
   before it has expired by T, whatever it was.

A time that neither can answer is refused (``AsOfRefused``) naming the earliest one that can be:
this never guesses.  With several brokers (and none named), each broker's answer is found and the
one whose deciding change is newest by store time is the key's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from connectors.commitlog.arrow import dispatched_mask, epoch_ms_array
from connectors.tier import snapshots
from connectors.tier.errors import TierError
from connectors.tier.layout import read_where_equal
from connectors.tier.reader import TierReader
from connectors.tier.committed import CommittedTier

CHANGE_COLUMNS = ["phy_offset", "queue_id", "queue_offset", "store_ts", "op", "body", "broker"]


class AsOfRefused(TierError):
    """The tier (and its snapshots) cannot answer for that time: it says which times it can."""


@dataclass(frozen=True)
class AsOf:
    """The answer: ``state`` is ``live`` (``value`` holds the body), ``deleted``, ``expired`` or
    ``absent`` (no change of the key by then; or, where the tier no longer holds the key's whole
    history, none live in the snapshot: deleted or never set before it).  ``change`` is the change
    that decided it, as a ``history`` row (None for ``absent``); ``snapshot`` the snapshot the
    answer started from, if any."""

    topic: str
    key: str
    at_ms: int
    state: str
    value: bytes | None
    change: dict | None
    snapshot: str | None


class AsOfReader:
    """As-of reads over ``reader``'s brokers; ``ttl_ms``: the topics' times to live (``*`` for the
    rest), as the service's ``compaction.ttl``, so an expiry at T is told from a live value."""

    def __init__(self, reader: TierReader, ttl_ms: dict[str, int] | None = None):
        self.reader = reader
        self.ttl_ms = ttl_ms or {}
        self._firsts: dict[tuple, tuple[int, int] | None] = {}  # (broker, topic, queue, low) -> (phy, ts)
        self._held: list[CommittedTier] | None = None
        self._lists: dict[tuple[str, str], list[snapshots.Snapshot]] = {}  # (broker, topic) -> its snapshots
        self._times: dict[str, int | None] = {}  # snapshot name -> the moment it stands as of

    def ttl_of(self, topic: str) -> int | None:
        return self.ttl_ms.get(topic, self.ttl_ms.get("*"))

    def history(self, topic: str, key: str, from_ms: int | None = None, to_ms: int | None = None) -> list[dict]:
        """Every change of ``key`` the tier holds, stored in ``[from_ms, to_ms]``, broker by broker in
        physical order: store time (ms), broker, physical and queue offsets, op, body."""
        tables = [_dispatched(self.reader.by_key(topic, key, from_ms, to_ms, committed=v)) for v in self._committed_each(topic)]
        return [row for table in tables for row in _rows(table)]

    def get(self, topic: str, key: str, at_ms: int) -> AsOf:
        """The value ``key`` of ``topic`` had at ``at_ms`` (epoch ms).  Raises ``AsOfRefused`` when a
        broker's part of the tier cannot answer for that time, ``NotFoundInTier`` for a topic the tier
        does not hold."""
        answers, refusals = [], []
        for committed in self._committed_each(topic):
            try:
                answers.append(self._get(committed, topic, key, at_ms))
            except AsOfRefused as exc:
                refusals.append(exc)
        if refusals:
            raise refusals[0] if len(refusals) == 1 else AsOfRefused("; ".join(str(r) for r in refusals))
        decided = [a for a in answers if a.change is not None]
        if not decided:
            return answers[0]
        return max(decided, key=lambda a: a.change["store_ts"])

    def _committed_each(self, topic: str) -> list[CommittedTier]:
        """The committed tiers of the brokers holding ``topic``, taken at the first question: one reader
        answers from one state of the tier (make another for a newer one)."""
        if self._held is None:
            self._held = self.reader.committed_each()
        held = [v for v in self._held if v.queue_ids(topic) > 0]
        if not held:
            self.reader.require_topic(topic)  # raises, naming the topics there are
        return held

    # ------------------------------------------------------------ one broker

    def _get(self, committed: CommittedTier, topic: str, key: str, at_ms: int) -> AsOf:
        broker = committed.log.broker
        ttl = self.ttl_of(topic)
        lows = self._first_retained(committed, topic)
        whole = all(first is None for first in lows)  # no queue lost a message: the history is whole
        if ttl is not None:
            # A change at or before at_ms - ttl has expired by at_ms, so the window answers; snapshots do
            # not, as the KV view left out keys it expired when it wrote them, after at_ms perhaps.
            window_from = at_ms - ttl
            if not all(first is None or first[1] <= window_from for first in lows):
                earliest = max(first[1] for first in lows if first is not None) + ttl
                raise AsOfRefused(self._refusal(topic, broker, at_ms, earliest, f"its time to live ({ttl} ms)"))
            changes = self._changes(committed, topic, key, window_from + 1, at_ms)
            if not changes and whole:  # nothing live then: the history says whether it expired or never was
                changes = self._changes(committed, topic, key, None, at_ms)
            return self._answer(topic, key, at_ms, changes, None, None)
        base, snapshot, stands = None, None, None
        # Only snapshots the tier still holds everything after (their offset alone says so).
        usable = [snap for snap in self._listed(broker, topic)
                  if all(first is None or first[0] <= snap.through_phy for first in lows)]
        found = self._newest_by(usable, at_ms)
        if found is not None:
            snapshot, stands = found, self._time(found)
            base = self._snapshot_row(snapshot, key)
        elif not whole:
            times = [t for t in map(self._time, usable) if t is not None]
            raise AsOfRefused(self._refusal(topic, broker, at_ms, min(times) if times else None,
                                            "a compacted snapshot"))
        if snapshot is None:
            changes = self._changes(committed, topic, key, None, at_ms)
        else:
            # Store times follow physical order (the broker stamps them as it appends), so what follows
            # the snapshot was stored at or after the newest change it reflects.
            changes = self._changes(committed, topic, key, stands, at_ms, snapshot.through_phy)
            if base is None and not changes and whole:
                # Not live in the snapshot, which keeps no deletes: the history says deleted or never set.
                snapshot, changes = None, self._changes(committed, topic, key, None, at_ms)
        return self._answer(topic, key, at_ms, changes, base, None if snapshot is None else snapshot.name)

    def _newest_by(self, usable: list[snapshots.Snapshot], at_ms: int) -> snapshots.Snapshot | None:
        """The newest of ``usable`` (oldest first) that stands as of ``at_ms`` or before.  Their times
        grow with their offsets, so a binary search reads a few footers, not one per snapshot; a
        snapshot written before they said their time is passed over, one by one."""
        lo, hi = 0, len(usable)  # the answer is below hi; everything below lo stands by at_ms
        while lo < hi:
            mid = (lo + hi) // 2
            at = self._time(usable[mid])
            if at is None:  # no time: search what is newer, and older if that finds nothing
                return (self._newest_by(usable[mid + 1 : hi], at_ms) or self._newest_by(usable[lo:mid], at_ms)
                        or (usable[lo - 1] if lo > 0 else None))
            if at <= at_ms:
                lo = mid + 1
            else:
                hi = mid
        return usable[lo - 1] if lo > 0 else None

    def _listed(self, broker: str, topic: str) -> list[snapshots.Snapshot]:
        if (broker, topic) not in self._lists:
            self._lists[(broker, topic)] = snapshots.list_snapshots(self.reader.backend, broker, topic)
        return self._lists[(broker, topic)]

    def _time(self, snap: snapshots.Snapshot) -> int | None:
        if snap.name not in self._times:
            self._times[snap.name] = snapshots.snapshot_time(self.reader.backend, snap)
        return self._times[snap.name]

    def _answer(self, topic, key, at_ms, changes: list[dict], base: dict | None, snapshot: str | None) -> AsOf:
        last = changes[-1] if changes else base
        if last is None:
            return AsOf(topic, key, at_ms, "absent", None, None, snapshot)
        if last["op"] == "delete":
            return AsOf(topic, key, at_ms, "deleted", None, last, snapshot)
        ttl = self.ttl_of(topic)
        if ttl is not None and last["store_ts"] + ttl <= at_ms:
            return AsOf(topic, key, at_ms, "expired", None, last, snapshot)
        return AsOf(topic, key, at_ms, "live", last["body"], last, snapshot)

    def _changes(self, committed: CommittedTier, topic: str, key: str, from_ms: int | None, to_ms: int,
                 since_phy: int | None = None) -> list[dict]:
        table = _dispatched(self.reader.by_key(topic, key, from_ms, to_ms, committed=committed))
        if since_phy is not None:
            table = table.filter(pc.greater_equal(table["phy_offset"], since_phy))
        return _rows(table)

    def _snapshot_row(self, snap: snapshots.Snapshot, key: str) -> dict | None:
        """The key's row in a snapshot (sorted by key: row groups it cannot be in are skipped)."""
        table = read_where_equal(self.reader.backend, snap.name, {"key": key},
                                 ["phy_offset", "queue_id", "queue_offset", "store_ts", "body", "broker"])
        if table.num_rows == 0:
            return None
        last = table.slice(table.num_rows - 1)
        row = last.to_pylist()[0]
        return {"store_ts": epoch_ms_array(last["store_ts"])[0].as_py(), "broker": row["broker"],
                "phy_offset": row["phy_offset"], "queue_id": row["queue_id"], "queue_offset": row["queue_offset"],
                "op": "put", "body": row["body"]}

    def _first_retained(self, committed: CommittedTier, topic: str) -> list[tuple[int, int] | None]:
        """Per queue of ``topic``: (physical offset, store time) of its first retained message, or
        None when the queue never lost one (its first retained offset is 0)."""
        out = []
        for queue_key in committed.queue_keys(topic):
            state = committed.state_of(queue_key)
            if state is None or state.low == 0:
                out.append(None)
                continue
            memo = (committed.log.broker, *queue_key, state.low)
            if memo not in self._firsts:
                got = self.reader.get(queue_key[0], queue_key[1], state.low, 1, committed=committed).messages
                self._firsts[memo] = ((got["phy_offset"][0].as_py(), int(epoch_ms_array(got["store_ts"])[0].as_py()))
                                      if got.num_rows else (2**62, 2**62))  # nothing readable: nothing answers
            out.append(self._firsts[memo])
        return out

    @staticmethod
    def _refusal(topic: str, broker: str, at_ms: int, earliest: int | None, by: str) -> str:
        from datetime import datetime, timezone

        def iso(ms: int) -> str:
            return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")

        lost = (f"the tier no longer holds all of topic {topic!r} of broker {broker!r} (retention dropped its "
                "oldest messages)")
        if earliest is None:
            return (f"{lost}, and no compacted snapshot written with its time covers what was dropped, so no time "
                    f"can be answered yet: snapshots are written every compaction.snapshot_interval_s "
                    "(or by `tierlog kv snapshot`)")
        return (f"{lost}, so {iso(at_ms)} cannot be answered; the earliest time that can is {iso(earliest)} "
                f"({earliest} ms), from {by}")


def _dispatched(table: pa.Table) -> pa.Table:
    """Rows of ``by_key`` that changed the key: those that entered a queue."""
    return table.filter(dispatched_mask(table["sysflag"])).select(CHANGE_COLUMNS)


def _rows(table: pa.Table) -> list[dict]:
    times = epoch_ms_array(table["store_ts"]).to_pylist()
    rows = table.drop_columns(["store_ts"]).to_pylist()
    return [{"store_ts": t, **r, "op": "delete" if r["op"] == "delete" else "put"} for t, r in zip(times, rows)]
