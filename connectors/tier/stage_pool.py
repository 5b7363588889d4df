"""Stage a large range of the commitlog in processes of the caller's own, one range a process.

Why: a tiering batch past ``source.partition_bytes`` (catching up) was staged by Spark's tasks,
each handed its range's references through the JVM, slower than staging the same ranges here
(``docs/benchmarks.md``): the job,
the references' trip through Arrow and the JVM, and the second Python process each task runs cost
more than the staging's own parallelism gave back.  Under a local Spark master the executors are
this host anyway, so the driver hands each range to a process it owns.

Contract:

- :meth:`StagePool.stage` returns exactly what one ``stage_range`` per range returns, in range
  order, whatever process staged each: staging is idempotent (an object is named by its range's
  first offset), so a range staged twice is the same object.
- A process that dies mid-batch (killed, out of memory) does not fail the batch: the pool is
  started again and the batch staged again, once.  A second death is a :class:`StagePoolError`.
- An error a stager raises (a corrupt record, a missing file) is raised here as it was raised
  there, so it names the file and offset.
- Ranges staged ahead (:meth:`stage_ahead`, for a batch expected next) are used only by a batch
  that holds exactly that range; any other is cancelled, or waited for and its object deleted,
  before the batch's own ranges are handed out, so no object a batch stages is ever written or
  deleted under it by a guess (a guessed range and a batch's may start at one offset, one name).
- The processes ignore SIGINT and SIGTERM, which reach a terminal's whole process group: the
  caller stops gracefully and then calls :meth:`close`.  They end within a second of the caller's
  process, however it ended.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable
from concurrent.futures.process import BrokenProcessPool

from connectors.commitlog.reader import CommitLogReader, cut
from connectors.errors import TierlogError
from connectors.tier.location import open_backend
from connectors.tier.staging import StagedPart, StageSettings, stage_range

log = logging.getLogger("tierlog.tier")


class StagePoolError(TierlogError):
    """The staging processes died twice in one batch."""

    retriable = True


def _start_process(parent: int) -> None:
    """Each staging process's first step: ignore the signals meant for its caller, and end when the
    caller's process has gone (killed, say), which a process pool does not do by itself: its
    processes outlived a SIGKILLed driver, waiting for work for ever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="stage-pool-parent", daemon=True).start()


def _ready() -> None:
    """A staging process's first task when the pool is warmed: unpickling it imported the stager."""


def _stage(settings: StageSettings, start: int, end: int) -> tuple[StagedPart | None, int]:
    """``stage_range`` in a staging process; an error that would not survive the trip back (its
    class cannot be rebuilt from its pickle) is raised as a ``TierlogError`` with its message and
    exit code, so the caller never sees a broken pool where the stager met bad input."""
    try:
        return stage_range(settings, start, end)
    except Exception as exc:
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - any failure to travel
            error = TierlogError(f"{type(exc).__name__}: {exc}")
            error.exit_code, error.retriable = getattr(exc, "exit_code", 1), getattr(exc, "retriable", False)
            raise error from None
        raise


