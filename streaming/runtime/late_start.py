"""Queries whose Python worker started too late for Spark: started again, with backoff.

Spark gives the Python process that runs a Python streaming source (or plans a read) a fixed 10 s
to start and connect back (``PythonWorkerFactory``; no setting changes it).  On a busy host, a
broker's say, it can be late: at a query's start, or when a batch needs a new one (CI met it in
the tiering query's first batch).  A long-running service should ride that out, so such a query is
started again after 1, 2, 4 ... 30 s, until ``spark.late_start_s`` have passed since it first
failed; then the run ends with one line that names the cause and what to do.  A query that had
run batches is started as a new process would start it (``Service._restart``): built afresh and
resumed from its checkpoint and its sinks' records, so the batch that failed runs again, as after
a crash.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("tierlog.service")

LATE_WORKER = re.compile(r"Python worker failed to connect back|waiting for the Python worker to connect back")
MAX_DELAY_S = 30.0


@dataclass
class _Pending:
    first_failed: float  # when the query first failed to start, in this run
    failures: int = 0
    start_at: float | None = None  # when to start it again; None once started (and not failed since)


class LateStarts:
    """The queries waiting to be started again.  ``on_wait(name, text)`` hears each wait (and
    ``text`` None once the query ran a batch), for the sinks' health and the metrics."""

    def __init__(self, budget_s: float, on_wait: Callable[[str, str | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.budget_s, self.on_wait, self.clock = budget_s, on_wait, clock
        self.pending: dict[str, _Pending] = {}
        self.gave_up: dict[str, str] = {}  # query -> why the run ends

    def failed(self, name: str, error: str) -> bool:
        """Whether the failure of query ``name`` is a late start to ride out (then it is scheduled)."""
        if not LATE_WORKER.search(error):
            return False
        now = self.clock()
        p = self.pending.setdefault(name, _Pending(first_failed=now))
        p.failures += 1
        if now - p.first_failed >= self.budget_s:
            self.gave_up[name] = (
                f"the {name} query could not start for {now - p.first_failed:.0f} s: in {p.failures} starts, Spark's "
                "Python worker never connected back within Spark's fixed 10 s, because this host is too busy. Free "
                "CPU for tierlog (or give its Spark executors their own cores), or let it wait longer with "
                f"spark.late_start_s (now {self.budget_s:g})")
            return False
        delay = min(MAX_DELAY_S, 2.0 ** (p.failures - 1))
        p.start_at = now + delay
        text = (f"Spark's Python worker did not connect back within Spark's 10 s (a busy host); start "
                f"{p.failures + 1} in {delay:g} s, for up to {self.budget_s:g} s in all")
        log.warning("the %s query waits to start again: %s", name, text)
        if self.on_wait:
            self.on_wait(name, text)
        return True

    def due(self) -> list[str]:
        """The queries to start now; each is then started (and waits no more until it fails again)."""
        now, out = self.clock(), []
        for name, p in self.pending.items():
            if p.start_at is not None and now >= p.start_at:
                p.start_at = None
                out.append(name)
        return out

    def waiting(self) -> set[str]:
        return {n for n, p in self.pending.items() if p.start_at is not None}

    def ran(self, name: str) -> None:
        """Query ``name`` ran a batch: it started."""
        if self.pending.pop(name, None) is not None and self.on_wait:
            self.on_wait(name, None)
