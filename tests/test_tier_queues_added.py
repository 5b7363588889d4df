"""Queues that appear between folds: the per-topic and time-bounded reads see every queue.

A fold writes only the queues that changed since the last one (their bucket and manifest).  A topic
that gains a queue in a window where its other queues did not change is the case where a reader
could keep the topic's old list of queues.  The model here is the writers' ledger
(``tests.ledger``): after every batch, fold, seal and restart, ``queue_infos(topic=)``,
``queues(topic=)`` and ``by_key`` (all time and time-bounded) are compared with it, through a reader
made afresh and through one kept from the start, as a long-lived consumer would; so is what the
``tier`` Spark source plans and reads with a topic filter (and a store-time bound) pushed down.

Runs the writer without Spark (``TierWriter`` and the real stager over a real commitlog).
"""

from __future__ import annotations

import random

import pytest
from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, In

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.format import Message
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.location import open_backend
from connectors.tier.reader import TierReader
from connectors.tier.staging import CommitLogGaps, StageSettings, stage
from connectors.tier.writer import TierWriter, WriterSettings
from streaming.sources.tier import TierBatchReader
from state.metadata import MetadataStore
from tests import ledger
from tests.oracle import message_row

TOPICS = ("grow", "still")
KEYS = [f"k{i}" for i in range(5)]


def write_log(log_dir: str, rng: random.Random, phases: int) -> list[tuple[int, int]]:
    """Phase n gives topic ``grow`` its queue n; in some phases only that new queue gets messages
    (the other queues of the topic, and ``still``, unchanged).  Returns each phase's range of
    message indexes in the ledger."""
    messages, bounds, ts = [], [], 1_700_000_000_000
    for phase in range(phases):
        only_new = phase > 0 and rng.random() < 0.5
        first = len(messages)
        for i in range(rng.randint(4, 20)):
            ts += 7
            topic = "grow" if only_new or i == 0 else rng.choice(TOPICS)
            queue = phase if only_new or i == 0 else rng.randrange(phase + 1 if topic == "grow" else 2)
            messages.append(Message(topic=topic, queue_id=queue, body=b"%d" % ts, store_ts=ts, born_ts=ts,
                                    properties={"KEYS": rng.choice(KEYS)}))
        bounds.append((first, len(messages)))
    with CommitLogWriter(log_dir, file_size=16 * 1024, fsync="never") as w:
        ledger.append(w, messages)
    return bounds


class Tier:
    def __init__(self, root):
        self.root, self.log_dir, self.location = root, str(root / "commitlog"), str(root / "tier")
        self.stage_settings = StageSettings(location=self.location, reader=ReaderOptions(self.log_dir))
        self.settings = WriterSettings(location=self.location, segment_messages=6, segment_age_s=1e9,
                                       fold_every=3, delete_grace_s=0)
        self.store = self.writer = None

    def open(self) -> None:
        self.store = MetadataStore(str(self.root / "metadata"))
        self.writer = TierWriter(self.settings, self.store, open_backend(self.location))
        self.gaps = CommitLogGaps(ReaderOptions(self.log_dir))

    def close(self) -> None:
        self.writer.close()
        self.store.close()

    def commit(self, batch_id: int, batch: list[Message]) -> None:
        last = batch[-1]
        part = stage(self.stage_settings, batch[0].phy_offset, last.phy_offset + last.size, last.phy_offset)
        self.writer.commit(batch_id, [part], self.gaps.between)


def tier_source_rows(location: str, filters) -> list[int]:
    """The ``tier`` Spark source's planning and reading, called as Spark would (no session needed:
    both are plain Python), with ``filters`` pushed down; the physical offsets it returns."""
    source = TierBatchReader(location)
    assert list(source.pushFilters(filters)) == filters  # Spark re-applies them all
    offsets = []
    for part in source.partitions():
        for batch in source.read(part):
            offsets.extend(batch.column("phy_offset").to_pylist())
    return sorted(offsets)


def assert_tier_source_equals_ledger(location: str, rows: list[dict], rng: random.Random) -> None:
    for topic in TOPICS:
        mine = [r for r in rows if r["topic"] == topic]
        assert tier_source_rows(location, [EqualTo(("topic",), topic)]) == sorted(r["phy_offset"] for r in mine)
        if mine:
            lo = rng.choice(mine)["store_ts"]
            got = tier_source_rows(location, [In(("topic",), (topic,)), GreaterThanOrEqual(("store_ts",), lo)])
            assert got == sorted(r["phy_offset"] for r in mine if r["store_ts"] >= lo), (topic, lo)


def assert_reads_equal_ledger(reader: TierReader, rows: list[dict], rng: random.Random) -> None:
    for topic in TOPICS:
        mine = [r for r in rows if r["topic"] == topic]
        ends: dict[int, int] = {}
        for r in mine:
            ends[r["queue_id"]] = max(ends.get(r["queue_id"], 0), r["queue_offset"] + 1)
        infos = reader.queue_infos(topic=topic)
        assert {i.queue_id: i.commit for i in infos} == ends, topic
        assert {i.topic for i in infos} <= {topic}
        assert sorted(reader.queues(topic=topic)) == sorted((topic, q) for q in ends)
        for key in KEYS:
            keyed = [r for r in mine if r["key"] == key]
            assert reader.by_key(topic, key)["phy_offset"].to_pylist() == [r["phy_offset"] for r in keyed]
            if keyed:
                lo, hi = sorted(rng.choice(keyed)["store_ts"] + rng.randint(-10, 10) for _ in range(2))
                got = reader.by_key(topic, key, begin_ms=lo, end_ms=hi)["phy_offset"].to_pylist()
                assert got == [r["phy_offset"] for r in keyed if lo <= r["store_ts"] <= hi], (topic, key, lo, hi)


@pytest.mark.parametrize("seed", range(4))
def test_queues_added_between_folds_are_seen_by_per_topic_and_time_bounded_reads(tmp_path, seed):
    rng = random.Random(seed)
    tier = Tier(tmp_path)
    bounds = write_log(tier.log_dir, rng, phases=10)
    written = ledger.stored(tier.log_dir)
    tier.open()
    kept = TierReader(tier.location)  # one reader for the whole run, as a long-lived consumer
    did = {"fold": 0, "maintain": 0, "restart": 0, "checks": 0}
    try:
        batch_id = 0
        for first, end in bounds:
            cuts = sorted({first, end, *rng.sample(range(first + 1, end), rng.randint(0, 1))})
            for a, b in zip(cuts, cuts[1:]):
                tier.commit(batch_id, written[a:b])
                batch_id += 1
                for op in rng.sample(["fold", "maintain", "restart", "fold"], rng.randint(0, 3)):
                    if op == "restart":
                        tier.close()
                        tier.open()
                    else:
                        getattr(tier.writer, op)()
                    did[op] += 1
                rows = [message_row(m) for m in written[:b]]
                for reader in (kept, TierReader(tier.location)):
                    assert_reads_equal_ledger(reader, rows, rng)
                    did["checks"] += 1
                assert_tier_source_equals_ledger(tier.location, rows, rng)
        grown = {q.queue_id for q in TierReader(tier.location).queue_infos(topic="grow")}
        assert grown == set(range(10)), grown  # the topic did gain a queue in every phase
        assert did["fold"] and did["maintain"] and did["restart"], did
        assert any(q.sealed for q in tier.store.queues()), "nothing was sealed"
    finally:
        tier.close()
