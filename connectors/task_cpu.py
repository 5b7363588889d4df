"""The CPU each kind of Spark task spends in tierlog's own code, for the cost ledger
(``bench/bench_ledger.py``).

Why: Spark's Python workers run every kind of task tierlog hands them (the commitlog's references,
the stagers, the tier feed's reads, the mirror's sends) in the same few processes, one after
another, so ``/proc`` cannot split their CPU by kind; and the issue that asked for the ledger found
most of the workers' CPU unexplained.  With ``TIERLOG_TASK_CPU=<file>`` set, :func:`counted` adds
one line per task (``kind cpu_seconds pid``) with the process CPU spent inside the task's own steps;
what a worker spent beyond the sum of its lines is PySpark's work around them (taking the task,
Arrow in and out, the worker's loop).  Unset (the default), it hands the iterator back untouched.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterator, TypeVar

TASK_CPU = "TIERLOG_TASK_CPU"

log = logging.getLogger("tierlog.ledger")

T = TypeVar("T")


def counted(kind: str, steps: Iterator[T]) -> Iterator[T]:
    """``steps`` itself, or, under ``TIERLOG_TASK_CPU``, the same items with the CPU spent producing
    them (not the consumer's time between them) written down as ``kind`` when they end."""
    path = os.environ.get(TASK_CPU)
    if not path:
        return steps
    return _counting(kind, iter(steps), path)


def _counting(kind: str, steps: Iterator[T], path: str) -> Iterator[T]:
    spent = 0.0
    try:
        while True:
            started = time.process_time()
            try:
                item = next(steps)
            except StopIteration:
                return
            finally:
                spent += time.process_time() - started
            yield item
    finally:
        _write(path, f"{kind} {spent:.6f} {os.getpid()}\n")


_unwritable: set[str] = set()  # paths already warned about, in this process


def _write(path: str, line: str) -> None:
    """Append ``line``; a path the task cannot write is warned about once a process and never
    fails the task: a measurement must not stop what it measures."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        if path not in _unwritable:
            _unwritable.add(path)
            log.warning("%s=%s cannot be written (%s): this process's task CPU goes uncounted",
                        TASK_CPU, path, exc.strerror or exc)
