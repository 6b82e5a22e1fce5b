"""llmd.heap: memory a model's own thread allocated and freed goes back to the system
when the heap is trimmed. Each case runs in a fresh interpreter (glibc's arena setting
holds for the process's life): a thread allocates 40 MiB in 1 MiB blocks and frees them,
as a model's thread frees its weights at an unload, after a 30 MiB block freed earlier
raised glibc's thresholds as large tensors do (trim threshold 60 MiB); then the main
thread calls trim_heap, as the unload does. With one arena (llmd.heap.one_arena, what
the daemon sets at start) the process's anonymous memory comes back; with an arena per
thread (glibc's default, the control) the freed blocks stay in that thread's heap."""
from __future__ import annotations

import subprocess
import sys

import pytest

CASE = """
import ctypes, sys, threading
from llmd.heap import one_arena, trim_heap
if sys.argv[1] == "one":
    one_arena()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MIB = 1 << 20

def anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

def model_thread():
    big = libc.malloc(30 * MIB)  # mmapped; its free raises the mmap and trim thresholds
    ctypes.memset(big, 1, 30 * MIB)
    libc.free(big)
    blocks = [libc.malloc(MIB) for _ in range(40)]
    for b in blocks:
        ctypes.memset(b, 1, MIB)
    for b in blocks:
        libc.free(b)

before = anon_mib()
thread = threading.Thread(target=model_thread)
thread.start()
thread.join()
trim_heap()
print(anon_mib() - before)
"""


def kept_mib(arenas: str) -> float:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_ARENA_MAX from the caller's environment
    out = subprocess.run([sys.executable, "-c", CASE, arenas], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_one_arena_gives_a_threads_freed_memory_back():
    assert kept_mib("one") < 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_control_an_arena_per_thread_keeps_it():
    """Without one_arena the same frees stay resident: what the first case proves is
    one_arena's doing, not the trim's alone."""
    assert kept_mib("default") > 32
