"""A reader's scans served from the boundaries it walked before (``connectors.commitlog.boundaries``)
find what a walk finds.  The oracles: a new reader, which has walked nothing, for the same scan; the
writer's own ledger of the records it appended (their offsets and sizes); and the cut into
partitions as the scan's loop made it, one record at a time."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.commitlog import CommitLogReader, CommitLogWriter, Message
from connectors.commitlog.boundaries import Boundaries, place_splits

FILE = 256 * 1024


def append(directory: str, rng: random.Random, n: int) -> list[Message]:
    with CommitLogWriter(directory, file_size=FILE, fsync="never") as w:
        return w.append_many(Message(topic="t", queue_id=i % 3, body=rng.randbytes(rng.randrange(10, 900)))
                             for i in range(n))


def test_a_long_lived_readers_scans_match_a_new_readers_and_the_writers_ledger(log_dir):
    rng = random.Random(7)
    ledger: list[Message] = []
    served, got = 0, None
    with CommitLogReader(log_dir) as kept:
        for _ in range(40):
            ledger += append(log_dir, rng, rng.randrange(1, 120))
            starts = [m.phy_offset for m in ledger]
            sizes = {m.phy_offset: m.size for m in ledger}
            ends = {m.phy_offset + m.size for m in ledger}
            kept.end_offset()  # walks to the frontier, as the source and the tiering query do
            for _ in range(6):
                # Mostly where the last scan ended, as a stream's batches follow each other.
                begin = got.end if got is not None and got.end in sizes and rng.random() < 0.7 else rng.choice(starts[-150:])
                kind = rng.randrange(4)
                args = {"split_bytes": rng.choice([None, 300, 2_000, 20_000])}
                if kind == 0:  # half of them the bytes of whole records, where a limit is met exactly
                    after = [sizes[s] for s in starts if s >= begin][: rng.randrange(1, 60)]
                    args["max_bytes"] = rng.choice([rng.randrange(1, 40_000), sum(after)])
                elif kind == 1:
                    args["max_records"] = rng.randrange(1, 80)
                elif kind == 2:
                    args["end"] = rng.choice([s for s in starts if s >= begin] + [ledger[-1].phy_offset + ledger[-1].size])
                served += kept._boundaries.first <= begin < kept._boundaries.end
                got = kept.scan(begin, **args)
                with CommitLogReader(log_dir) as new:
                    assert got == new.scan(begin, **args), (begin, args)
                taken = [s for s in starts if begin <= s < got.end]
                assert got.end in sizes or got.end in ends or got.end % FILE == 0, "a record's start or end, or a file's"
                assert (got.records, got.nbytes) == (len(taken), sum(sizes[s] for s in taken))
    assert served > 60, "a scan in four, at least, started inside the kept boundaries"


def splits_one_by_one(starts, sizes, since, split_bytes):
    """The scan's loop before the boundaries were kept: a step of Python a record."""
    out = []
    for pos, size in zip(starts, sizes):
        if split_bytes and since >= split_bytes:
            out.append(pos)
            since = 0
        since += size
    return out, since


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 500), max_size=60), st.integers(0, 1500), st.sampled_from([None, 1, 100, 700, 5000]))
def test_the_cut_into_partitions_is_the_one_the_loop_made(sizes, since, split_bytes):
    starts = np.cumsum([0] + sizes[:-1]).astype(np.int64) + 1000
    out: list[int] = []
    left = place_splits(starts, np.array(sizes, dtype=np.int64), since, split_bytes, out)
    assert (out, left) == splits_one_by_one(starts.tolist(), sizes, since, split_bytes)


def test_boundaries_keep_one_run_and_the_newest_records():
    kept = Boundaries(capacity=10)
    starts = np.arange(0, 300, 10, dtype=np.int64)
    sizes = np.full(30, 10, dtype=np.int64)
    kept.add("f", starts[:12], sizes[:12])
    kept.add("f", starts[12:], sizes[12:])
    assert (kept.first, kept.end) == (200, 300)  # the newest ten
    assert kept.take("f", 150, None, None, None) is None  # let go of
    assert kept.take("g", 250, None, None, None) is None  # another file
    assert kept.take("f", 255, None, None, None) is None  # not a boundary
    assert kept.take("f", 295, None, None, None) is None  # inside the last record
    got, _, go_on = kept.take("f", 250, None, 2, None)
    assert got.tolist() == [250, 260] and not go_on
    got, _, go_on = kept.take("f", 250, None, None, None)
    assert got.tolist() == [250, 260, 270, 280] and go_on  # the last one is walked again
    assert kept.end == 290
    kept.add("f", np.array([230, 240]), np.array([10, 10]))  # a walk from before the run joins it
    assert (kept.first, kept.end) == (230, 290)
    kept.add("f", np.array([225, 235]), np.array([10, 10]))  # it meets the run off a boundary: a new run
    assert (kept.first, kept.end) == (225, 245)
    kept.add("f", np.array([245, 255]), np.array([12, 12]))
    kept.add("f", np.array([260, 270]), np.array([10, 10]))  # overlaps its end off a boundary: a new run
    assert (kept.first, kept.end) == (260, 280)
    kept.add("f", np.array([400]), np.array([10]))  # one that does not touch it starts a new run
    assert (kept.first, kept.end) == (400, 410)
    kept.add("f", np.array([410, 420]), np.array([10, 10]))
    kept.add("f", np.array([430, 450]), np.array([10, 10]))  # a quarantined range between: not one run
    assert kept.path is None
