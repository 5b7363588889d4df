"""The thread that runs a query without a Spark stream (the mirror): woken by the tier's commits,
stopped after its step in flight, and its failure reported as the runner reads a Spark query's."""

from __future__ import annotations

import os
import threading
import time

from connectors.errors import StopRequested
from connectors.kafka.errors import KafkaSinkError
from streaming.runtime.follower import Follower
from streaming.service import _root_cause

HOUR = 3600.0  # a clock that never fires within a test: every step after the first is a wake's


def _wait(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_wake_runs_a_step_at_once_and_a_wake_during_a_step_runs_one_more():
    ran, release = [], threading.Event()

    def step():
        ran.append(threading.current_thread().name)
        if len(ran) == 2:
            release.wait(10)  # the second step is in flight while the test wakes it again

    follower = Follower("mirror", step, HOUR).start()
    try:
        _wait(lambda: len(ran) == 1)  # the first step runs at start
        follower.wake()
        _wait(lambda: len(ran) == 2)
        follower.wake()  # during the second step
        release.set()
        _wait(lambda: len(ran) == 3)
        time.sleep(0.2)
        assert len(ran) == 3, "one wake, one step"
        assert ran == ["tierlog-mirror"] * 3  # on the follower's own thread, not the test's
    finally:
        follower.stop()
    assert not follower.isActive and follower.exception() is None


def test_a_step_that_did_work_is_followed_by_another_at_once_without_a_wake():
    """A step takes a bounded part (the mirror: what the driver sends), so after one that did work
    the follower looks again before it waits; a step that found nothing waits for a wake."""
    ran = []

    def step():
        ran.append(time.monotonic())
        return len(ran) <= 3  # three steps that did work, then nothing left

    follower = Follower("mirror", step, HOUR).start()
    try:
        _wait(lambda: len(ran) == 4)
        time.sleep(0.2)
        assert len(ran) == 4, "the step that found nothing waits for a wake"
        follower.wake()
        _wait(lambda: len(ran) == 5)
    finally:
        follower.stop()
    assert follower.exception() is None


def test_stop_waits_for_the_step_in_flight_and_no_step_starts_after_it():
    entered, finished = threading.Event(), []

    def step():
        entered.set()
        time.sleep(0.3)
        finished.append(time.monotonic())

    follower = Follower("mirror", step, HOUR).start()
    assert entered.wait(10)
    follower.wake()  # a wake pending at the stop starts nothing
    follower.stop()
    stopped = time.monotonic()
    assert len(finished) == 1 and finished[0] <= stopped
    assert follower.awaitTermination(0) and not follower.isActive


def test_a_steps_error_ends_the_thread_and_reads_as_a_spark_querys_failure():
    follower = Follower("mirror", lambda: (_ for _ in ()).throw(KafkaSinkError("topic orders: not authorized")), HOUR)
    follower.start()
    assert follower.awaitTermination(10)
    message, kind = _root_cause(str(follower.exception()))
    assert (message, kind) == ("topic orders: not authorized", KafkaSinkError)


def test_a_stop_requested_ends_the_thread_without_an_error():
    def step():
        raise StopRequested("stop requested before this batch started")

    follower = Follower("mirror", step, HOUR).start()
    assert follower.awaitTermination(10)
    assert follower.exception() is None


def test_a_mirror_behind_sends_driver_sized_batches_and_only_a_backfill_goes_to_spark_whole():
    from connectors.tier.feed import FeedBatch
    from streaming.queries.mirror.handler import driver_sized_end

    def batches(*sizes, start=0, step=100):
        return [FeedBatch(start + i * step, start + (i + 1) * step, ((f"o{i}", size, start + i * step),))
                for i, size in enumerate(sizes)]

    mb = 1 << 20
    # Two tier batches of 5 MiB together: the first alone, on the driver (8 MiB).
    assert driver_sized_end(batches(5 * mb, 5 * mb), 0, 200, 8 * mb) == 100
    assert driver_sized_end(batches(3 * mb, 4 * mb, 3 * mb), 0, 300, 8 * mb) == 200
    # One batch over the limit is a step alone (the driver sends it, one staging object at a time).
    assert driver_sized_end(batches(9 * mb, 1 * mb), 0, 200, 8 * mb) == 100
    # A catch-up (7 x 5 MiB) is cut to the driver's size too; a backfill goes whole; 0 means
    # always Spark's tasks.
    assert driver_sized_end(batches(*[5 * mb] * 7), 0, 700, 8 * mb) == 100
    assert driver_sized_end([FeedBatch(0, 5_000, (), backfill=True)], 0, 5_000, 8 * mb) == 5_000
    assert driver_sized_end(batches(5 * mb, 5 * mb), 0, 200, 0) == 200
    # Batches without objects (the tier's filter left nothing) weigh nothing.
    assert driver_sized_end([FeedBatch(0, 100, ())] + batches(5 * mb, start=100), 0, 200, 8 * mb) == 200


def test_the_runner_counts_every_batch_since_its_last_tick_reading_only_the_newest_reports(spark, tmp_path):
    """``Service._new_progress`` reads the newest few of Spark's progress reports, more while the
    oldest it read is not counted yet; Spark's own ``recentProgress`` (all it keeps) is the oracle."""
    from streaming.service import Service

    source = tmp_path / "in"
    source.mkdir()
    for i in range(6):
        path = source / f"{i}.json"
        path.write_text("\n".join('{"v": %d}' % j for j in range(i + 1)))
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # Spark takes the files oldest first
    stream = (spark.readStream.schema("v int").option("maxFilesPerTrigger", 1).json(str(source))
              .writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck"))
              .trigger(availableNow=True).start())
    stream.awaitTermination(120)
    oracle = [p for p in stream.recentProgress if p.numInputRows]
    assert [p.numInputRows for p in oracle] == [1, 2, 3, 4, 5, 6]
    runner = Service.__new__(Service)
    for seen_batch in (0, 3):  # the truth, and a tick that thought more had run (the reads double)
        runner._seen_progress = {"q": (oracle[0].timestamp, seen_batch)}
        rows = [p.numInputRows for p in runner._new_progress("q", stream, stream.lastProgress) if p.numInputRows]
        assert rows == [2, 3, 4, 5, 6]
    runner._seen_progress = {}
    assert [p.numInputRows for p in runner._new_progress("q", stream, stream.lastProgress)
            if p.numInputRows] == [1, 2, 3, 4, 5, 6]
