"""Giving freed memory back to the system. glibc keeps what a process frees in its
arenas for reuse, so an unloaded (or sleeping) model's memory would stay in the
process's resident size; `malloc_trim` returns the free pages to the kernel. No torch."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os

M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)


def one_arena() -> None:
    """Every thread of this process allocates from glibc's main arena, which
    `malloc_trim` trims whole. Each model is built and run on a thread of its own; with
    a thread arena of its own, the weights freed at its unload coalesce into that
    arena's top chunk, which `malloc_trim` leaves mapped (it gives back the main arena's
    top and the free pages inside chunks, not a thread heap's top) and glibc trims only
    past its trim threshold (64 MiB once large frees have raised it): up to that much
    stayed resident after an unload, until the next one. Called before any thread
    starts; MALLOC_ARENA_MAX in the environment is the person's choice and stays."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)


def trim_heap() -> None:
    """Hand glibc's free heap pages back to the kernel (nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_memory() -> None:
    """Collect unreachable objects (a model's reference cycles), then trim the heap."""
    gc.collect()
    trim_heap()
