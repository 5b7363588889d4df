"""Helpers for the tiering tests: a config for a temporary deployment, and the oracle comparison."""

from __future__ import annotations

import dataclasses
import os

from connectors.commitlog.writer import CommitLogWriter
from connectors.commitlog.workload import Workload
from connectors.tier.reader import TierReader
from streaming import config as cfg
from tests import ledger
from tests.oracle import entered_a_queue, message_row, normalize_arrow_row, written_messages

FILE = 256 * 1024
SOURCE_CAP = 200_000  # compaction's batches as small as the source's, as the tests were written for


def make_conf(root, location: str, *, compaction: cfg.CompactionConfig | None = None, **tier) -> cfg.Config:
    """A deployment under ``root``; the compaction query is off unless ``compaction`` is given."""
    root = str(root)
    return cfg.Config(
        commitlog=cfg.CommitlogConfig(dir=os.path.join(root, "commitlog")),
        source=cfg.SourceConfig(max_bytes_per_trigger=SOURCE_CAP, partition_bytes=64 * 1024),
        tier=cfg.TierConfig(location=location, **{"delete_grace_s": 0.0, **tier}),
        state=cfg.StateConfig(dir=os.path.join(root, "state")),
        checkpoint=cfg.CheckpointConfig(dir=os.path.join(root, "checkpoints")),
        compaction=dataclasses.replace(compaction or cfg.CompactionConfig(enabled=False),
                                       max_batch_bytes=(compaction and compaction.max_batch_bytes) or SOURCE_CAP),
    )


def produce(conf: cfg.Config, n: int, *, start: int = 0, seed: int = 1, topics: int = 2, queues: int = 3) -> None:
    w = Workload(messages=start + n, topics=topics, queues=queues, keys=50, body_size=300, delete_ratio=0.1, seed=seed)
    with CommitLogWriter(conf.commitlog.dir, file_size=FILE, fsync="never") as writer:
        ledger.append(writer, w.generate(start))


def tier_rows(location: str) -> list[dict]:
    table = TierReader(location).read_all()
    return sorted((normalize_arrow_row(r) for r in table.to_pylist()), key=lambda r: r["phy_offset"])


def oracle_rows(conf: cfg.Config) -> list[dict]:
    """What the commitlog holds, as message rows: from the writers' ledger when it knows the
    directory (and the reader's replay is checked against it), else from the replay."""
    return [message_row(m) for m in written_messages(conf.commitlog.dir)]


def assert_tier_equals_commitlog(conf: cfg.Config) -> None:
    """Invariant 1: every message that entered a queue once, byte-identical, with its offsets;
    nothing else (no PREPARED or ROLLBACK transaction record)."""
    got, expected = tier_rows(conf.tier.location), [r for r in oracle_rows(conf) if entered_a_queue(r)]
    assert [r["phy_offset"] for r in got] == [r["phy_offset"] for r in expected]
    assert got == expected


def tier_in_batches(log_dir: str, location: str, store, batch_bytes: int, broker: str = "broker-a",
                    copies=None, **settings) -> list[int]:
    """Tier the whole commitlog at ``log_dir`` without Spark, as the tiering query would in batches of
    about ``batch_bytes`` (each staged in one piece, as the driver stages a small batch), committing
    to ``store`` (a ``MetadataStore``); returns the batches' ends, the first offset before them.
    ``broker``: whose commitlog it is; ``copies``: the stagers' local copies; ``settings``: ``WriterSettings`` fields (sealing, retention),
    then maintained after each batch."""
    from connectors.commitlog.reader import CommitLogReader, ReaderOptions
    from connectors.tier.staging import CommitLogGaps, StageSettings, stage_range
    from connectors.tier.writer import TierWriter, WriterSettings

    writer = TierWriter(WriterSettings(location=location, broker=broker, copies=copies,
                                       **{"segment_messages": 10**9, **settings}), store)
    stager = StageSettings(location=location, reader=ReaderOptions(log_dir, broker=broker), copies=copies)
    gaps = CommitLogGaps(ReaderOptions(log_dir, broker=broker))  # a file's blank tail lies between two batches
    with CommitLogReader(log_dir) as reader:
        start, end = reader.first_offset(), reader.end_offset()
        cuts = [*reader.scan(start, end, split_bytes=batch_bytes).splits, end]
    for batch_id, (lo, hi) in enumerate(zip([start, *cuts], cuts)):
        part, _ = stage_range(stager, lo, hi)
        writer.commit(batch_id, [part] if part is not None else [], gaps.between)
        if settings:
            writer.maintain()
    writer.close()
    return [start, *cuts]
