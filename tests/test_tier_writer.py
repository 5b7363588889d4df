"""The tier's write protocol without Spark: ``TierWriter`` driven by the real stager over a real
commitlog, in random sequences of commits, seals, expirations, folds and restarts, and with a crash
before every write it makes; each run compared with the writers' ledger (``tests.ledger``).

A crash is an exception raised in place of the n-th write (a backend put or delete, or a write
of the metadata store), after which nothing of the process is kept but what it wrote: the store
is closed and opened again, a new writer opens the tier, and the batch in flight is staged again
from where the tier ended, as Spark runs a batch again after a crash.
"""

from __future__ import annotations

import random
import time

import pytest

from connectors.commitlog.reader import ReaderOptions
from connectors.commitlog.workload import Workload
from connectors.commitlog.writer import CommitLogWriter
from connectors.tier.location import open_backend
from connectors.tier.reader import TierReader
from connectors.tier.retention import Retention
from connectors.tier.staging import CommitLogGaps, StageSettings, stage, stage_range
from connectors.tier.writer import SkippedMessagesError, TierWriter, WriterSettings
from state.metadata import MetadataStore
from tests import ledger
from tests.oracle import entered_a_queue, message_row, normalize_arrow_row


class Crash(Exception):
    """The process died at this write."""


class Faults:
    """Counts the writer's writes; the ``at``-th raises ``Crash`` instead of happening."""

    def __init__(self, at: int | None = None):
        self.at, self.count, self.fired = at, 0, None

    def write(self, what: str) -> None:
        self.count += 1
        if self.count == self.at:
            self.fired = what
            raise Crash(what)


class FaultyBackend:
    def __init__(self, backend, faults: Faults):
        self._backend, self._faults = backend, faults

    def put(self, name, data):
        self._faults.write(f"put {name.split('/')[0]}")
        return self._backend.put(name, data)

    def delete(self, name):
        self._faults.write(f"delete {name.split('/')[0]}")
        return self._backend.delete(name)

    def __getattr__(self, name):
        return getattr(self._backend, name)


class FaultyIndex:
    WRITES = ("record_dispatch", "apply", "schedule_deletes", "forget_deletes", "rebuild")

    def __init__(self, store: MetadataStore, faults: Faults):
        self._store, self._faults, self.path = store, faults, store.path

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name not in self.WRITES:
            return attr

        def write(*args, **kwargs):
            self._faults.write(f"index {name}")
            return attr(*args, **kwargs)
        return write


