"""Names the worker's own threads for the operating system, so /proc, top -H and py-spy tell them apart.

Runs in a worker process, called once by each thread it starts (the link and prompt threads) as the
thread begins. Owns nothing. Python before 3.14 leaves every thread with the process's name; a
benchmark that reads per-thread CPU time (bench/proc_cpu.py) needs to know which thread is which.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def name_this_thread() -> None:
    """Give the calling thread its Python name (cut to 15 bytes) at the OS level; a no-op elsewhere."""
    if _libc is None:
        return
    name = threading.current_thread().name.encode(errors="replace")[:15]
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
