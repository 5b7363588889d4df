"""The thread that runs a query without a Spark stream (the mirror): woken by the tier's commits,
stopped after its step in flight, and its failure reported as the runner reads a Spark query's."""

from __future__ import annotations

import threading
import time

from connectors.errors import StopRequested
from connectors.kafka.errors import KafkaSinkError
from streaming.follower import Follower
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
