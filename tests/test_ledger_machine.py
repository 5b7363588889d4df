"""The cost ledger's whole-machine line (``bench.common.machine_cpu_s``, ``bench_ledger.machine``):
the machine's busy time holds every process's, and its split adds back up to it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.bench_ledger import machine
from bench.common import machine_cpu_s, tree_cpu_s

SPIN = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"


def test_the_machines_busy_time_holds_a_process_that_spun():
    busy0, kernel0 = machine_cpu_s()
    wall0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    child = 0.0
    while proc.poll() is None:  # its own counters while it lives: reaped, they are its parent's
        child = max(child, tree_cpu_s(proc.pid))
        time.sleep(0.05)
    busy, kernel = machine_cpu_s()
    wall = time.monotonic() - wall0
    assert child >= 0.9
    assert busy - busy0 >= 0.9 * child  # the other worker's tests only add to it
    assert busy - busy0 <= (os.cpu_count() or 1) * wall * 1.05 + 0.05  # not the idle time as well
    assert 0 <= kernel - kernel0 <= busy - busy0


def test_the_machines_split_adds_up_to_its_busy_cores():
    split = machine({"total_cores": 1.048, "broker_cores": 0.641}, busy=2.001, kernel=1.029, generator=0.192)
    rest = split["the rest (kernel threads, other processes)"]
    parts = split["service"] + split["broker"] + split["generator"] + rest
    assert abs(parts - split["busy_cores"]) < 0.001  # each rounded to 3 places
    assert rest == 0.12
    assert machine({"total_cores": 0.5}, busy=0.6, kernel=0.1, generator=0.05)["broker"] == 0.0  # Kafka off
