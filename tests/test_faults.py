"""The fault injector's counter (``connectors.faults.crash_point``): with processes passing the same
point at once, the N-th pass is still exactly one pass, so the fault fires once."""

from __future__ import annotations

import multiprocessing
import os

from connectors import faults

PASSES = 500  # by each process, each round
ROUNDS = 30


def _pass_many(directory: str, nth: int) -> int:
    """Pass the point ``PASSES`` times with the fault set on its ``nth`` pass; how often it fired."""
    os.environ.update(TIERLOG_FAULT=f"staged:{nth}", TIERLOG_FAULT_DIR=directory)
    fired = []
    kill, os.kill = os.kill, lambda pid, sig: fired.append(pid)  # the fault's kill, counted, not done
    try:
        for _ in range(PASSES):
            faults.crash_point("staged")
    finally:
        os.kill = kill
    return len(fired)


def test_processes_passing_a_point_at_once_fire_its_nth_pass_once(tmp_path):
    """Four processes pass one point 500 times each, 30 rounds: the named pass fires exactly once
    a round.  Read from the file's size after the write, about a seventh of the pass numbers were
    met twice or never (two processes read the same size), and the staging-process kill test once
    found no process killed."""
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        fired = []
        for r in range(ROUNDS):
            directory = tmp_path / f"round-{r}"
            directory.mkdir()
            nth = 1 + (r * 397) % (4 * PASSES)
            fired.append(sum(pool.starmap(_pass_many, [(str(directory), nth)] * 4)))
            assert os.path.getsize(directory / "tierlog-fault-staged") == 4 * PASSES
    assert fired == [1] * ROUNDS