class StagePool:
    """``processes`` staging processes, started by the first batch that needs them (each imports
    pyarrow, under a second), or by :meth:`warm` when the caller knows one is coming: a service that
    follows the log's head never starts them, and a short run that needs none does not pay for them
    beside Spark's own start."""

    def __init__(self, settings: StageSettings, processes: int, split_bytes: int,
                 header_reader: Callable[[], CommitLogReader] | None = None):
        """``header_reader``: a long-lived reader of the same log, used from the thread that calls
        :meth:`stage`, whose walks :meth:`ranges` shares (the tiering query's: a batch's range is
        mostly walked already, to the frontier); without it each call opens one and walks."""
        if processes < 1:
            raise ValueError(f"a stage pool needs at least one process, not {processes}")
        self.settings, self.processes, self.split_bytes = settings, processes, split_bytes
        self.header_reader = header_reader
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        self._ahead: dict[tuple[int, int], Future] = {}  # range -> its stage, started for a batch expected next
        self.restarts = 0
        self.ahead_used = self.ahead_dropped = 0  # ranges staged ahead that a batch took, and that none did

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise StagePoolError("the staging processes were closed: the tiering query has stopped")
            if self._pool is None:
                # spawn, not fork: the driver holds the JVM's gateway threads and RocksDB's, which a
                # forked child would inherit in whatever state they were.
                self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_process, initargs=(os.getpid(),))
            return self._pool

    def warm(self) -> None:
        """Start the processes now, without waiting for them, for a batch known to be coming: each
        imports pyarrow and the stager, which the first batch would otherwise wait for
        (docs/benchmarks.md)."""
        pool = self._executor()
        for _ in range(self.processes):  # one a process: the executor starts a process per waiting task
            pool.submit(_ready)

    def ranges(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` cut at record boundaries, every file boundary and about every
        ``split_bytes``, as the commitlog source cuts a batch into Spark's partitions."""
        if self.header_reader is not None:
            return cut(start, self.header_reader().scan(start, end, split_bytes=self.split_bytes).splits, end)
        with self.settings.reader.open(check_crc=False) as reader:
            return cut(start, reader.scan(start, end, split_bytes=self.split_bytes).splits, end)

    def stage_ahead(self, start: int, end: int, splits: tuple[int, ...]) -> None:
        """Start staging the ranges of ``[start, end)``, cut at ``splits`` (a scan's, as
        :meth:`ranges` cuts), now (starting the processes if need be), for a batch expected to be
        that range, behind what is already handed out: :meth:`stage` of a batch that holds one of
        them takes its result instead of staging it again."""
        self.drop_ahead()  # one guess at a time
        pool = self._executor()
        for r in cut(start, splits, end):
            self._ahead[r] = pool.submit(_stage, self.settings, *r)

    def drop_ahead(self, keep: list[tuple[int, int]] = ()) -> dict[tuple[int, int], Future]:
        """The stages started ahead for ``keep``; every other one is cancelled, or waited for and the
        object it wrote deleted (the staging is idempotent, so a range staged again is the same object).
        Called before a batch hands out a range of its own, by whoever stages it."""
        ahead, self._ahead = self._ahead, {}
        kept = {r: ahead.pop(r) for r in keep if r in ahead}
        names = []
        for future in ahead.values():
            if future.cancel():
                continue
            try:
                part, _ = future.result()
            except Exception as exc:  # noqa: BLE001 - a guess that failed: a batch that holds the range meets it again
                log.debug("a range staged ahead failed and no batch took it: %s", exc)
                continue
            if part is not None and part.name:
                names.append(part.name)
        self.ahead_dropped += len(ahead)
        if names:
            backend = open_backend(self.settings.location, copies=self.settings.copies)
            try:
                for name in names:
                    backend.delete(name)
            finally:
                backend.close()
        return kept

    def stage(self, start: int, end: int,
              ahead: Callable[[], tuple[int, int, tuple[int, ...]] | None] | None = None) -> tuple[list[StagedPart], int]:
        """Stage every record in ``[start, end)`` (a record boundary each): the parts, in order, and
        the records the range holds.  ``ahead``: the batch expected next (start, end, splits, or
        None), asked for once this one's ranges are handed out and staged behind them (see
        :meth:`stage_ahead`)."""
        guessed = list(self._ahead)  # one guess's cut, in order: it starts at its first range, ends at its last
        ranges = guessed if guessed and (guessed[0][0], guessed[-1][1]) == (start, end) else self.ranges(start, end)
        taken = self.drop_ahead(keep=ranges)
        for attempt in (1, 2):
            pool = self._executor()
            try:
                futures = []
                for r in ranges:
                    future = taken.pop(r, None)
                    self.ahead_used += future is not None
                    futures.append(future or pool.submit(_stage, self.settings, *r))
                if ahead is not None:
                    expected, ahead = ahead(), None
                    if expected is not None:
                        self.stage_ahead(*expected)
                done = [f.result() for f in futures]
                break
            except BrokenProcessPool as exc:
                self._discard(pool)
                if attempt == 2:
                    raise StagePoolError(
                        f"the tiering query's staging processes died twice while staging commitlog offsets "
                        f"{start}-{end} of {self.settings.reader.directory}; see the log for what ended them "
                        "(memory is the usual cause). The batch was not committed: start tierlog again") from exc
                self.restarts += 1
                log.warning("a staging process died while staging commitlog offsets %d-%d; the processes are "
                            "started again and the batch staged again (its objects are overwritten)", start, end)
        parts = [part for part, _ in done if part is not None]
        return parts, sum(records for _, records in done)

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        self._ahead = {}  # the pool's: broken with it
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the processes; what was staged ahead and never taken is deleted first."""
        if self._pool is not None:
            try:
                self.drop_ahead()
            except Exception as exc:  # noqa: BLE001 - garbage only: the stop stays clean
                log.warning("objects staged ahead for a batch that never ran were not deleted (%s: %s)",
                            type(exc).__name__, exc)
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
