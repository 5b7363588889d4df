"""The KV view's values kept as references into the tier (``state.kv_refs``), without Spark: a real
tier written by ``TierWriter`` from a real commitlog, the view compared with the writer's ledger.

* Every read of the view (``get``, ``multi_get``, ``scan``, ``entries``, ``latest_rows``) returns the
  ledger's whole value, for values held as copies and as references alike, the view opened with
  its tier or relying on the one it recorded.
* A reference the tier no longer holds is an error naming the key, its place and what to do.
* A tier retention set on a topic the view references waits (the tier keeps the segments) until the
  KV writer has taken those values into the view; then it drops them, and the view still equals the
  ledger.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from connectors.changes import CHANGE_ROW
from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.reader import TierReader
from connectors.tier.retention import Retention
from connectors.tier.staging import CommitLogGaps, StageSettings, stage_range
from connectors.tier.writer import TierWriter, WriterSettings
from state import kv as kv_module
from state.kv import KVView
from state.kv_refs import ReferenceLost, ReferencePolicy
from state.kv_writer import CompactionSettings, KVWriter
from state.metadata import MetadataStore
from state.replay import keyed_rows
from tests import ledger
from tests.oracle import latest_per_key

BROKER = "broker-a"


def build_tier(root, retention: Retention = Retention(), messages: int = 600):
    """A commitlog of 600 messages over two topics, tiered in 6 batches with seals (15 messages a
    segment); returns (log dir, tier location, metadata store, writer)."""
    log_dir, location = str(root / "commitlog"), str(root / "tier")
    with CommitLogWriter(log_dir, file_size=64 * 1024, fsync="never") as w:
        ledger.append(w, Workload(messages=messages, topics=2, queues=3, keys=60, body_size=300,
                                  delete_ratio=0.1, seed=11).generate())
    store = MetadataStore(str(root / "metadata"))
    writer = TierWriter(WriterSettings(location=location, broker=BROKER, segment_messages=15, segment_age_s=1e9,
                                       retention=Retention(check_s=0), delete_grace_s=0), store)
    stage_settings = StageSettings(location=location, reader=ReaderOptions(log_dir))
    stored = ledger.stored(log_dir)
    gaps = CommitLogGaps(ReaderOptions(log_dir))
    step = -(-len(stored) // 6)
    for batch_id, first in enumerate(range(0, len(stored), step)):
        chunk = stored[first:first + step]
        part, _ = stage_range(stage_settings, writer.source_end or 0, chunk[-1].phy_offset + chunk[-1].size)
        writer.commit(batch_id, [part], gaps.between)
        writer.maintain(int(time.time() * 1000) + 60_000)
    return log_dir, location, store, writer


def changed_rows(location: str):
    """Every keyed message the tier holds, as the KV view applies them (``CHANGE_ROW`` and ``size``),
    in physical order."""
    return keyed_rows(TierReader(location, broker=BROKER).read_all()).sort_by("phy_offset")


def view_of(kv: KVView) -> dict:
    return {(t, e.key): (e.body, e.phy_offset, e.queue_id, e.queue_offset, e.store_ts)
            for t, e in kv.entries() if e is not None}


def oracle(log_dir: str) -> dict:
    return {k: (v["body"], v["phy_offset"], v["queue_id"], v["queue_offset"], v["store_ts"])
            for k, v in latest_per_key(log_dir).items()}


def kinds(kv: KVView) -> dict:
    out: dict = {}
    for raw_key, raw in kv.db.items(from_key=kv_module._DATA_START):
        topic = raw_key.decode().partition("\x00")[0]
        kind = raw[kv_module._HEAD.size - 1]
        out[(topic, kind)] = out.get((topic, kind), 0) + 1
    return out


def test_every_read_of_the_view_returns_whole_values_of_copies_and_references(tmp_path):
    log_dir, location, store, writer = build_tier(tmp_path)
    rows = changed_rows(location)
    # Every other message's value kept in the tier (a delete's never: it has none), the rest copied.
    referenced = (np.arange(rows.num_rows) % 2 == 0) & ~rows["deleted"].to_numpy(zero_copy_only=False)
    expected = oracle(log_dir)
    path = str(tmp_path / "kv")
    with KVView(path, tier=location, broker=BROKER) as kv:
        for chunk in range(0, rows.num_rows, 97):  # many batches, references and copies mixed
            batch = rows.slice(chunk, 97)
            kv.apply_table(batch.select(list(CHANGE_ROW)), applied_through=batch["phy_offset"][-1].as_py() + 1,
                           referenced=referenced[chunk:chunk + 97])
        stored = kinds(kv)
        assert any(kind == kv_module._REFERENCED for _, kind in stored) and any(kind == 0 for _, kind in stored)
        assert kv.referenced_topics() == {t for (t, kind) in stored if kind == kv_module._REFERENCED}
        assert view_of(kv) == expected
        for (topic, key), value in list(expected.items())[:40]:
            assert (kv.get(topic, key).body, kv.get(topic, key).phy_offset) == value[:2]
        topic = next(iter(expected))[0]
        keys = sorted(k for t, k in expected if t == topic)
        assert {k: e.body for k, e in kv.multi_get(topic, keys + ["absent"]).items() if e} == \
            {k: expected[(topic, k)][0] for k in keys}
        assert [e.key for e in kv.scan(topic)] == keys
        live = {(r[0], r[1]): r[7] for r in kv.latest_rows() if not r[6]}
        assert live == {k: v[0] for k, v in expected.items()}
    # Opened without its tier: the one it recorded.
    with KVView(path, read_only=True) as kv:
        assert view_of(kv) == expected
    store.close()
    writer.close()


def test_a_reference_the_tier_no_longer_holds_is_an_error_that_says_what_to_do(tmp_path):
    import shutil

    log_dir, location, store, writer = build_tier(tmp_path)
    rows = changed_rows(location)
    path = str(tmp_path / "kv")
    with KVView(path, tier=location, broker=BROKER) as kv:
        kv.apply_table(rows.select(list(CHANGE_ROW)), referenced=~rows["deleted"].to_numpy(zero_copy_only=False))
    store.close()
    writer.close()
    shutil.rmtree(location)
    build_tier(tmp_path / "other", messages=50)  # another, smaller tier where this one was
    shutil.copytree(tmp_path / "other" / "tier", location)
    with KVView(path, read_only=True) as kv, pytest.raises(ReferenceLost) as got:
        view_of(kv)
    message = str(got.value)
    assert location in message and "tierlog kv rebuild --from tier" in message and "key " in message
    with pytest.raises(kv_module.KVError, match="opened without its tier"):
        KVView(str(tmp_path / "kv2")).apply_table(rows.slice(0, 3).select(list(CHANGE_ROW)),
                                                  referenced=[True, True, True])


def test_a_retention_set_later_waits_until_the_view_took_its_values_in(tmp_path, caplog):
    log_dir, location, store, writer = build_tier(tmp_path)
    expected = oracle(log_dir)
    rows = changed_rows(location)
    references = ReferencePolicy(min_bytes=1)
    with KVView(str(tmp_path / "kv"), tier=location, broker=BROKER) as kv:
        kv_writer = KVWriter(CompactionSettings(ReaderOptions(log_dir), location, snapshot_interval_s=0,
                                                references=references), kv, store, messages=_NoReads())
        table = rows.select(list(CHANGE_ROW)).append_column(
            "referenced", [references.mask(rows["topic"], rows["size"], rows["deleted"])])
        kv_writer._hold_retention(table)
        kv.apply_table(table, referenced=table["referenced"].to_numpy(zero_copy_only=False))
        assert store.journal.references() == {"topic-0", "topic-1"} == kv.referenced_topics()
        segments_before = len(TierReader(location, broker=BROKER).committed().segments)

        # Retention is set on topic-1: the tier keeps its segments while the view points into them.
        retention = Retention(messages={"topic-1": 20}, check_s=0)
        writer.close()
        writer = TierWriter(WriterSettings(location=location, broker=BROKER, segment_messages=15, segment_age_s=1e9,
                                           retention=retention, delete_grace_s=0), store)
        with caplog.at_level(logging.WARNING, logger="tierlog.tier"):
            writer.maintain(int(time.time() * 1000) + 60_000)
        assert len(TierReader(location, broker=BROKER).committed().segments) == segments_before
        assert any("topic-1" in r.getMessage() and "KV view" in r.getMessage() for r in caplog.records)

        # The KV writer's start takes topic-1's values in; then the retention drops segments.
        kv_writer.settings = CompactionSettings(ReaderOptions(log_dir), location, snapshot_interval_s=0,
                                                references=ReferencePolicy(1, retention))
        kv_writer.take_inline_where_retained()
        assert store.journal.references() == {"topic-0"} == kv.referenced_topics()
        assert not any(t == "topic-1" and kind == kv_module._REFERENCED for (t, kind) in kinds(kv))
        writer.maintain(int(time.time() * 1000) + 60_000)
        writer.maintain(int(time.time() * 1000) + 120_000)  # the expired segments, deleted past their grace
        assert len(TierReader(location, broker=BROKER).committed().segments) < segments_before
        assert view_of(kv) == expected
    store.close()
    writer.close()


class _NoReads:
    """The KV writer's messages when the test applies the view itself: never read."""

    def close(self) -> None:
        pass


def test_the_policy_references_large_live_values_of_topics_the_tier_keeps_forever():
    import pyarrow as pa

    policy = ReferencePolicy(min_bytes=1000, retention=Retention(seconds={"kept-a-week": 7 * 86400}))
    topics = pa.array(["orders", "orders", "orders", "kept-a-week", "orders"])
    sizes = pa.array([1000, 999, 5000, 5000, None], pa.int32())
    deleted = pa.array([False, False, True, False, False])
    assert policy.mask(topics, sizes, deleted).tolist() == [True, False, False, False, False]
    assert not ReferencePolicy().mask(topics, sizes, deleted).any()  # 0: every value copied
    assert not ReferencePolicy(1000, Retention(seconds={"*": 60})).topic_allows("orders")
