"""A query that runs without a Spark stream of its own: the runner calls its ``step`` on a thread,
as soon as a query that reads the commitlog committed a batch (``wake``), at least every
``interval_s``, and again at once after a step that did work (it returned True).

Why: a query over the tier's committed batches on Spark's processing-time trigger looked for the
tier's new batch at the same instants the tier's own trigger fired, so it found it one trigger
later, then spent a micro-batch of Spark's planning and commits on it.  The mirror keeps its
progress in the metadata store (its ``mirror`` sink record) and sends on the driver, so Spark's
offset log gave it nothing but that wait.  A step takes a bounded part of what is there (the
mirror: what the driver sends, ``kafka.mirror_driver_bytes``), so a step that did work may have
left the rest; waiting for the next wake there left it for a trigger interval or a tier commit.

It offers the runner (``streaming.service``) the part of Spark's ``StreamingQuery`` the runner
uses, so the runner treats both alike: ``isActive``, ``exception()``, ``awaitTermination``,
``stop()`` (waits for the step in flight), ``lastProgress`` (None: no Spark progress).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from connectors.errors import StopRequested

log = logging.getLogger("tierlog.service")


class FollowerError(Exception):
    """What ended a follower's thread, as text the runner reads as it reads a Spark query's failure:
    ``module.Class: message`` for the error that was raised."""


class Follower:
    def __init__(self, name: str, step: Callable[[], bool], interval_s: float):
        self.name = name
        self._step = step
        self.interval_s = interval_s
        self._woken = threading.Event()
        self._stopped = threading.Event()
        self._error: FollowerError | None = None
        self._thread = threading.Thread(target=self._run, name=f"tierlog-{name}", daemon=True)

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def wake(self) -> None:
        """Something new may be there: run a step now (or right after the one in flight)."""
        self._woken.set()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                if self._step():
                    continue  # it did work: there may be more, look again before any wait
                self._woken.wait(self.interval_s)
                self._woken.clear()  # before the step: a wake during it runs the next step at once
        except StopRequested:
            pass  # the runner is stopping: the step in flight did not start
        except BaseException as exc:  # noqa: BLE001 - reported to the runner, which ends the run with it
            log.debug("the %s query's thread failed", self.name, exc_info=True)
            cls = type(exc)
            self._error = FollowerError(f"{cls.__module__}.{cls.__qualname__}: {exc}")

    @property
    def isActive(self) -> bool:  # noqa: N802 - the name of Spark's StreamingQuery's property
        return self._thread.is_alive()

    def exception(self) -> FollowerError | None:
        return self._error

    def awaitTermination(self, timeout: float | None = None) -> bool:  # noqa: N802 - Spark's name
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """No step starts any more; returns once the step in flight, if any, has finished."""
        self._stopped.set()
        self._woken.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    lastProgress = None  # noqa: N815 - Spark's name; no Spark progress
