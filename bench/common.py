"""Helpers shared by the benchmarks: timing, page-cache control, JSON output."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def drop_cache(paths: list[str]) -> bool:
    """Ask the kernel to forget cached pages of ``paths`` (no root needed); True if it could."""
    ok = True
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            ok = False
    return ok


def timed(fn, repeat: int = 3, before=None) -> dict:
    """Run ``fn`` ``repeat`` times (after ``before`` each time); seconds as min/median and the last result."""
    times, result = [], None
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return {"min_s": min(times), "median_s": statistics.median(times), "result": result}


def pin_to_one_core() -> int | None:
    """Run on one CPU so 'per core' figures mean what they say."""
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def report(result: dict) -> None:
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
