"""The tier feed, listing side: the tier's committed batches that a consumer of the tier (the
Kafka mirror) has not applied yet, in the metadata store.

Why a list of its own: a batch's commit record is folded into manifests, and a sealed batch's
staging objects leave the tier's working set, long before a consumer that waited out a Kafka
outage reads them.  So each batch the tier commits is listed here in the commit's own
WriteBatch (``MetadataStore.apply``), and stays listed until the consumers have applied it
(``release``); the tier writer does not delete a retired staging object of a listed batch
(``held_from``).  This is Kafka's remote-log metadata in small: the consumers read what the tier
committed, and the tier keeps it until they have.

Key spaces in the store's RocksDB:

- ``feed\\0<end>``: one ``connectors.tier.feed.FeedBatch`` per committed batch, by its end;
- ``meta\\0feed_from``: the position from which every committed batch is listed; absent while
  no consumer is configured, and then nothing is listed or held.
"""

from __future__ import annotations

import json

from connectors.errors import TierlogError
from connectors.tier.feed import FeedBatch

SEP = "\x00"
PREFIX = "feed" + SEP
FROM = "meta" + SEP + "feed_from"


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

    def open(self, source_end: int | None, since: int = 0) -> int:
        """Start listing, unless it lists already, from ``since`` (a consumer's applied position, 0
        for a new one); what the tier committed between ``since`` and its end (``source_end``) is
        listed as one backfill batch, read from the tier's committed view.  Returns where the
        listing starts."""
        start = self.listed_from()
        if start is not None:
            return start
        puts: dict[str, object] = {FROM: since}
        if source_end is not None and source_end > since:
            puts[batch_key(source_end)] = FeedBatch(since, source_end, (), backfill=True).to_json()
        self.store.write_json(puts)
        return since

    def shut(self) -> None:
        """No consumer any more: forget the listing, so nothing is held."""
        self.store.write_json({}, [FROM, *(k for k, _ in self.store.prefix_json(PREFIX))])

    def puts(self, record: dict) -> dict[str, dict]:
        """What ``MetadataStore.apply`` writes for a tier commit record, in the same WriteBatch."""
        if record["type"] != "batch" or self.listed_from() is None:
            return {}
        batch = FeedBatch.from_record(record)
        return {batch_key(batch.end): batch.to_json()}

    def batches(self, start: int, end: int) -> list[FeedBatch]:
        """The listed batches that hold anything of ``[start, end)``, in order.  Raises FeedGapError
        when part of the range is not listed: it was released, or the feed opened after it."""
        listed = self.listed_from()
        if listed is None or start < listed:
            why = "no consumer of the tier was configured" if listed is None else f"it lists from {listed}"
            raise FeedGapError(
                f"the tier's committed batches from physical offset {start} are not listed in the metadata store "
                f"{self.store.path} ({why}), so the mirror cannot read them back: was its checkpoint restored from "
                "an older copy? Delete the mirror's checkpoint (the `mirror` directory under checkpoint.dir): it "
                "then resumes where it last recorded it had sent (`tierlog status`), and Kafka's read-back skips "
                "what Kafka already holds")
        out = []
        for key, value in self.store.db.items(from_key=batch_key(start + 1)):  # the batches that end after start
            if not key.startswith(PREFIX):
                break
            batch = FeedBatch.from_json(json.loads(value))
            if batch.start >= end:
                break
            out.append(batch)
        return out

    def release(self, up_to: int) -> None:
        """Every consumer has applied the batches that end at or below ``up_to``: unlist them."""
        listed = self.listed_from()
        if listed is None or up_to <= listed:
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
