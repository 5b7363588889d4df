"""The tiering query's staging processes without Spark (``connectors.tier.stage_pool``): what they
stage, read back from the objects, equals the writers' ledger; one that dies mid-batch is started
again and the batch staged again; a corrupt record is raised as the stager raised it, naming the
file and offset; ``close`` ends the processes."""

from __future__ import annotations

import os

import pytest

from connectors.commitlog.errors import CorruptRecordError
from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from connectors.faults import DRIVER_PID
from connectors.tier import layout
from connectors.tier.location import open_backend
from connectors.tier.stage_pool import StagePool
from connectors.tier.staging import StageSettings
from tests import ledger
from tests.oracle import entered_a_queue, message_row, normalize_arrow_row

FILE = 256 * 1024  # files roll every 256 KiB, so ranges end and start on blank tails too


def make_log(root, messages: int = 3000):
    log_dir = str(root / "commitlog")
    with CommitLogWriter(log_dir, file_size=FILE, fsync="never") as writer:
        ledger.append(writer, Workload(messages=messages, topics=2, queues=3, keys=40, body_size=300,
                                       delete_ratio=0.1, seed=5).generate())
    return log_dir, ledger.stored(log_dir)


def staged_rows(location: str, parts) -> list[dict]:
    backend = open_backend(location)
    try:
        rows = [normalize_arrow_row(r) for p in parts for r in layout.from_parquet(backend.read(p.name)).to_pylist()]
    finally:
        backend.close()
    return sorted(rows, key=lambda r: r["phy_offset"])


def expected_rows(written) -> list[dict]:
    return [r for r in (message_row(m) for m in written) if entered_a_queue(r)]


def stage_all(tmp_path, log_dir: str, written) -> tuple[StagePool, list, int]:
    """The whole log staged as one batch by two processes, in ranges of about 100 kB; the pool closed."""
    pool = StagePool(StageSettings(location=str(tmp_path / "tier"), reader=ReaderOptions(log_dir)), 2,
                     split_bytes=100_000)
    try:
        parts, records = pool.stage(written[0].phy_offset, written[-1].phy_offset + written[-1].size)
    finally:
        pool.close()
    return pool, parts, records


def test_the_processes_stage_a_batch_in_ranges_and_the_objects_hold_the_ledger(tmp_path):
    log_dir, written = make_log(tmp_path)
    location = str(tmp_path / "tier")
    pool, parts, records = stage_all(tmp_path, log_dir, written)
    assert records == len(written)
    assert len(parts) > 8, "the batch was cut into ranges, across files"
    assert [p.first_phy for p in parts] == sorted(p.first_phy for p in parts)
    assert all(a.end_phy <= b.first_phy for a, b in zip(parts, parts[1:]))
    assert staged_rows(location, parts) == expected_rows(written)
    assert pool.restarts == 0


def test_a_process_that_dies_mid_batch_is_started_again_and_the_batch_staged_again(tmp_path, monkeypatch):
    log_dir, written = make_log(tmp_path)
    location = str(tmp_path / "tier")
    # The third staged object kills the process that wrote it (the fault kills its own process when
    # no driver is named); the processes inherit this environment.
    monkeypatch.delenv(DRIVER_PID, raising=False)
    monkeypatch.setenv("TIERLOG_FAULT", "staged:3")
    monkeypatch.setenv("TIERLOG_FAULT_DIR", str(tmp_path))
    pool, parts, records = stage_all(tmp_path, log_dir, written)
    assert os.path.getsize(tmp_path / "tierlog-fault-staged") >= 3, "the fault fired"
    assert pool.restarts == 1
    assert records == len(written)
    assert staged_rows(location, parts) == expected_rows(written)


