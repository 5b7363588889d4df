"""Retention by messages and by bytes at its limits, through ``tierlog.toml``: exactly at the limit,
one below and one above, for a queue of five sealed segments.  Kafka's rule, written out here:
drop the oldest segment while what stays still meets the limit.  No Spark: the settings come from
the file as ``tierlog run`` parses them, the tier from ``TierWriter`` and the real stager."""

from __future__ import annotations

import pytest

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.reader import TierReader
from connectors.tier.staging import CommitLogGaps, stage
from connectors.tier.writer import TierWriter
from state.metadata import MetadataStore
from streaming import config as cfg
from streaming.settings import derive
from tests import ledger

SEGMENTS, PER_SEGMENT = 5, 10


def settings_from_toml(tmp_path, retention: str):
    toml = tmp_path / "tierlog.toml"
    toml.write_text(f'[commitlog]\ndir = "{tmp_path / "commitlog"}"\n[tier]\nlocation = "{tmp_path / "tier"}"\n'
                    f"segment_messages = {PER_SEGMENT}\ndelete_grace_s = 0\n{retention}\n")
    return derive(cfg.load(str(toml), env={}))


def tier_of_five_segments(tmp_path, retention: str):
    """One queue, five sealed segments of ten messages each, made with no retention; then a writer
    opened on it with the settings of a ``tierlog.toml`` holding ``retention`` (a ``[tier]`` line).
    Returns that writer, its metadata store, and the segments' sizes, oldest first."""
    with CommitLogWriter(str(tmp_path / "commitlog"), file_size=1 << 20, fsync="never") as w:
        written = ledger.append(w, Workload(messages=SEGMENTS * PER_SEGMENT, topics=1, queues=1, body_size=100,
                                            seed=2).generate())
    plain = settings_from_toml(tmp_path, "")
    assert not plain.writer.retention
    store = MetadataStore(str(tmp_path / "metadata"))
    building = TierWriter(plain.writer, store)
    for i in range(SEGMENTS):
        batch = written[i * PER_SEGMENT:(i + 1) * PER_SEGMENT]
        part = stage(plain.stage, batch[0].phy_offset, batch[-1].phy_offset + batch[-1].size, batch[-1].phy_offset)
        building.commit(i, [part], CommitLogGaps(ReaderOptions(str(tmp_path / "commitlog"))).between)
        assert building.maintain() == 1
    building.close()
    sizes = [s.size for s in store.segments("topic-0", 0)]
    assert len(sizes) == SEGMENTS
    return TierWriter(settings_from_toml(tmp_path, retention).writer, store), store, sizes


def kept_after(writer: TierWriter, store: MetadataStore) -> int:
    """Expire once, then the queue's lowest retained offset as a reader of the tier sees it."""
    writer.expire(now_ms=0)
    writer.close()
    store.close()
    info = TierReader(writer.settings.location).queue_infos()[0]
    assert info.commit == SEGMENTS * PER_SEGMENT
    return info.low


@pytest.mark.parametrize("limit", [29, 30, 31])
def test_retention_by_messages_at_its_limit(tmp_path, limit):
    writer, store, _ = tier_of_five_segments(tmp_path, f'retention_messages = "*={limit}"')
    low = 0
    while SEGMENTS * PER_SEGMENT - (low + PER_SEGMENT) >= limit:  # what stays after dropping the oldest
        low += PER_SEGMENT
    assert low == {29: 20, 30: 20, 31: 10}[limit]
    assert kept_after(writer, store) == low


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_retention_by_bytes_at_its_limit(tmp_path, delta):
    # The limit is the bytes of the newest three segments, then one byte less and one more.
    writer, store, sizes = tier_of_five_segments(tmp_path, "")
    limit = sum(sizes[2:]) + delta
    writer.close()
    writer = TierWriter(settings_from_toml(tmp_path, f'retention_bytes = "topic-0={limit}"').writer, store)
    dropped, kept = 0, sum(sizes)
    while dropped < SEGMENTS and kept - sizes[dropped] >= limit:
        kept -= sizes[dropped]
        dropped += 1
    assert dropped == {-1: 2, 0: 2, 1: 1}[delta]
    assert kept_after(writer, store) == dropped * PER_SEGMENT


def test_retention_of_another_topic_leaves_this_one_alone(tmp_path):
    writer, store, _ = tier_of_five_segments(tmp_path, 'retention_messages = "other=1"')
    assert kept_after(writer, store) == 0
