"""The tier feed, listing side: the tier's committed batches that a consumer of the tier (the
compaction query, the Kafka mirror) has not applied yet, in the metadata store.

Why a list of its own: a batch's commit record is folded into manifests, and a sealed batch's
staging objects leave the tier's working set, long before a consumer that waited out a Kafka
outage reads them.  So each batch the tier commits is listed here in the commit's own
WriteBatch (``MetadataStore.apply``), and stays listed until the consumers have applied it
(``release``: each consumer records its position, and a batch is unlisted once every consumer
is past it); the tier writer does not delete a retired staging object of a listed batch
(``held_from``).  This is Kafka's remote-log metadata in small: the consumers read what the tier
committed, and the tier keeps it until they have.

Key spaces in the store's RocksDB:

- ``feed\\0<end>``: one ``connectors.tier.feed.FeedBatch`` per committed batch, by its end;
- ``meta\\0feed_from``: the position from which every committed batch is listed; absent while
  no consumer is configured, and then nothing is listed or held;
- ``meta\\0feed_at\\0<consumer>``: where each consumer has released the feed to (it has applied
  everything below it, and Spark will not run a batch below it again).
"""

from __future__ import annotations

import json

from connectors.errors import TierlogError
from connectors.tier.feed import FeedBatch

SEP = "\x00"
PREFIX = "feed" + SEP
FROM = "meta" + SEP + "feed_from"
AT = "meta" + SEP + "feed_at" + SEP


class FeedGapError(TierlogError):
    """A consumer asks for batches the feed no longer (or never) listed."""


def batch_key(end: int) -> str:
    return f"{PREFIX}{end:020d}"


class TierFeed:
    def __init__(self, store):
        self.store = store  # the state.metadata.MetadataStore whose RocksDB it shares

    def listed_from(self) -> int | None:
        """Where the listing starts; None while the feed is off."""
        return self.store.get_json(FROM)

    def consumers(self) -> dict[str, int]:
        """Each consumer's position: where it has released the feed to."""
        return {key[len(AT):]: at for key, at in self.store.prefix_json(AT)}

    def open(self, consumer: str, source_end: int | None, since: int = 0) -> tuple[int, FeedBatch | None]:
        """List for ``consumer`` from ``since`` (its applied position, 0 for a new one), unless it is
        listed for already from there or before; returns its position, and the backfill batch listed
        for it if any:
        what the tier committed before the listing began, from ``since`` on, read from the
        committed tier (up to the tier's end ``source_end`` for a new listing, up to where an
        existing one starts for a consumer that joins it)."""
        at = self.consumers().get(consumer)
        if at is not None and at <= since:
            return at, None
        listed = self.listed_from()
        puts: dict[str, object] = {AT + consumer: since}
        backfill_to, backfill = (source_end if listed is None else listed), None
        if listed is None or since < listed:
            puts[FROM] = since
            if backfill_to is not None and backfill_to > since:
                backfill = FeedBatch(since, backfill_to, (), backfill=True)
                # Keyed by its end: a listing from `listed` holds only batches that end after it.
                puts[batch_key(backfill_to)] = backfill.to_json()
        self.store.write_json(puts)
        return since, backfill

    def keep_only(self, consumers) -> list[str]:
        """The configured consumers: forget the others' positions (and the whole listing when none
        is left), so nothing is held for a consumer that is gone; returns those forgotten."""
        gone = [c for c in self.consumers() if c not in consumers]
        if not consumers:
            self.store.write_json({}, [FROM, *(AT + c for c in gone), *(k for k, _ in self.store.prefix_json(PREFIX))])
        elif gone:
            self.store.write_json({}, [AT + c for c in gone])
            self._unlist()
        return gone

    def puts(self, record: dict) -> dict[str, dict]:
        """What ``MetadataStore.apply`` writes for a tier commit record, in the same WriteBatch."""
        if record["type"] != "batch" or self.listed_from() is None:
            return {}
        batch = FeedBatch.from_record(record)
        return {batch_key(batch.end): batch.to_json()}

    def batches(self, start: int, end: int) -> list[FeedBatch]:
        """The listed batches that hold anything of ``[start, end)``, in order (``listed_batches``)."""
        return listed_batches(self.store.db, start, end, self.store.path)

    def batch_ends(self, start: int) -> list[tuple[int, int]]:
        """(end, commitlog bytes past ``start``) of each listed batch that ends after ``start``, in order."""
        return listed_ends(self.store.db, start)

    def release(self, consumer: str, up_to: int) -> None:
        """``consumer`` has applied the batches that end at or below ``up_to`` and will not be run
        again below it; the batches every consumer is past are unlisted."""
        at = self.consumers().get(consumer)
        if at is None or up_to <= at:
            return
        self.store.write_json({AT + consumer: up_to})
        self._unlist()

    def _unlist(self) -> None:
        listed, positions = self.listed_from(), self.consumers().values()
        up_to = min(positions, default=None)
        if listed is None or up_to is None or up_to <= listed:
            return
        done = []
        for key in self.store.db.keys(from_key=PREFIX):
            if not key.startswith(PREFIX) or int(key[len(PREFIX):]) > up_to:
                break
            done.append(key)
        self.store.write_json({FROM: up_to}, done)

    def held(self) -> tuple[int, int]:
        """How many batches are listed, and the bytes of their staging objects: what the tier keeps
        because a consumer has not applied it yet (``tierlog status``)."""
        batches = size = 0
        for _, value in self.store.prefix_json(PREFIX):
            batches += 1
            size += sum(o[1] for o in value["objects"])
        return batches, size

    def held_from(self) -> int | None:
        """The first physical offset of the oldest listed staging object: a retired staging object
        at or above it is still to be read by a consumer.  None when nothing is listed."""
        for key, value in self.store.prefix_json(PREFIX):
            batch = FeedBatch.from_json(value)
            if batch.objects:
                return batch.objects[0][2]
        return None