def test_a_corrupt_record_is_raised_as_the_stager_raised_it_and_close_ends_the_processes(tmp_path):
    log_dir, written = make_log(tmp_path)
    victim = written[len(written) // 2]
    name = os.path.join(log_dir, f"{victim.phy_offset // FILE * FILE:020d}")
    with open(name, "r+b") as fh:
        local = victim.phy_offset % FILE
        fh.seek(local)
        record = fh.read(victim.size)
        at = local + record.index(victim.body) + len(victim.body) // 2
        fh.seek(at)
        fh.write(bytes([record[at - local] ^ 0xFF]))
    pool = StagePool(StageSettings(location=str(tmp_path / "tier"), reader=ReaderOptions(log_dir)), 2,
                     split_bytes=100_000)
    try:
        with pytest.raises(CorruptRecordError) as raised:
            pool.stage(written[0].phy_offset, written[-1].phy_offset + written[-1].size)
        assert raised.value.offset == victim.phy_offset and raised.value.file == name, raised.value
        assert f"physical offset {victim.phy_offset}" in str(raised.value)
        assert pool.restarts == 0, "bad input is not a dead process"
        processes = list(pool._pool._processes.values())
        assert processes and all(p.is_alive() for p in processes)
    finally:
        pool.close()
    for p in processes:
        p.join(timeout=10)
    assert not any(p.is_alive() for p in processes)


def test_warm_starts_every_process_before_a_batch_and_the_batch_stages_in_them(tmp_path):
    log_dir, written = make_log(tmp_path)
    location = str(tmp_path / "tier")
    pool = StagePool(StageSettings(location=location, reader=ReaderOptions(log_dir)), 2, split_bytes=100_000)
    try:
        pool.warm()
        started = set(pool._pool._processes)
        assert len(started) == 2, "one process a task, started without waiting for a batch"
        parts, records = pool.stage(written[0].phy_offset, written[-1].phy_offset + written[-1].size)
        assert set(pool._pool._processes) == started and pool.restarts == 0
    finally:
        pool.close()
    assert records == len(written)
    assert staged_rows(location, parts) == expected_rows(written)


def test_ranges_staged_ahead_are_taken_by_a_batch_that_holds_them_and_the_others_deleted_before_it_stages(tmp_path):
    """A batch takes what was staged ahead for exactly its ranges; a guessed range it does not hold
    is deleted before the batch stages, even one starting where the batch's last range starts (the
    same object name): every object left is a part of a batch, and holds what the ledger wrote."""
    import time

    log_dir, written = make_log(tmp_path)
    location = str(tmp_path / "tier")
    begin, end = written[0].phy_offset, written[-1].phy_offset + written[-1].size
    pool = StagePool(StageSettings(location=location, reader=ReaderOptions(log_dir)), 2, split_bytes=100_000)
    try:
        guessed = pool.ranges(begin, end)
        assert len(guessed) > 4
        pool.stage_ahead(begin, end, [a for a, _ in guessed[1:]])  # the guess: the whole log in one batch
        while not all(f.done() for f in pool._ahead.values()):
            time.sleep(0.05)
        assert len(objects(location)) == len(guessed), "the guess was staged"
        # The batch Spark runs ends inside the guess's third range.
        inside = next(m for m in written if guessed[2][0] < m.phy_offset)
        first, _ = pool.stage(begin, inside.phy_offset)
        assert (pool.ahead_used, pool.ahead_dropped) == (2, len(guessed) - 2)
        assert objects(location) == {p.name for p in first}, "what no batch holds is deleted"
        assert staged_rows(location, first) == [r for r in expected_rows(written) if r["phy_offset"] < inside.phy_offset]
        second, records = pool.stage(inside.phy_offset, end)
    finally:
        pool.close()
    assert objects(location) == {p.name for p in first + second}
    assert staged_rows(location, first + second) == expected_rows(written)
    assert records == sum(1 for m in written if m.phy_offset >= inside.phy_offset)


def test_close_deletes_what_was_staged_ahead_for_a_batch_that_never_ran(tmp_path):
    log_dir, written = make_log(tmp_path, messages=600)
    location = str(tmp_path / "tier")
    pool = StagePool(StageSettings(location=location, reader=ReaderOptions(log_dir)), 2, split_bytes=20_000)
    try:
        begin, end = written[0].phy_offset, written[-1].phy_offset + written[-1].size
        guessed = pool.ranges(begin, end)
        pool.stage_ahead(begin, end, [a for a, _ in guessed[1:]])
        next(iter(pool._ahead.values())).result()  # at least one staged its object
    finally:
        pool.close()
    assert pool.ahead_dropped == len(guessed) and not objects(location)


def objects(location: str) -> set[str]:
    backend = open_backend(location)
    try:
        return {o.name for o in backend.list("") if "staging" in o.name}
    finally:
        backend.close()


def test_ranges_cut_with_a_long_lived_reader_are_the_ones_a_new_reader_cuts(tmp_path):
    """The tiering query hands the pool its own header reader, which walked to the frontier already:
    the ranges cut from the boundaries it kept are those a reader of its own walks to."""
    from connectors.commitlog.reader import CommitLogReader

    log_dir, written = make_log(tmp_path)
    settings = StageSettings(location=str(tmp_path / "tier"), reader=ReaderOptions(log_dir))
    with CommitLogReader(log_dir) as kept:
        kept.end_offset()
        shared, alone = StagePool(settings, 1, 20_000, lambda: kept), StagePool(settings, 1, 20_000)
        starts = [m.phy_offset for m in written]
        end = written[-1].phy_offset + written[-1].size
        for a, b in [(starts[0], end), (starts[500], starts[2000]), (starts[2000], end), (starts[2999], end)]:
            assert shared.ranges(a, b) == alone.ranges(a, b)
        assert kept._boundaries.first <= starts[2999] < kept._boundaries.end, "cut from what it kept"
