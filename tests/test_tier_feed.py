"""The tier feed without Spark: what a consumer of the tier (the Kafka mirror) reads back from the
tier's committed batches, against the writers' ledger (``tests.ledger``), through the tier writer's
random seals, expiries, folds, restarts and a crash before each of its writes
(``tests.test_tier_writer.drive``).

The oracle is the ledger alone: a consumer that has applied nothing must read every message that
entered a queue, once and in each queue's order, though the tier sealed, retired and (past its
grace) would have deleted the staging objects that held them.
"""

from __future__ import annotations

import os

import pytest

from connectors.kafka.mirror_sink import ROW, in_order
from connectors.tier.feed import read_batches, read_unsorted
from connectors.errors import TierlogError
from connectors.tier.location import open_backend
from state.tier_feed import FeedGapError
from tests.oracle import entered_a_queue, message_row, normalize_arrow_row
from tests.test_tier_writer import assert_tier_equals_ledger, drive


def read_back(run, start: int, end: int) -> list[dict]:
    """What a consumer reads back, both ways: sorted (``read_batches``), and as the mirror reads it
    (``read_unsorted``, each part's bodies left where they were read, each row pointing at its
    own: ``Records.value_rows``), which must agree."""
    backend = open_backend(run.location)
    batches = run.store.feed.batches(start, end)
    rows = [normalize_arrow_row(r) for b in read_batches(backend, batches, start, end, broker=run.writer.settings.broker)
            for r in b.to_pylist()]
    mirrored = []
    for part in read_unsorted(backend, batches, start, end, broker=run.writer.settings.broker):
        if part.order is not None:
            UNSORTED_PARTS.append(len(part.order))
        for batch, bodies in in_order(part):  # what the mirror's send_batch is handed
            if bodies is None:
                mirrored += batch.to_pylist()
                continue
            others = batch.drop_columns([ROW]).to_pylist()
            taken = bodies.take(batch.column(ROW)).to_pylist()
            mirrored += [{**r, "body": body} for r, body in zip(others, taken)]
    assert [normalize_arrow_row(r) for r in mirrored] == rows
    backend.close()
    return rows


UNSORTED_PARTS: list[int] = []  # the rows of each part read_back read out of physical order


def expected_rows(run, start: int = 0) -> list[dict]:
    return [row for m in run.written if entered_a_queue(row := message_row(m)) and m.phy_offset >= start]


def in_queue_order(rows: list[dict]) -> bool:
    last: dict = {}
    for r in rows:
        key = (r["topic"], r["queue_id"])
        if r["queue_offset"] <= last.get(key, -1):
            return False
        last[key] = r["queue_offset"]
    return True


