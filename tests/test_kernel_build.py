"""The run-time build of the C++ kernels (kernel_build, cpu_kernels) under an flock that
dies with its holder, in a folder per key, within a time limit (issue 25): a build killed
midway does not hang the next start; a lock held too long makes the loader give up and
keep the torch path; two installs (venvs) keep two folders; an exiting process (a daemon
stopped while it loads) kills its build instead of waiting for it.

The builds here compile a one-line C++ file; a compiler wrapper ($CXX) that sleeps on
each compile when asked to stands in for a long build. Every process a test starts is
killed on every path (the `cleanup` fixture: the processes started, and any process
still working under the test's folder)."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from daemon_util import Daemon
from llmd.gpu.layers.cpu import cpu_kernels
from llmd.gpu.layers.cpu.kernel_build import (LOCK_FILE, SID_FILE, TORCH_LOCK_FILE, ExtensionBuild, build_library,
                                   build_processes)

SLOW_ENV = "LLMD_TEST_SLOW_CXX"  # the wrapper's marker file: touched, then each compile sleeps

# Builds the one-line library in a process of its own; the path on stdout.
LOADER = ("import sys; from pathlib import Path; from llmd.gpu.layers.cpu.kernel_build import ExtensionBuild, build_library; "
          "print(build_library(ExtensionBuild('tiny', (Path(sys.argv[1]),)), float(sys.argv[2])), flush=True)")
# As the daemon loads: the build on a pool thread; the main thread returns (its stop)
# once the compile has started, leaving the pool as server.py does.
EXITING_LOADER = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from llmd.gpu.layers.cpu.kernel_build import ExtensionBuild, build_library
pool = ThreadPoolExecutor(max_workers=1)
pool.submit(build_library, ExtensionBuild("tiny", (Path(sys.argv[1]),)), 120.0)
while not Path(sys.argv[2]).exists():
    time.sleep(0.02)
print("exiting", flush=True)
pool.shutdown(wait=False, cancel_futures=True)
"""
HOLDER = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644); "
          "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d' % os.getpid()); print('held', flush=True); "
          "time.sleep(120)")


def _processes_under(root: Path) -> list[int]:
    """Processes whose working directory lies under `root` (a build's: its child, ninja,
    the compilers all work in the build folder)."""
    root_path, found = os.path.realpath(root), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cwd = os.readlink(entry / "cwd")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z" and (cwd == root_path or cwd.startswith(root_path + os.sep)):
                found.append(int(entry.name))
    return found


