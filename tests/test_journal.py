"""The sinks' journal beside the tier index in one metadata store: what a sink records stays its own."""

from __future__ import annotations

from connectors.tier.backend import open_backend
from connectors.tier.log import TierLog
from state.metadata import MetadataStore


def test_the_journal_survives_reopening_and_a_rebuild_of_the_tier_index(tmp_path):
    path = str(tmp_path / "metadata")
    store = MetadataStore(path)
    journal = store.journal
    journal.record_sink("kv", 500)
    journal.record_sink("mirror", 300)
    journal.record_health("mirror", {"state": "waiting", "error": "no Kafka broker reachable"})
    journal.record_skip("mirror", 120, "too large")
    journal.record_health("kv", None)  # healthy: nothing recorded
    backend = open_backend(str(tmp_path / "tier"))
    store.rebuild(TierLog(backend).view())  # the index is replaced; the journal is not the tier's
    backend.close()
    store.close()
    reopened = MetadataStore(path, read_only=True)
    try:
        assert reopened.journal.sinks() == {"kv": 500, "mirror": 300}
        assert reopened.journal.health() == {"mirror": {"state": "waiting", "error": "no Kafka broker reachable"}}
        assert [(s["sink"], s["phy_offset"], s["reason"]) for s in reopened.journal.skipped()] == [
            ("mirror", 120, "too large")]
        assert reopened.last_seq() == -1 and reopened.queues() == []
    finally:
        reopened.close()