def staging_objects(run) -> set[str]:
    names = run.writer.log.names
    return {o.name for o in run.writer.backend.list(names.staging_prefix)}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_consumer_reads_every_message_once_though_the_tier_sealed_and_retired_them(tmp_path, seed):
    run, did = drive(tmp_path, seed, feed=True)
    assert did["maintain"] and did["restart"]
    states = assert_tier_equals_ledger(run)
    assert any(s.sealed for s in states.values())  # staging objects were retired under the consumer
    end = run.writer.source_end
    UNSORTED_PARTS.clear()
    rows = read_back(run, 0, end)
    assert UNSORTED_PARTS, "no staging object held several queues: the mirror's reorder went untested"
    assert in_queue_order(rows)
    assert sorted(rows, key=lambda r: r["phy_offset"]) == expected_rows(run)
    # From a batch boundary in the middle: exactly the messages after it.
    middle = run.store.feed.batches(0, end)[len(run.store.feed.batches(0, end)) // 2].end
    assert sorted(read_back(run, middle, end), key=lambda r: r["phy_offset"]) == expected_rows(run, middle)
    run.close()


def test_released_batches_are_deleted_and_no_longer_readable(tmp_path):
    run, _ = drive(tmp_path, 4, feed=True)
    held = staging_objects(run)
    live = set(run.writer.head.staging)
    assert held - live, "the run retired no staging object to hold"
    end = run.writer.source_end
    batches, size = run.store.feed.held()
    assert batches == len(run.store.feed.batches(0, end)) and size >= sum(
        o[1] for b in run.store.feed.batches(0, end) for o in b.objects) > 0
    run.store.feed.release("mirror", end)
    assert run.store.feed.held() == (0, 0)
    run.maintain()
    assert staging_objects(run) == live
    assert run.store.held_from() is None
    with pytest.raises(FeedGapError, match="not listed"):
        run.store.feed.batches(0, end)
    assert run.store.feed.batches(end, end + 1) == []
    run.close()


@pytest.mark.parametrize("crash_at", [5, 17, 33, 58])
def test_a_crash_at_any_write_loses_no_listed_batch(tmp_path, crash_at):
    run, did = drive(tmp_path, 5, crash_at=crash_at, feed=True)
    assert did["crash"] == 1
    rows = read_back(run, 0, run.writer.source_end)
    assert sorted(rows, key=lambda r: r["phy_offset"]) == expected_rows(run)
    run.close()


def test_a_batch_stays_listed_until_every_consumer_is_past_it_and_a_late_consumer_is_backfilled(tmp_path):
    """Compaction and the mirror each release the feed to their own position; a batch is unlisted
    (and its retired staging objects deleted) only once both are past it.  A consumer that joins a
    listing behind it gets what came before as a backfill, and one that is gone holds nothing."""
    run, _ = drive(tmp_path, 4, feed=True)
    feed, end = run.store.feed, run.writer.source_end
    listed = feed.batches(0, end)
    middle = listed[len(listed) // 2].end
    assert feed.open("compaction", end, since=0) == (0, None)  # the listing starts at 0: nothing to backfill
    feed.release("mirror", end)
    assert feed.batches(0, end) == listed  # compaction has applied nothing yet
    feed.release("compaction", middle)
    assert feed.listed_from() == middle and feed.batches(middle, end) == listed[len(listed) // 2 + 1:]
    with pytest.raises(FeedGapError):
        feed.batches(0, end)
    at, backfill = feed.open("audit", end, since=0)  # a consumer that joins behind the listing
    assert at == 0 and (backfill.start, backfill.end, backfill.backfill) == (0, middle, True)
    rows, states = read_back(run, 0, end), assert_tier_equals_ledger(run)
    assert sorted(rows, key=lambda r: r["phy_offset"]) == [  # the backfill has what retention kept
        r for r in expected_rows(run) if r["phy_offset"] >= middle or r["queue_offset"] >= states[
            (r["topic"], r["queue_id"])].low]
    assert feed.keep_only(["mirror", "compaction"]) == ["audit"]
    assert feed.listed_from() == middle
    feed.release("compaction", end)
    assert feed.held() == (0, 0)
    run.maintain()
    assert staging_objects(run) == set(run.writer.head.staging)
    assert feed.keep_only([]) == ["compaction", "mirror"] and feed.listed_from() is None
    run.close()


def test_without_a_consumer_nothing_is_listed_or_held(tmp_path):
    run, _ = drive(tmp_path, 1)
    assert run.store.feed.listed_from() is None and run.store.held_from() is None
    assert staging_objects(run) == set(run.writer.head.staging)
    with pytest.raises(FeedGapError, match="no consumer of the tier was configured"):
        run.store.feed.batches(0, 1)
    run.close()


def test_a_feed_opened_on_a_tier_that_holds_messages_backfills_them_from_the_tier(tmp_path):
    """A mirror turned on later (or whose position the listing lost) first reads what the tier
    committed from its position, from the tier's own view: every retained message once, in queue
    order; what retention dropped is not there (the service warns of it), nothing else is missing."""
    run, _ = drive(tmp_path, 6)
    states = assert_tier_equals_ledger(run)
    assert any(s.low for s in states.values())  # retention dropped some: the backfill must not invent them
    end = run.writer.source_end
    retained = [r for r in expected_rows(run) if r["queue_offset"] >= states[(r["topic"], r["queue_id"])].low]
    middle = retained[len(retained) // 2]["phy_offset"]
    assert run.store.feed.open("mirror", end, since=middle)[0] == middle
    rows = read_back(run, middle, end)
    assert in_queue_order(rows)
    assert sorted(rows, key=lambda r: r["phy_offset"]) == [r for r in retained if r["phy_offset"] >= middle]
    run.close()


class CountingGets:
    """The real backend, counting the requests that read an object (each ``read`` is one GET)."""

    def __init__(self, backend):
        self.backend, self.gets = backend, 0

    def read(self, name, start=0, length=None):
        self.gets += 1
        return self.backend.read(name, start, length)

    def read_whole(self, name):
        self.gets += 1  # one GET on S3 (a memory map on posix)
        return self.backend.read_whole(name)

    def open_input(self, name, size=None):
        raise AssertionError("the feed reads a staging object in one GET, not by ranges")

    def __getattr__(self, attr):
        return getattr(self.backend, attr)


def _tier_on_s3(tmp_path, s3_location, copies=None):
    """A commitlog of 3,000 messages tiered to ``s3_location`` in batches of one staging object;
    returns the messages written (the ledger), the metadata store and the listed batches."""
    from connectors.commitlog.workload import Workload
    from connectors.commitlog.writer import CommitLogWriter
    from state.metadata import MetadataStore
    from tests import ledger
    from tests.tiering_helpers import tier_in_batches

    log_dir = str(tmp_path / "commitlog")
    with CommitLogWriter(log_dir, file_size=1 << 20, fsync="never") as w:
        ledger.append(w, Workload(messages=3000, topics=2, queues=4, keys=100, body_size=200, seed=7).generate())
    store = MetadataStore(str(tmp_path / "metadata"))
    store.feed.open("mirror", None)
    cuts = tier_in_batches(log_dir, s3_location, store, 100_000, copies=copies)
    listed = store.feed.batches(cuts[0], cuts[-1])
    assert len(listed) == len(cuts) - 1 >= 5 and all(len(b.objects) == 1 for b in listed)
    return ledger.stored(log_dir), store, listed


def test_on_s3_a_committed_batch_is_read_back_with_one_get_per_staging_object(tmp_path, s3_location):
    """Without local copies (``tier.local_copy_bytes = 0``)."""
    import numpy as np

    from connectors.tier.feed import FeedMessages

    written, store, listed = _tier_on_s3(tmp_path, s3_location)
    start, end = listed[0].start, listed[-1].end
    backend = open_backend(s3_location)
    counting = CountingGets(backend)
    rows = [normalize_arrow_row(r) for b in read_batches(counting, listed, start, end) for r in b.to_pylist()]
    assert rows == [row for m in written if entered_a_queue(row := message_row(m))]  # one object a batch: phy order
    assert counting.gets == len(listed)  # one GET per committed batch
    # The KV writer's read of a batch's changed messages: one more GET per staging object it spans.
    counting.gets = 0
    one = listed[2]
    wanted = np.array([r["phy_offset"] for r in rows if one.start <= r["phy_offset"] < one.end][::7], np.int64)
    got = FeedMessages(counting, store.feed.batches, None).records_at(wanted, ("phy_offset", "body"))
    assert got["phy_offset"].to_pylist() == wanted.tolist() and counting.gets == len(one.objects) == 1
    inside = one.end - 1  # the last byte of a message, where no message starts
    with pytest.raises(TierlogError, match=f"physical offset {inside} is not in the tier's committed batches"):
        FeedMessages(counting, store.feed.batches, None).records_at(np.array([inside], np.int64), ("body",))
    backend.close()
    store.close()


def test_on_s3_the_stagers_local_copies_spare_every_get_and_never_change_what_is_read(tmp_path, s3_location):
    import numpy as np

    from connectors.tier.copies import CopySettings, LocalCopies
    from connectors.tier.feed import FeedMessages

    copies = CopySettings(str(tmp_path / "copies"), 64 << 20)
    written, store, listed = _tier_on_s3(tmp_path, s3_location, copies)
    start, end = listed[0].start, listed[-1].end
    expected = [row for m in written if entered_a_queue(row := message_row(m))]
    counting = CountingGets(open_backend(s3_location))
    reads = LocalCopies(counting, copies)
    rows = [normalize_arrow_row(r) for b in read_batches(reads, listed, start, end) for r in b.to_pylist()]
    assert rows == expected and counting.gets == 0  # compaction's partitions and the mirror's slots
    one = listed[2]
    wanted = np.array([r["phy_offset"] for r in rows if one.start <= r["phy_offset"] < one.end][::7], np.int64)
    got = FeedMessages(reads, store.feed.batches, None).records_at(wanted, ("phy_offset", "body"))
    assert got["phy_offset"].to_pylist() == wanted.tolist() and counting.gets == 0  # the KV writer's bodies

    # The byte bound keeps the newest copies; what it evicted is read from S3, the same rows.
    sizes = [size for b in listed for _, size, _ in b.objects]
    bounded = LocalCopies(counting, CopySettings(copies.directory, sum(sizes[-2:])))
    left = os.path.join(bounded.directory, "00000000000000000000.parquet.tmp-left-by-a-crash")
    with open(left, "wb") as f:
        f.write(b"half")
    os.utime(left, (1, 1))
    bounded.put("_staging/unrelated-probe", b"")  # any put trims to the bound, and drops what a crash left
    assert not os.path.exists(left)
    rows = [normalize_arrow_row(r) for b in read_batches(bounded, listed, start, end) for r in b.to_pylist()]
    assert rows == expected and counting.gets == len(listed) - 2

    # An upload that fails leaves no copy of the object it was replacing: a reader gets the tier's.
    name = listed[-2].objects[0][0]  # kept by the bound above

    class FailingPut(CountingGets):
        def put(self, name, data):
            raise OSError("injected: the upload failed")

    failing = LocalCopies(FailingPut(counting.backend), copies)
    assert os.path.exists(failing._path(name))
    with pytest.raises(OSError, match="injected"):
        failing.put(name, b"another content")
    assert not os.path.exists(failing._path(name))
    # A deleted object takes its copy with it.
    last = listed[-1].objects[0][0]
    assert os.path.exists(reads._path(last))
    reads.delete(last)
    assert not os.path.exists(reads._path(last)) and not counting.backend.exists(last)
    reads.close()
    store.close()


def test_a_mirror_batch_run_again_below_the_record_keeps_the_record(tmp_path):
    """A checkpoint rolled back (restored from a backup, say) makes Spark run a mirror batch that
    ends below what the mirror recorded as sent: it sends nothing, and the record stays, so the
    batches after it are not sent again."""
    from types import SimpleNamespace

    from connectors.sinks import MIRROR
    from state.metadata import MetadataStore
    from streaming.queries.mirror.handler import MirrorHandler

    store = MetadataStore(str(tmp_path / "metadata"))
    try:
        store.journal.record_sink(MIRROR, 5_000)
        handler = MirrorHandler(None, str(tmp_path / "tier"), store, start_at=0)
        handler.process(SimpleNamespace(batch_id=7, start=1_000, end=2_000, df=None))
        assert store.journal.sinks()[MIRROR] == 5_000
        assert handler.sent == 0
    finally:
        store.close()


def test_the_tierfeed_sources_listing_opens_its_secondary_again_when_a_catch_up_fails(tmp_path):
    """The source reads the feed as a RocksDB secondary; a catch-up that fails (here: its handle
    closed under it, as a file the primary replaced would) opens a new one instead of failing the query."""
    from state.metadata import MetadataStore
    from streaming.sources.tierfeed import _Listing

    store = MetadataStore(str(tmp_path / "metadata"))
    store.feed.open("mirror", None)
    store.write_json(store.feed.puts({"type": "batch", "source_start": 0, "source_end": 100, "staging": []}))
    listing = _Listing(store.path)
    try:
        assert listing.batch_ends(-1) == [(100, 100)]
        listing.db.close()  # the fault
        store.write_json(store.feed.puts({"type": "batch", "source_start": 100, "source_end": 250, "staging": []}))
        assert listing.batch_ends(-1) == [(100, 100), (250, 150)]
    finally:
        listing.close()
        store.close()


def test_the_tierfeed_sources_listing_tries_a_refused_secondary_again_in_a_new_scratch_directory(tmp_path,
                                                                                                 monkeypatch):
    """Fault injected: RocksDB refuses the first three secondary opens (as beside a primary writing
    its MANIFEST); the listing opens the fourth, each try in a scratch directory of its own, and
    leaves none of the refused ones behind."""
    from state import rocks
    from state.metadata import MetadataStore
    from streaming.sources.tierfeed import _Listing

    store = MetadataStore(str(tmp_path / "metadata"))
    store.feed.open("mirror", None)
    store.write_json(store.feed.puts({"type": "batch", "source_start": 0, "source_end": 100, "staging": []}))
    real, scratches = rocks.open_rdict, []

    def refuse_three(path, **kwargs):
        scratches.append(kwargs["secondary"])
        if len(scratches) <= 3:
            raise Exception("Invalid argument: leveldb.BytewiseComparator: does not match existing comparator")
        return real(path, **kwargs)

    monkeypatch.setattr(rocks, "open_rdict", refuse_three)
    monkeypatch.setattr(rocks.time, "sleep", lambda s: None)
    listing = _Listing(store.path)
    try:
        assert listing.batch_ends(-1) == [(100, 100)]
        assert len(set(scratches)) == 4 and listing.scratch == scratches[-1]
        assert not any(os.path.exists(s) for s in scratches[:3])
    finally:
        listing.close()
        store.close()


@pytest.mark.parametrize("max_bytes", [1, 20_000, 1 << 30])
def test_the_tierfeed_partitions_group_staging_objects_and_read_every_message_once(tmp_path, max_bytes):
    """``feed_partitions`` hands a task several small staging objects (a task's own cost is most of
    a small one's); whatever the grouping, the partitions read every message of the range once."""
    from streaming.sources.tierfeed import feed_partitions, read_partition

    run, _ = drive(tmp_path, 4, feed=True)
    end = run.writer.source_end
    batches = run.store.feed.batches(0, end)
    objects = [o for b in batches for o in b.objects]
    parts = feed_partitions(batches, 0, end, max_bytes=max_bytes)
    grouped = [[o for b in p.batches for o in b.objects] for p in parts]
    assert [o for g in grouped for o in g] == objects  # each object once, in order
    assert all(len(g) == 1 or sum(o[1] for o in g) <= max_bytes for g in grouped)
    assert len(parts) == (len(objects) if max_bytes == 1 else 1 if max_bytes == 1 << 30 else len(parts))
    assert 1 < len(parts) < len(objects) or max_bytes != 20_000
    columns = ("topic", "key", "phy_offset", "sysflag")
    read = sorted(r["phy_offset"] for p in parts
                  for b in read_partition(run.location, run.writer.settings.broker, columns, None, p)
                  for r in b.to_pylist())
    assert read == [r["phy_offset"] for r in expected_rows(run)]
    # As many tasks as Spark runs at once: objects of more than that many partitions are that many,
    # in order; under that, the grouping above stays.
    total = sum(o[1] for o in objects)
    for tasks in (1, 2, 3):
        shared = feed_partitions(batches, 0, end, max_bytes=max_bytes, tasks=tasks)
        assert [o for p in shared for b in p.batches for o in b.objects] == objects
        if total > tasks * max_bytes:
            assert len(shared) == min(tasks, len(objects))
        else:
            assert [p.batches for p in shared] == [p.batches for p in parts]
    run.close()


def test_a_secondarys_scratch_directory_removes_those_of_processes_that_have_ended(tmp_path):
    """Spark ends the process running a streaming source without waiting for its ``stop()``, so the
    scratch directories of the feed's secondaries are removed by the next one opened, by owner pid."""
    import subprocess
    import sys

    from streaming.sources.tierfeed import SCRATCH_PREFIX, _scratch_dir

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {"ended": f"{SCRATCH_PREFIX}{int(ended.stdout)}-abc", "living": f"{SCRATCH_PREFIX}{living.pid}-def",
                 "own": f"{SCRATCH_PREFIX}{os.getpid()}-ghi", "no owner": f"{SCRATCH_PREFIX}x1y2",
                 "not ours": "other-123-abc"}
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "LOG").write_text("RocksDB's info log")
        made = _scratch_dir(str(tmp_path))
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {n for k, n in names.items() if k != "ended"} | {os.path.basename(made)}
        assert os.path.basename(made).startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    finally:
        living.kill()
        living.wait()


def test_the_tierfeed_reduced_to_each_keys_last_message_equals_the_oracle_with_only_the_asked_columns(tmp_path):
    """Under ``latestPerKey`` a partition yields each key's last keyed message and only the columns
    asked for: the compaction query asks for no ``sysflag`` (every row entered a queue), so Spark
    filters nothing; the largest offset per key over the partitions is the oracle's."""
    from streaming.sources.tierfeed import feed_partitions, read_partition

    run, _ = drive(tmp_path, 5, feed=True)
    end = run.writer.source_end
    parts = feed_partitions(run.store.feed.batches(0, end), 0, end, max_bytes=20_000)
    assert len(parts) > 1
    keyed = [r for r in expected_rows(run) if r["key"] is not None]
    oracle: dict = {}
    for r in keyed:
        oracle[(r["topic"], r["key"])] = max(r["phy_offset"], oracle.get((r["topic"], r["key"]), -1))
    assert len(oracle) < len(keyed)  # keys repeat
    for columns in (("topic", "key", "phy_offset"), ("topic", "key", "phy_offset", "sysflag")):
        got: dict = {}
        for p in parts:
            seen = set()
            for b in read_partition(run.location, run.writer.settings.broker, columns, None, p, latest=True):
                assert tuple(b.schema.names) == columns
                for r in b.to_pylist():
                    assert (r["topic"], r["key"]) not in seen and r.get("sysflag", 0) == 0
                    seen.add((r["topic"], r["key"]))
                    got[(r["topic"], r["key"])] = max(r["phy_offset"], got.get((r["topic"], r["key"]), -1))
        assert got == oracle
    run.close()