class Run:
    """One tier, one commitlog, one metadata store; the writer opened (and reopened) over them."""

    def __init__(self, root, *, messages: int, seed: int, faults: Faults, feed: bool = False):
        self.root, self.faults, self.feed = root, faults, feed
        self.log_dir, self.location = str(root / "commitlog"), str(root / "tier")
        with CommitLogWriter(self.log_dir, file_size=64 * 1024, fsync="never") as w:  # files roll often
            ledger.append(w, Workload(messages=messages, topics=2, queues=3, keys=40, body_size=150,
                                      delete_ratio=0.1, seed=seed).generate())
        self.written = ledger.stored(self.log_dir)
        self.stage_settings = StageSettings(location=self.location, reader=ReaderOptions(self.log_dir))
        self.settings = WriterSettings(location=self.location, segment_messages=15, segment_age_s=1e9,
                                       retention=Retention(messages={"topic-1": 20}, check_s=0),
                                       fold_every=6, delete_grace_s=0)
        self.gaps = CommitLogGaps(ReaderOptions(self.log_dir))
        self.store = self.writer = None
        self.open()

    def open(self) -> None:
        self.store = MetadataStore(str(self.root / "metadata"))
        if self.feed:  # a consumer of the tier (the mirror) is configured: the service opens the feed
            self.store.feed.open("mirror", None)
        backend = FaultyBackend(open_backend(self.location), self.faults)
        self.writer = TierWriter(self.settings, FaultyIndex(self.store, self.faults), backend)

    def restart(self) -> None:
        self.writer.close()
        self.store.close()
        self.open()

    def parts(self, first: int, last: int, pieces: int, rng: random.Random):
        """Stage messages ``first .. last - 1`` of the log, from where the tier ended, in ``pieces``
        ranges cut at random record boundaries, as Spark's partitions would; with ``pieces`` 0, as
        the driver stages a small batch: from its offset range alone, which starts where the batch
        before it ended (a file's blank tail, when the log rolled there)."""
        floor = self.writer.source_end or 0
        batch = [m for m in self.written[first:last] if m.phy_offset >= floor]
        if not batch:
            return []
        if pieces == 0:
            before = self.written[first - 1] if first else None
            start = max(floor, before.phy_offset + before.size if before else 0)
            part, read = stage_range(self.stage_settings, start, batch[-1].phy_offset + batch[-1].size)
            assert read == len(batch)
            return [part] if part is not None else []
        cuts = sorted(rng.sample(range(1, len(batch)), min(pieces - 1, len(batch) - 1))) if len(batch) > 1 else []
        out = []
        for a, b in zip([0, *cuts], [*cuts, len(batch)]):
            lo, end = batch[a].phy_offset, batch[b - 1].phy_offset + batch[b - 1].size
            out.append(stage(self.stage_settings, lo, end, batch[b - 1].phy_offset))
        return out

    def maintain(self) -> None:
        """``TierWriter.maintain`` a minute ahead of the clock, so every object retired so far is past
        its grace (0 s) and deleted now.  On the wall clock, an object retired in the same
        millisecond as the call waited for a later one, so the number of writes of a run moved with
        timing (67 or 80 for one seed), and the crash test's n-th write was sometimes never reached."""
        self.writer.maintain(int(time.time() * 1000) + 60_000)

    def close(self) -> None:
        self.writer.close()
        self.store.close()


def drive(root, seed: int, crash_at: int | None = None, messages: int = 240, feed: bool = False) -> tuple[Run, dict]:
    """A random sequence of batches, each followed by random maintenance, folds and restarts."""
    rng = random.Random(seed)
    run = Run(root, messages=messages, seed=seed, faults=Faults(crash_at), feed=feed)
    did = {"batches": 0, "on_driver": 0, "maintain": 0, "fold": 0, "restart": 0, "crash": 0}
    first, batch_id = 0, 0
    while first < len(run.written):
        last = min(len(run.written), first + rng.randint(1, 40))
        pieces = rng.randint(0, 3)
        ops = rng.sample(["maintain", "fold", "restart", "maintain"], rng.randint(0, 3))


        def batch():
            run.writer.commit(batch_id, run.parts(first, last, pieces, rng), run.gaps.between)
            for op in ops:
                run.restart() if op == "restart" else run.maintain() if op == "maintain" else run.writer.fold()
                did[op] += 1
        surviving(run, batch, did)
        did["batches"] += 1
        did["on_driver"] += pieces == 0
        first, batch_id = last, batch_id + 1
    surviving(run, run.maintain, did)  # the writer of the moment, after any restart
    return run, did


def surviving(run: Run, step, did: dict) -> None:
    """``step()``; after a crash, restart and run it again (a batch from where the tier ended)."""
    while True:
        try:
            return step()
        except Crash:
            did["crash"] += 1
            run.restart()


