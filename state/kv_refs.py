"""Values the KV view keeps as references into the tier, not as copies.

A changed key's latest message is in the tier before the view takes it: the compaction query reads
the tier's committed batches, never the commitlog.  So for a large value the view can keep where
the message is (its queue, queue offset and physical offset, the head every entry has) and read
the body back from the tier when asked, as RocketMQ's ConsumeQueue keeps a position, not a
message.  ``ReferencePolicy`` says which values: those of messages stored at
``compaction.reference_min_bytes`` or more, of topics whose tier keeps them forever (no
``tier.retention*``); ``TierValues`` reads their bodies.

Why: catching up, the view's writes and the resolve that feeds them were about half of the whole
service's CPU (the cost ledger, ``./dev bench catchup --ledger``): every changed value was read out
of its staging object, copied five times on its way through Arrow, Python and a WriteBatch, and
written to RocksDB's blob files.  With the bodies not read and the view holding heads only, the
service's cost a GB fell by a third or more (docs/benchmarks.md).

What stays as it was: snapshots and the changelog carry whole values (a snapshot reuses the
previous snapshot's values for keys unchanged since, and reads only the newer ones from the tier);
a value survives the commitlog's gc (it is read from the tier).  A topic whose tier retention could
drop a segment the view points into keeps its values in the view; a topic the view already
references when retention is set later keeps its segments until the view has taken those values in
(``SinkJournal.references``, which the tier's retention waits on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.errors import TierlogError
from connectors.tier.retention import Retention


class ReferenceLost(TierlogError):
    """A value the KV view keeps in the tier cannot be read from it."""


@dataclass(frozen=True)
class ReferencePolicy:
    """Which changed values the KV view keeps as references: messages stored at ``min_bytes`` or
    more (0: none), of topics ``retention`` keeps forever."""

    min_bytes: int = 0
    retention: Retention = field(default_factory=Retention)

    def __bool__(self) -> bool:
        return self.min_bytes > 0

    def topic_allows(self, topic: str) -> bool:
        return self.min_bytes > 0 and self.retention.keeps_forever(topic)

    def mask(self, topics: pa.Array, sizes: pa.Array, deleted: pa.Array) -> np.ndarray:
        """True for the rows (a changed key's message: its topic, stored size, and whether it is a
        delete) whose value the view keeps as a reference."""
        n = len(topics)
        if not self.min_bytes or not n:
            return np.zeros(n, dtype=bool)
        large = pc.fill_null(pc.greater_equal(sizes, self.min_bytes), False).to_numpy(zero_copy_only=False)
        live = ~pc.fill_null(deleted, False).to_numpy(zero_copy_only=False)
        allowed = {t: self.topic_allows(t) for t in pc.unique(topics).to_pylist()}
        if all(allowed.values()):
            return large & live
        ok = pc.is_in(topics, value_set=pa.array([t for t, yes in allowed.items() if yes], pa.string()))
        return large & live & ok.to_numpy(zero_copy_only=False)


class TierValues:
    """Reads the bodies of the messages a KV view references, from its tier (one broker's part)."""

    def __init__(self, location: str, broker: str):
        from connectors.tier.reader import TierReader

        self.location, self.broker = location, broker
        self.reader = TierReader(location, broker=broker)

    def bodies(self, topics: list[str], keys: list[str], heads: list[tuple]) -> list[bytes]:
        """The bodies of ``keys`` of ``topics`` whose heads are ``(phy_offset, queue_id,
        queue_offset)``, in that order; raises ``ReferenceLost`` naming the first the tier no
        longer holds as it was."""
        if not heads:
            return []
        phys, queue_ids, offsets = zip(*heads)
        got = self.reader.messages_at(topics, queue_ids, offsets, ["phy_offset", "body"])
        held = got["phy_offset"].to_pylist()
        for i, phy in enumerate(held):
            if phy != phys[i]:
                raise ReferenceLost(
                    f"the KV view keeps the value of key {keys[i]!r} of topic {topics[i]!r} in the tier at "
                    f"{self.location} (broker {self.broker}, queue {queue_ids[i]}, offset {offsets[i]}, physical "
                    f"offset {phys[i]}), but the tier " + ("no longer holds that message" if phy is None else
                                                            f"holds another one there (physical offset {phy})") +
                    ": was the tier replaced or its retention changed under the view? Rebuild the view from the "
                    "tier as it is (`tierlog kv rebuild --from tier`)")
        return [b if b is not None else b"" for b in got["body"].to_pylist()]

    def close(self) -> None:
        self.reader.backend.close()
