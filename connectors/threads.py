"""Thread names the operating system sees (``top -H``, ``/proc/<pid>/task/<tid>/comm``).

Python names its threads for itself only, so every thread of the driver showed as ``python`` and
the cost ledger (``bench/bench_ledger.py``) could not tell the KV view's apply thread from a
query's handler.  ``name_native`` gives the calling thread the name of its Python thread (or the
one given), cut to the 15 bytes Linux keeps.  It leaves the main thread (whose name is the
process's) and other systems alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15
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