def assert_tier_equals_ledger(run: Run) -> dict:
    """Every queue holds exactly the ledger's messages from its lowest retained offset to its
    commit offset, which is the queue's end; the metadata store says the same.  Returns the queues."""
    reader = TierReader(run.location)
    states = reader.committed().queue_states()
    expected = [message_row(m) for m in run.written if entered_a_queue(message_row(m))]
    ends: dict[tuple[str, int], int] = {}
    for row in expected:
        key = (row["topic"], row["queue_id"])
        ends[key] = max(ends.get(key, 0), row["queue_offset"] + 1)
    assert {k: s.commit for k, s in states.items()} == ends
    kept = [r for r in expected if r["queue_offset"] >= states[(r["topic"], r["queue_id"])].low]
    got = sorted((normalize_arrow_row(r) for r in reader.read_all().to_pylist()), key=lambda r: r["phy_offset"])
    assert [r["phy_offset"] for r in got] == [r["phy_offset"] for r in kept]
    assert got == kept
    indexed = {(q.topic, q.queue_id): (q.commit, q.sealed, q.low) for q in run.store.queues()}
    assert indexed == {k: (s.commit, s.sealed, s.low) for k, s in states.items()}
    committed = reader.committed()
    for key in states:
        assert [s.base for s in run.store.segments(*key)] == [s.base for s in committed.segments_for(key)]
    return states


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_of_commits_seals_expirations_folds_and_restarts_equal_the_ledger(tmp_path, seed):
    run, did = drive(tmp_path, seed)
    try:
        states = assert_tier_equals_ledger(run)
        assert did["batches"] > 5 and did["on_driver"] and did["maintain"] and did["fold"] and did["restart"], did
        assert any(s.sealed > 0 for s in states.values()), "nothing was sealed"
        assert any(s.low > 0 for k, s in states.items() if k[0] == "topic-1"), "retention expired nothing"
        assert all(s.low == 0 for k, s in states.items() if k[0] == "topic-0"), "retention is topic-1's only"
    finally:
        run.close()


def test_a_crash_before_any_write_of_the_protocol_loses_and_duplicates_nothing(tmp_path):
    clean, _ = drive(tmp_path / "clean", seed=11, messages=120)
    writes = clean.faults.count
    clean.close()
    assert writes > 50, writes
    kinds = set()
    for at in range(1, writes + 1):
        run, did = drive(tmp_path / f"crash-{at}", seed=11, crash_at=at, messages=120)
        try:
            assert did["crash"] == 1, (at, did)
            kinds.add(run.faults.fired)
            assert_tier_equals_ledger(run)
        finally:
            run.close()
    # every kind of write the protocol makes was crashed at, at least once
    assert {"put _log", "put topic=test", "put _keys", "put _meta", "delete _log", "delete _staging",
            "index record_dispatch", "index apply", "index forget_deletes"} <= {
        k.replace("topic=topic-0", "topic=test").replace("topic=topic-1", "topic=test") for k in kinds}, kinds


def test_a_batch_above_the_tiers_end_is_refused_and_nothing_is_written(tmp_path):
    run = Run(tmp_path, messages=60, seed=3, faults=Faults())
    try:
        rng = random.Random(0)
        run.writer.commit(0, run.parts(0, 20, 1, rng), run.gaps.between)
        seq, writes = run.writer.head.seq, run.faults.count
        skipping = run.parts(25, 40, 2, rng)
        with pytest.raises(SkippedMessagesError, match=r"5 message\(s\) in between would be skipped"):
            run.writer.commit(1, skipping, run.gaps.between)
        assert (run.writer.head.seq, run.faults.count) == (seq, writes)
    finally:
        run.close()


def test_a_batch_commits_while_a_seal_is_built_and_the_tier_equals_the_ledger(tmp_path):
    """The tiering query lets commits go on while a maintenance's seal reads its staging objects and
    writes its segments (``plan_seal``, then ``build_seal`` without the writer's lock, then
    ``finish_seal``); a batch committed in between is neither sealed nor retired by it."""
    rng = random.Random(11)
    run = Run(tmp_path, messages=240, seed=11, faults=Faults())
    half = len(run.written) // 2
    run.writer.commit(0, run.parts(0, half, 2, rng), run.gaps.between)
    now_ms = int(time.time() * 1000) + 60_000
    plan = run.writer.plan_seal(now_ms)
    assert plan.keys and plan.holding  # 15 messages a segment: queues are due
    built = run.writer.build_seal(plan)
    run.writer.commit(1, run.parts(half, len(run.written), 2, rng), run.gaps.between)  # beside the seal
    assert run.writer.finish_seal(built, now_ms) == len(built.segments) > 0
    run.writer.finish_maintenance(now_ms)
    sealed = {(s.topic, s.queue_id): s.end for s in built.segments}
    states = run.writer.head.queues
    assert all(states[k].sealed == end + 1 < states[k].commit for k, end in sealed.items())  # batch 1 is not in them
    run.maintain()
    assert_tier_equals_ledger(run)


