"""The sinks' journal: how far each sink has applied the commitlog, whether it waits, and what it
skipped on purpose.

The queries write it as they go (``record_sink`` after a batch's output is durable, ``record_health``
while a sink waits for a broker, ``record_skip`` for a message a sink leaves out by setting);
``tierlog status``, the safepoint (``streaming.plan.safepoint``) and the chaos harness read it.  It
lives in the metadata store's RocksDB, in key spaces of its own: the tier writer writes the ``tier``
sink's offset in its commit's WriteBatch, every other sink writes only here.
"""

from __future__ import annotations

import time

SEP = "\x00"


class SinkJournal:
    def __init__(self, store):
        self.store = store  # the state.metadata.MetadataStore whose RocksDB it shares

    def sinks(self) -> dict[str, int]:
        """Each sink's applied physical offset: the end of the last batch its output holds."""
        return {key.split(SEP)[1]: v for key, v in self.store.prefix_json("sink" + SEP)}

    def health(self) -> dict[str, dict]:
        """Sinks that are waiting (for a broker that is away, say): name -> state, since, error."""
        return {key.split(SEP)[1]: v for key, v in self.store.prefix_json("health" + SEP)}

    def skipped(self) -> list[dict]:
        """Messages a sink skipped on purpose (``kafka.on_too_large = "skip"``), oldest first."""
        return [v for _, v in self.store.prefix_json("skip" + SEP)]

    def record_sink(self, name: str, applied_phy: int) -> None:
        self.store.write_json({"sink" + SEP + name: applied_phy})

    def record_health(self, sink: str, health: dict | None) -> None:
        """``health`` while ``sink`` waits; None once it is healthy again."""
        key = "health" + SEP + sink
        self.store.write_json({key: health}) if health is not None else self.store.write_json({}, [key])

    def references(self) -> set[str]:
        """The topics the KV view keeps values of as references into the tier: the tier's retention
        drops none of their segments (``TierIndex.retention_holds``) until the view has taken them in."""
        return set(self.store.get_json("refs" + SEP + "kv") or [])

    def record_references(self, topics: set[str]) -> None:
        """``references``, written (synced) before the view keeps its first value of a new topic there."""
        self.store.write_json({"refs" + SEP + "kv": sorted(topics)})

    def record_skip(self, sink: str, phy_offset: int, reason: str) -> None:
        self.store.write_json({f"skip{SEP}{sink}{SEP}{phy_offset:020d}": {
            "sink": sink, "phy_offset": phy_offset, "reason": reason, "at": time.time()}})
