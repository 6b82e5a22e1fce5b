"""Giving freed memory back to the system. glibc keeps what a process frees in its
arenas for reuse, so an unloaded (or sleeping) model's memory would stay in the
process's resident size; `malloc_trim` returns the free pages to the kernel. No torch."""
from __future__ import annotations

import contextlib
import ctypes
import gc


def trim_heap() -> None:
    """Hand glibc's free heap pages back to the kernel (nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_memory() -> None:
    """Collect unreachable objects (a model's reference cycles), then trim the heap."""
    gc.collect()
    trim_heap()