def listed_batches(db, start: int, end: int, path: str) -> list[FeedBatch]:
    """The batches listed in ``db`` (the metadata store at ``path``, or a secondary of it) that hold
    anything of ``[start, end)``, in order.  Raises FeedGapError when part of the range is not
    listed: it was released, or the feed opened after it."""
    raw = db.get(FROM)
    listed = None if raw is None else json.loads(raw)
    if listed is None or start < listed:
        why = "no consumer of the tier was configured" if listed is None else f"it lists from {listed}"
        raise FeedGapError(
            f"the tier's committed batches from physical offset {start} are not listed in the metadata store "
            f"{path} ({why}), so a query that reads the tier (compaction, the mirror) cannot read them back: was "
            "its checkpoint restored from an older copy? Delete that query's checkpoint (its directory under "
            "checkpoint.dir): it then resumes where its sink last recorded it had applied (`tierlog status`)")
    out = []
    for key, value in db.items(from_key=batch_key(start + 1)):  # the batches that end after start
        if not key.startswith(PREFIX):
            break
        batch = FeedBatch.from_json(json.loads(value))
        if batch.start >= end:
            break
        out.append(batch)
    return out


def listed_ends(db, start: int) -> list[tuple[int, int]]:
    """(end, commitlog bytes past ``start``) of each batch listed in ``db`` that ends after ``start``."""
    out = []
    for key, raw in db.items(from_key=batch_key(start + 1)):
        if not key.startswith(PREFIX):
            break
        batch = json.loads(raw)
        out.append((batch["end"], batch["end"] - max(batch["start"], start)))
    return out


def next_end(ends: list[tuple[int, int]], begin: int, max_bytes: int = 0, target: int | None = None) -> int:
    """Where a consumer's next batch from ``begin`` ends, of the listed ``ends`` (``listed_ends``):
    whole tier batches, about ``max_bytes`` of commitlog at most (0: no cap) but at least one, none
    past ``target``; ``begin`` when there is none."""
    end, taken = begin, 0
    for batch_end, size in ends:
        if target is not None and batch_end > target:
            break
        if max_bytes and taken and taken + size > max_bytes:
            break
        end, taken = batch_end, taken + size
    return end
