"""The process's stop switch: the runner (``streaming.service``) throws it on SIGTERM or Ctrl-C, and
work that waits (a backend retrying a store that is away, a full disk) gives up at its next wait,
raising ``StopRequested``, instead of waiting out its deadline with the stop held behind it.  What
it was writing belongs to a batch not committed yet, which the next start runs again.

In the driver it is an event; Spark's Python workers, other processes, see a file the runner names
in ``TIERLOG_STOP_FILE`` (set before Spark starts, so they inherit it) and creates on the stop.
Nothing here knows who stops or why.
"""

from __future__ import annotations

import os
import threading
import time

_STOPPING = threading.Event()
STOP_FILE = "TIERLOG_STOP_FILE"


def request_stop() -> None:
    _STOPPING.set()
    path = os.environ.get(STOP_FILE)
    if path:
        open(path, "w").close()


def clear_stop() -> None:
    _STOPPING.clear()
    path = os.environ.get(STOP_FILE)
    if path and os.path.exists(path):
        os.remove(path)


def stop_requested(wait_s: float = 0.0) -> bool:
    """Whether a stop was requested, waiting up to ``wait_s`` for one."""
    deadline = time.monotonic() + wait_s
    path = os.environ.get(STOP_FILE)
    while True:
        if _STOPPING.is_set() or (path and os.path.exists(path)):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        _STOPPING.wait(min(0.2, left))
