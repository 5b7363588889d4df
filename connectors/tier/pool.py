"""One process-wide pool of threads for the tier's metadata I/O (reads and writes of manifests).

Starting threads for every fold cost more than its writes, so the pool is made once per
process (again in a forked child, which has none of its parent's threads)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from connectors.threads import name_native

IO_THREADS = 8  # metadata objects read or written at once

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def io_map(fn, items: list) -> list:
    """``[fn(item) for item in items]``, run on the pool; never call it from inside the pool."""
    global _pool, _pool_pid
    if len(items) <= 1:
        return [fn(i) for i in items]
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="tier-meta", initializer=name_native), os.getpid()
        pool = _pool
    return list(pool.map(fn, items))