def test_a_seal_with_no_grace_deletes_the_staging_objects_it_retired_at_once(tmp_path):
    """On the wall clock, as the service calls it: a seal retires its staging objects at the
    maintenance's own clock, so with a grace of 0 the same call deletes them.  Retired at a later
    ``time.time()``, they stayed until a next maintenance, and a run whose last maintenance sealed
    stopped with them (CI: test_tier_holds_exactly_the_commitlog_and_seals_segments)."""
    rng = random.Random(5)
    run = Run(tmp_path, messages=240, seed=5, faults=Faults())
    try:
        run.writer.commit(0, run.parts(0, len(run.written), 3, rng), run.gaps.between)
        staged = {o.name for o in run.writer.backend.list() if o.name.startswith("_staging/")}
        assert run.writer.maintain() > 0
        retired = staged - set(run.writer.head.staging)
        assert retired, "a seal of every queue retires staging objects"
        left = {o.name for o in run.writer.backend.list()} & retired
        assert not left and not set(run.store.pending_deletes()) & retired
    finally:
        run.close()


class _DeletesFail:
    """A backend whose deletes of staging objects fail (an object store refusing them at a stop)."""

    def __init__(self, backend):
        self._backend, self.refused = backend, 0

    def delete(self, name):
        if name.startswith("_staging/"):
            self.refused += 1
            raise OSError(f"refused to delete {name}")
        return self._backend.delete(name)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_a_clean_stop_deletes_what_is_past_its_grace_and_a_failed_delete_does_not_fail_it(tmp_path, caplog):
    """``TieringHandler.flush`` (a clean stop) deletes the objects past their grace after its fold.
    When the object store refuses, the stop is still clean (a warning): the objects stay listed
    for deletion, and the next stop or maintenance deletes them."""
    import dataclasses

    from streaming.queries.tiering.handler import TieringHandler, TieringSettings

    rng = random.Random(3)
    run = Run(tmp_path, messages=240, seed=3, faults=Faults())
    run.writer.close()
    settings = dataclasses.replace(run.settings, delete_grace_s=3600.0)  # nothing is due at the seal
    handler = TieringHandler(TieringSettings(run.stage_settings, settings), run.store)
    try:
        handler.writer.commit(0, run.parts(0, len(run.written), 2, rng), run.gaps.between)
        assert handler.writer.maintain() > 0
        retired = {n for n in run.store.pending_deletes() if n.startswith("_staging/")}
        assert retired
        object.__setattr__(handler.writer.settings, "delete_grace_s", 0.0)  # now past their grace
        failing = handler.writer.backend = _DeletesFail(handler.writer.backend)
        with caplog.at_level("WARNING", logger="tierlog.tier"):
            handler.flush()
        assert failing.refused and "the next start deletes them" in caplog.text
        assert retired <= set(run.store.pending_deletes()) and retired <= {o.name for o in failing.list()}
        handler.writer.backend = failing._backend
        handler.flush()
        assert not retired & set(run.store.pending_deletes())
        assert not retired & {o.name for o in handler.writer.backend.list()}
    finally:
        handler.close()
        run.store.close()