@pytest.fixture
def cleanup(tmp_path):
    """A list to put started processes in (each the leader of its own session): on the way
    out, each is killed with its group, then whatever still works under tmp_path."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:  # not reaped: its group id is still its own
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for _ in range(100):
        pids = _processes_under(tmp_path)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


@pytest.fixture
def tiny(tmp_path) -> Path:
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int llmd_tiny(void) { return 7; }\n')
    return source


@pytest.fixture
def slow_cxx(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """$CXX and $TORCH_EXTENSIONS_DIR set for this test: a compiler wrapper that, when
    $LLMD_TEST_SLOW_CXX names a file, touches it and sleeps on each compile. Returns
    (wrapper, marker)."""
    wrapper, marker = tmp_path / "cxx.sh", tmp_path / "compiling"
    wrapper.write_text('#!/bin/sh\ncase " $* " in\n  *" -c "*) if [ -n "$LLMD_TEST_SLOW_CXX" ]; then\n'
                       '    touch "$LLMD_TEST_SLOW_CXX"; sleep 120; fi ;;\nesac\nexec c++ "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(SLOW_ENV, raising=False)
    return wrapper, marker


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _spawn(code: str, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env={**os.environ, **(env or {})},
                            start_new_session=True, **kwargs)


def test_a_build_killed_midway_does_not_hang_the_next(tmp_path, tiny, slow_cxx, cleanup):
    ext = ExtensionBuild("tiny", (tiny,))
    directory = ext.directory()
    _, marker = slow_cxx
    loader = _spawn(LOADER, str(tiny), "60", env={SLOW_ENV: str(marker)}, stdout=subprocess.DEVNULL,
                    stderr=(tmp_path / "loader.log").open("wb"))
    cleanup.append(loader)
    _wait_for(lambda: marker.exists() or loader.poll() is not None, 60, "the compile did not start")
    assert marker.exists(), (tmp_path / "loader.log").read_text()
    # Mid-compile: torch's FileBaton is there (before, every later load waited on it forever).
    assert (directory / TORCH_LOCK_FILE).exists()
    sid = int((directory / SID_FILE).read_text())

    def comms() -> set[str]:
        names = set()
        for pid in build_processes(directory, sid):
            try:
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:  # gone between the listing and the read
                pass
        return names

    # the build's child, ninja, the compiles (asleep: the wrapper touches the marker, then
    # starts sleep, which a loaded machine may not have done yet)
    _wait_for(lambda: {"ninja", "sleep"} <= comms(), 30, f"no ninja and sleep among the build's processes: {comms()}")
    os.killpg(loader.pid, signal.SIGKILL)
    loader.wait()

    started = time.monotonic()
    library = build_library(ext, 60.0)  # the lock died with its holder; the leftovers are killed
    assert time.monotonic() - started < 45
    assert ctypes.CDLL(str(library)).llmd_tiny() == 7
    assert not (directory / TORCH_LOCK_FILE).exists()
    assert _processes_under(tmp_path) == []  # the killed build's compiles went too


def test_a_held_lock_gives_up_after_the_time_limit(tmp_path, monkeypatch, caplog, cleanup):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(cpu_kernels.KERNEL_BUILD_TIMEOUT_ENV, "1")
    directory = cpu_kernels.kernels_build().directory()
    directory.mkdir(parents=True)
    holder = _spawn(HOLDER, str(directory / LOCK_FILE), stdout=subprocess.PIPE)
    cleanup.append(holder)
    assert holder.stdout.readline().strip() == b"held"
    # A fresh _load (the module's one is cached), through the paged_decode_op callers use.
    monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))
    caplog.set_level(logging.WARNING, logger="llmd.cpu_kernels")
    started = time.monotonic()
    assert cpu_kernels.paged_decode_op() is None  # the torch path
    assert time.monotonic() - started < 10
    (record,) = [r for r in caplog.records if r.name == "llmd.cpu_kernels"]
    assert "gave up after 1 s waiting for the lock" in record.message
    assert f"held by pid {holder.pid}" in record.message
    assert "LLMD_KERNEL_BUILD_TIMEOUT" in record.message and "torch path" in record.message


def test_a_bad_time_limit_is_refused(monkeypatch):
    for value in ("0", "-3", "soon", "inf"):
        monkeypatch.setenv(cpu_kernels.KERNEL_BUILD_TIMEOUT_ENV, value)
        with pytest.raises(ValueError, match="LLMD_KERNEL_BUILD_TIMEOUT"):
            cpu_kernels.kernel_build_timeout()
    monkeypatch.delenv(cpu_kernels.KERNEL_BUILD_TIMEOUT_ENV)
    assert cpu_kernels.kernel_build_timeout() == cpu_kernels.DEFAULT_KERNEL_BUILD_TIMEOUT_S


def test_two_installs_keep_two_folders(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ext = ExtensionBuild("tiny", (tiny,))
    first = build_library(ext, 60.0)
    built_at = first.stat().st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(sys, "prefix", str(tmp_path / "other-venv"))  # another install of the same sources
        second = build_library(ext, 60.0)
    assert second.parent != first.parent and second.is_file()
    started = time.monotonic()
    assert build_library(ext, 60.0) == first  # the first install's build is still there, untouched
    assert time.monotonic() - started < 2 and first.stat().st_mtime_ns == built_at

    # Everything else the build depends on makes another folder too.
    kernels = cpu_kernels.kernels_build()
    folders = {kernels.directory()}
    for target, name, value in ((sys, "executable", "/opt/other/bin/python"), (torch, "__version__", "0.0.0"),
                                (os.environ, "CXX", "clang++")):
        with monkeypatch.context() as m:
            if target is os.environ:
                m.setenv(name, value)
            else:
                m.setattr(target, name, value)
            folders.add(kernels.directory())
    other_isa = ExtensionBuild(kernels.name, kernels.sources, kernels.headers, ("-O3",), kernels.ldflags)
    folders.add(other_isa.directory())
    assert len(folders) == 5


def test_an_exiting_process_kills_its_build(tmp_path, tiny, slow_cxx, cleanup):
    _, marker = slow_cxx
    directory = ExtensionBuild("tiny", (tiny,)).directory()
    loader = _spawn(EXITING_LOADER, str(tiny), str(marker), env={SLOW_ENV: str(marker)}, stdout=subprocess.PIPE,
                    stderr=(tmp_path / "loader.log").open("wb"))
    cleanup.append(loader)
    assert loader.stdout.readline().strip() == b"exiting", (tmp_path / "loader.log").read_text()
    assert (directory / SID_FILE).exists()  # the build runs
    started = time.monotonic()
    assert loader.wait(timeout=30) == 0
    assert time.monotonic() - started < 10  # not the compile's 120 s
    assert _processes_under(tmp_path) == []


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_sigterm_while_the_daemon_builds_its_kernels(tmp_path, tiny_llama, slow_cxx, cleanup, executor):
    """`llmd serve` stopped during the first-start compile: it exits in seconds, the
    compile killed with it; with worker processes too (the compile in a loading worker,
    which the stop kills: it would read no Shutdown before it had loaded)."""
    _, marker = slow_cxx
    daemon = Daemon(str(tiny_llama), tmp_path / "llmd.sock", "--device", "cpu", "--no-http",
                    "--distributed-executor-backend", executor,
                    env={SLOW_ENV: str(marker), "LLMD_CPU_KERNELS": "1"})
    cleanup.append(daemon.proc)
    _wait_for(lambda: marker.exists() or daemon.proc.poll() is not None, 90, "the compile did not start")
    assert marker.exists(), daemon.stderr()
    started = time.monotonic()
    assert daemon.stop(signal.SIGTERM, timeout=30) == 0, daemon.stderr()
    assert time.monotonic() - started < 10, daemon.stderr()  # not the compile's 120 s
    assert "stopped while loading the model" in daemon.stderr()
    assert "did not stop within" not in daemon.stderr()  # the load itself gave up
    assert _processes_under(tmp_path) == []


def test_every_cpp_source_and_header_is_in_the_build_and_its_digest():
    """A C++ file beside the kernels that the build's lists leave out would not rebuild them
    when it changes (a header) or would not be compiled at all (a source)."""
    folder = Path(cpu_kernels.__file__).parent
    assert sorted(folder.glob("*.cpp")) == sorted(cpu_kernels.SOURCES)
    assert sorted(folder.glob("*.h")) == sorted(cpu_kernels.HEADERS)
    build = cpu_kernels.kernels_build()
    assert set(build.sources) == set(cpu_kernels.SOURCES) and set(build.headers) == set(cpu_kernels.HEADERS)
