"""The sinks' journal beside the tier index in one metadata store: what a sink records stays its own."""

from __future__ import annotations

from connectors.tier.location import open_backend
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
    store.rebuild(TierLog(backend).committed())  # the index is replaced; the journal is not the tier's
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


def test_the_tiers_commit_records_hold_only_its_own_filter_counts_and_the_journal_the_others(tmp_path):
    """The stagers count every sink's filter where each message passes once; a commit record of the
    tier says what the tier left out, the other sinks' counts are their journal's, written in the
    commit's WriteBatch, and a rebuild of the index from the tier leaves them as they were."""
    from collections import Counter

    from connectors.commitlog.reader import CommitLogReader, ReaderOptions
    from connectors.commitlog.topics import CLASSES, TopicFilter
    from connectors.commitlog.workload import Workload
    from connectors.commitlog.writer import CommitLogWriter
    from connectors.tier.staging import StageSettings, stage_range
    from connectors.tier.writer import TierWriter, WriterSettings
    from tests import ledger

    log_dir, location = str(tmp_path / "commitlog"), str(tmp_path / "tier")
    messages = list(Workload(messages=600, topics=3, queues=2, keys=50, body_size=100, seed=3).generate())
    with CommitLogWriter(log_dir, file_size=1 << 20, fsync="never") as w:
        ledger.append(w, messages)
    with CommitLogReader(log_dir) as reader:
        end = reader.end_offset()
    everything = TopicFilter(frozenset(CLASSES), ("*",), (), ())
    filters = {"tier": TopicFilter(frozenset(CLASSES), ("*",), ("topic-0",), ()), "compaction": everything,
               "mirror": TopicFilter(frozenset(CLASSES), ("*",), ("topic-0", "topic-1"), ())}
    store = MetadataStore(str(tmp_path / "metadata"))
    writer = TierWriter(WriterSettings(location=location), store)
    part, _ = stage_range(StageSettings(location=location, reader=ReaderOptions(log_dir), filters=filters), 0, end)
    writer.commit(0, [part])
    writer.close()
    per_topic = Counter(m.topic for m in messages)
    expected = {"tier": {"business": per_topic["topic-0"]},
                "mirror": {"business": per_topic["topic-0"] + per_topic["topic-1"]}}
    assert store.filtered() == expected and all(expected.values())
    backend = open_backend(location)
    committed = TierLog(backend).committed()
    assert committed.filtered == {"tier": expected["tier"]}  # all the tier's log holds
    store.rebuild(committed)
    assert store.filtered() == expected
    backend.close()
    store.close()