def test_the_staging_processes_start_with_the_query_only_when_it_starts_behind(tmp_path):
    """``TieringHandler.start_behind``: the processes start before any batch when more than the
    driver stages in one batch lies past where tiering resumes (the checkpoint's end, else
    ``source.starting_offset``, never below the tier's end); a stream that starts at the head, or
    resumes there, never starts them."""
    from streaming.sources.commitlog import starting_offset
    from streaming.queries.tiering.handler import TieringHandler, TieringSettings

    run = Run(tmp_path, messages=240, seed=5, faults=Faults())
    run.writer.close()
    end = run.written[-1].phy_offset + run.written[-1].size
    half = run.written[len(run.written) // 2].phy_offset
    cases = [((None, "earliest"), True), ((None, "latest"), False), ((None, str(half)), True),
             ((end, "earliest"), False), ((half, "earliest"), True)]

    def resumes_at(resume, starting) -> int:  # as TieringQuery.start finds it
        with ReaderOptions(run.log_dir).open(check_crc=False) as reader:
            return resume if resume is not None else starting_offset(reader, starting)

    def handler() -> TieringHandler:
        return TieringHandler(TieringSettings(run.stage_settings, run.settings, driver_stage_bytes=(end - half) // 2,
                                              stage_processes=2), run.store)

    try:
        for (resume, starting), warmed in cases:
            h = handler()
            try:
                h.start_behind(resumes_at(resume, starting), end)
                assert (h.pool._pool is not None) == warmed, (resume, starting)
            finally:
                h.close()
        # Below the tier's end nothing is staged again: a tier that holds the whole log starts none.
        h = handler()
        try:
            h.writer.commit(0, run.parts(0, len(run.written), 2, random.Random(5)), run.gaps.between)
            assert h.writer.source_end == end
            h.start_behind(resumes_at(None, "earliest"), end)
            assert h.pool._pool is None
        finally:
            h.close()
    finally:
        run.store.close()


def test_batches_take_what_was_staged_ahead_and_a_wrong_guess_leaves_no_object_behind(tmp_path):
    """``TieringHandler`` stages the first batch ahead from where the query starts, and each next
    batch while one stages (``expect``: the batch the stream is expected to run).  The stream here
    runs one batch as guessed, then one half as long, one the driver stages, then the rest: the
    tier equals the ledger, and every staging object left is one the tier holds or will delete."""
    from types import SimpleNamespace

    from streaming.queries.tiering.handler import TieringHandler, TieringSettings

    run = Run(tmp_path, messages=900, seed=9, faults=Faults())
    run.writer.close()
    first, end = run.written[0].phy_offset, run.written[-1].phy_offset + run.written[-1].size
    guess, split = (end - first) // 3, (end - first) // 20

    def expect(begin: int):
        with ReaderOptions(run.log_dir).open(check_crc=False) as reader:
            scan = reader.scan(begin, None, max_bytes=guess, split_bytes=split)
        return scan.end, scan.splits

    def boundary(at: int) -> int:  # the first record at or after ``at``
        return next((m.phy_offset for m in run.written if m.phy_offset >= at), end)

    b0 = expect(first)[0]
    b1 = boundary(b0 + guess // 2)
    b2 = boundary(b1 + split // 4)
    assert first < b0 < b1 < b2 < end
    h = TieringHandler(TieringSettings(run.stage_settings, run.settings, driver_stage_bytes=split // 2,
                                       stage_processes=2, split_bytes=split), run.store, expect=expect)
    try:
        h.start_behind(first, end)
        assert h.pool._ahead, "the first batch was staged ahead"
        staged_by = []
        h.on_batch = lambda report: staged_by.append(report.staged_by)
        for i, (a, b) in enumerate([(first, b0), (b0, b1), (b1, b2), (b2, end)]):
            h.process(SimpleNamespace(df=None, batch_id=i, start=a, end=b))
        h.flush()
        assert staged_by == ["processes", "processes", "driver", "processes"]
        assert h.pool.ahead_used > 0 and h.pool.ahead_dropped > 0
    finally:
        h.close()
    assert_tier_equals_ledger(run)
    committed = TierReader(run.location).committed()
    backend = open_backend(run.location)
    try:
        listed = {o.name for o in backend.list("") if "staging" in o.name}
    finally:
        backend.close()
    assert not listed - set(committed.staging) - set(run.store.pending_deletes())
    run.store.close()
