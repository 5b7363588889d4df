"""Thread names the operating system sees (``top -H``, ``/proc/<pid>/task/<tid>/comm``).

Python names its threads for itself only, so every thread of the driver showed as ``python`` and
the cost ledger (``bench/bench_ledger.py``) could not tell the KV view's apply thread from a
query's handler.  ``name_native`` gives the calling thread the name of its Python thread (or the
one given), cut to the 15 bytes Linux keeps.  It leaves the main thread (whose name is the
process's) and other systems alone.

A thread a named thread starts natively takes its name too: Arrow starts the threads of its CPU
and I/O pools, which every thread of the driver shares, from the first thread that needs one, so
the ledger put them all in the tiering handler's part.  With ``TIERLOG_NAMED_THREADS=<file>``
set (the ledger sets it), ``name_native`` adds one line ``pid tid name`` for each thread it names;
a thread of that name the file does not list is one started natively.  Unset (the default), it
writes nothing.

``lower_priority`` gives a thread a higher niceness (``compaction.nice``: the compaction query's
threads run behind the tier's, the mirror's and the broker's when the cores are full); a thread it
starts afterwards inherits it, so ``start_arrow_pool`` starts Arrow's shared pool beforehand.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

_PR_SET_NAME = 15
NAMED_THREADS = "TIERLOG_NAMED_THREADS"
_listed: set[str] = set()  # the lines this process wrote
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        _libc = None


def name_native(name: str | None = None) -> None:
    """Name the calling thread, for the OS, ``name`` (default: its Python name)."""
    if _libc is None or threading.current_thread() is threading.main_thread():
        return  # the main thread's name is the process's, as ps shows it
    text = (name or threading.current_thread().name).encode(errors="replace")[:15]
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)
    path = os.environ.get(NAMED_THREADS)
    if path:
        line = f"{os.getpid()} {threading.get_native_id()} {text.decode(errors='replace')}\n"
        if line not in _listed:  # a handler names its thread each batch: one line is enough
            _listed.add(line)
            with open(path, "a") as fh:
                fh.write(line)


def lower_priority(nice: int, tid: int | None = None) -> bool:
    """Give thread ``tid`` (default: the calling one) niceness ``nice`` if its own is lower.

    The scheduler then runs it behind threads of niceness 0 while the cores are full, and as
    before while they are not.  A niceness is never lowered (that takes a privilege), and a thread
    the thread starts afterwards inherits it (Linux's niceness is a thread's).  False where the OS
    has no per-thread niceness, or the thread has ended."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id() if tid is None else tid
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError:  # the thread ended between a listing and here
        return False


ARROW_POOL = "arrow-pool"


def start_arrow_pool() -> None:
    """Start every thread of Arrow's CPU pool now, at the calling thread's niceness, from a thread
    named ``ARROW_POOL``.

    Why: the pool starts its threads when a task first needs one, from whichever thread asked, and
    they inherit that thread's niceness.  Started from a compaction thread (``lower_priority``),
    every Parquet read and compute call of the process, the mirror's and the tier's too, would run
    behind the rest.  A read of two columns a thread, in several row groups, starts them all.  They
    inherit the starter's name too: started from the main thread they carried the process's name,
    and the cost ledger counted them as the driver's other Python threads, not as Arrow's pools."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    width = 2 * pa.cpu_count()
    table = pa.table({f"c{i}": pa.array(range(4096)) for i in range(width)})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=1024)
    errors: list[BaseException] = []

    def read() -> None:
        name_native(ARROW_POOL)
        try:
            pq.read_table(pa.BufferReader(out.getvalue()), use_threads=True)
        except BaseException as e:  # raised on the caller's thread below
            errors.append(e)

    starter = threading.Thread(target=read, name=ARROW_POOL, daemon=True)
    starter.start()
    starter.join()
    if errors:
        raise errors[0]


def named_threads(path: str) -> set[tuple[int, int]]:
    """The ``(pid, tid)`` of every thread ``name_native`` listed in ``path`` (none if it is missing)."""
    try:
        with open(path) as fh:
            # A line without its name is one still being written: its thread id may be cut short.
            return {(int(pid), int(tid)) for pid, tid, *_name in (line.split(" ", 2) for line in fh) if _name}
    except FileNotFoundError:
        return set()
