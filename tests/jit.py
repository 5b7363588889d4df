"""The test JVMs compile with the client JIT only: the same programs, for less CPU.

HotSpot compiles hot methods twice by default: quickly with C1, then again, optimised, with C2.
A test JVM is short-lived or lightly loaded (a ``tierlog run --until-caught-up`` over a few
thousand messages, a Kafka or RocketMQ broker serving a few thousand records), so C2's work is
mostly spent on code that stops running before it pays off.  ``-XX:TieredStopAtLevel=1`` stops at
C1.  The bytecode that runs is the same, only how it is compiled differs; a deployed tierlog keeps
the JVM's defaults, which suit a service that runs for months.

Measured on one short ``tierlog run --until-caught-up`` (2,000 messages, compaction on), two pairs
of runs in alternating order: 22.1 / 21.2 s wall and 39.4 / 36.5 s of the machine's CPU with the
defaults, 17.3 / 16.8 s and 26.6 / 25.5 s with C1 only.  ``TIERLOG_TEST_JIT=default`` keeps the
defaults.
"""

from __future__ import annotations

import os


def options() -> list[str]:
    if os.environ.get("TIERLOG_TEST_JIT", "c1") == "default":
        return []
    return ["-XX:TieredStopAtLevel=1"]
