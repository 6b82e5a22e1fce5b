"""Build a C++ torch extension at run time, safely: llmd's CPU kernels (cpu_kernels) go
through here.

torch.utils.cpp_extension.load alone builds into a folder named after the extension and
shared by every install on the machine, guarded by a plain `lock` file (FileBaton): a
process killed mid-build leaves the file, and every later load waits on it forever; two
venvs with the same sources rebuild over each other, since the folder's build.ninja
records each one's paths. Here instead:

- **one folder per key**: `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions/`)
  / `<name>_<digest of the key>`, the key being everything the build depends on — the
  sources' and headers' contents and paths, the flags (hence the vector ISA), torch's
  version and install, the Python executable and prefix (the venv), the C++ compiler
  and its version (`key.json` in the folder spells it out);
- **a lock that dies with its holder**: fcntl.flock on `llmd.lock` in the folder (the
  kernel drops it when the process dies), taken before the folder is looked at, waited
  for at most the time limit; whoever holds it alone builds there, so torch's own `lock`
  file found there is a dead build's and is removed, as is what is left of that build
  (processes of its session still working in the folder);
- **the build in a child process** (its own session, dying with its parent; torch's load
  runs there, its output in `build.log`), which the loader waits for while watching the
  time limit and a cancel request (`cancel_builds`, also run when the interpreter exits:
  a daemon stopped while it loads does not wait for a compile), and kills with its whole
  session when either comes (a session, not a process group: ninja puts each compile in
  a group of its own);
- `built.json` written once the library is built: later starts load it directly (no
  torch import in a child, no ninja run).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("llmd.kernel_build")

LOCK_FILE = "llmd.lock"  # flock'ed by whoever looks at, builds in or loads from the folder
BUILT_FILE = "built.json"  # the key, written once the library is built
KEY_FILE = "key.json"  # the key, for people
SID_FILE = "build.sid"  # the running build's session (its leader's pid)
LOG_FILE = "build.log"  # the build's output (ninja, the compiler)
TORCH_LOCK_FILE = "lock"  # torch's FileBaton, left behind by a killed build
POLL_S = 0.05

_cancelled = threading.Event()


class KernelBuildError(RuntimeError):
    """The library could not be made ready: the lock stayed held or the build ran past the
    time limit, or the build failed. The message says which, and where to look."""


class KernelBuildCancelled(RuntimeError):
    """cancel_builds() was called (the interpreter exits) while waiting for the lock or the
    build: the build was killed."""


def cancel_builds() -> None:
    """Make every wait for a kernel build in this process end at once (the build killed,
    KernelBuildCancelled raised). Registered to run when the interpreter starts to exit,
    before it joins the threads: a daemon stopped while its model loads on a thread exits
    without waiting for the compiler."""
    _cancelled.set()


@functools.cache
def _cancel_at_exit() -> None:
    # At exit, threading runs its own hooks (latest registered first) before it joins the
    # non-daemon threads; concurrent.futures' hook joins its pools' threads, the daemon's
    # model-load thread among them. This one, registered at the first build (after
    # concurrent.futures'), runs before that join and ends the build the thread waits on.
    # A private API (Python 3.9+); without it an exiting process waits for its build.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # already exiting
            register(cancel_builds)


def extensions_root() -> Path:
    """`$TORCH_EXTENSIONS_DIR`, else torch's default root (`$XDG_CACHE_HOME/torch_extensions`,
    `~/.cache/torch_extensions`), found without importing torch.utils.cpp_extension (0.4 s:
    only a build needs it, in its child)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions")))


def _compiler() -> dict[str, str]:
    """The C++ compiler torch's build will run ($CXX, else c++): its name, real path and
    version line."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return {"cxx": cxx, "cxx_path": "", "cxx_version": ""}
    try:
        out = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return {"cxx": cxx, "cxx_path": os.path.realpath(path), "cxx_version": (out.strip().splitlines() or [""])[0]}


@dataclass(frozen=True)
class ExtensionBuild:
    """One shared library to build from C++ sources with torch's extension flags."""

    name: str  # the folder's prefix and the library's name
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()  # included by the sources: part of the key
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    def key(self) -> dict[str, str]:
        """Everything the build depends on: a change of any makes another folder."""
        import torch

        digest = hashlib.sha256()
        for path in (*self.sources, *self.headers):
            digest.update(str(path).encode() + b"\0" + Path(path).read_bytes() + b"\0")
        return {
            "name": self.name,
            "sources": digest.hexdigest(),
            "cflags": " ".join(self.cflags),
            "ldflags": " ".join(self.ldflags),
            "torch": torch.__version__,
            "torch_git": str(getattr(torch.version, "git_version", "")),
            "torch_path": os.path.dirname(torch.__file__),
            "python": os.path.realpath(sys.executable),  # .venv/bin/python and python3 alike
            "python_prefix": sys.prefix,  # the venv
            "python_version": sys.version,
            "machine": platform.machine(),
            **_compiler(),
        }

    def directory(self, key: dict[str, str] | None = None) -> Path:
        key = self.key() if key is None else key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        return extensions_root() / f"{self.name}_{digest}"


def build_library(ext: ExtensionBuild, timeout_s: float) -> Path:
    """The path of `ext`'s shared library, built first unless its folder holds a finished
    build; within `timeout_s` seconds, the wait for another process's build included.
    Raises KernelBuildError (time limit, failed build: the message says which) or
    KernelBuildCancelled."""
    _cancel_at_exit()
    deadline = time.monotonic() + timeout_s
    key = ext.key()
    directory = ext.directory(key)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{ext.name}.so"
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(fd, directory, deadline, timeout_s)
        if _is_built(directory, key, library):
            return library
        # We hold the lock: no live build works here. Clear what a killed one left.
        kill_leftover_build(directory)
        for name in (TORCH_LOCK_FILE, BUILT_FILE):
            (directory / name).unlink(missing_ok=True)
        _write_json(directory / KEY_FILE, key)
        logger.info("building %s in %s (once per version of the sources, flags, compiler, torch and Python; "
                    "output in %s)", ext.name, directory, LOG_FILE)
        started = time.monotonic()
        _run_build(ext, directory, fd, deadline, timeout_s)
        if not library.is_file():
            raise KernelBuildError(f"the build left no {library.name} in {directory}")
        _write_json(directory / BUILT_FILE, key)
        logger.info("built %s in %.1f s", ext.name, time.monotonic() - started)
        return library
    finally:
        os.close(fd)  # drops the lock


def _is_built(directory: Path, key: dict[str, str], library: Path) -> bool:
    try:
        return json.loads((directory / BUILT_FILE).read_text()) == key and library.is_file()
    except (OSError, ValueError):
        return False


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _lock(fd: int, directory: Path, deadline: float, timeout_s: float) -> None:
    """flock the folder's lock file, waiting until `deadline` at most."""
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        if not told:
            logger.info("waiting up to %.0f s for pid %s, which builds in %s", max(0.0, deadline - time.monotonic()),
                        holder, directory)
            told = True
        if _cancelled.is_set():
            raise KernelBuildCancelled(f"stopped while waiting for the build lock of {directory}")
        if time.monotonic() >= deadline:
            raise KernelBuildError(
                f"gave up after {timeout_s:g} s waiting for the lock {directory / LOCK_FILE}, held by pid {holder} "
                f"(another process building the same kernels, or stuck; LLMD_KERNEL_BUILD_TIMEOUT sets the limit)")
        time.sleep(POLL_S)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


# Runs in the child: dies with the thread that started it (PR_SET_PDEATHSIG: the loader
# waits for it on that thread), then lets torch build into our folder.
_BUILDER = r"""
import ctypes, json, os, signal, sys
spec = json.loads(sys.argv[1])
if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
if os.getppid() != spec["parent"]:
    sys.exit("the process that started this build is gone")
from torch.utils.cpp_extension import load
load(name=spec["name"], sources=spec["sources"], extra_cflags=spec["cflags"], extra_ldflags=spec["ldflags"],
     build_directory=spec["directory"], is_python_module=False, verbose=True)
"""


def _run_build(ext: ExtensionBuild, directory: Path, lock_fd: int, deadline: float, timeout_s: float) -> None:
    spec = {"name": ext.name, "sources": [str(p) for p in ext.sources], "cflags": list(ext.cflags),
            "ldflags": list(ext.ldflags), "directory": str(directory), "parent": os.getpid()}
    with open(directory / LOG_FILE, "wb") as log:
        # Its own session (what is killed with it: ninja and the compilers); it holds the
        # lock too (pass_fds) for as long as it lives.
        proc = subprocess.Popen([sys.executable, "-c", _BUILDER, json.dumps(spec)], cwd=directory,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=(lock_fd,), start_new_session=True)
    try:
        (directory / SID_FILE).write_text(f"{proc.pid}\n")
        while True:
            try:
                code = proc.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if _cancelled.is_set():
                raise KernelBuildCancelled(f"stopped during the build in {directory}")
            if time.monotonic() >= deadline:
                raise KernelBuildError(f"the build did not finish within {timeout_s:g} s and was stopped "
                                       f"(LLMD_KERNEL_BUILD_TIMEOUT sets the limit; output in {directory / LOG_FILE})")
    finally:
        if proc.returncode is None:  # still running (not reaped: its ids are still its own)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child and ninja: nothing new starts
            _kill_session(directory, proc.pid)  # the compiles, each in a group of its own
            proc.wait()
        (directory / SID_FILE).unlink(missing_ok=True)
    if code != 0:
        raise KernelBuildError(f"the build failed (exit {code}): {_first_error(directory / LOG_FILE)} "
                               f"(output in {directory / LOG_FILE})")


def _first_error(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    for line in lines:
        if "error" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def build_processes(directory: Path, sid: int) -> list[int]:
    """The live processes of session `sid` working in `directory`: a build's (its child,
    ninja, the compilers) still there. Linux (/proc); [] elsewhere."""
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    target = os.path.realpath(directory)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            if os.readlink(entry / "cwd") == target:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _kill_session(directory: Path, sid: int) -> list[int]:
    """SIGKILL the build processes of session `sid` (build_processes) until none is left
    (one being killed may have started another), for 5 s at most. The pids killed."""
    killed: list[int] = []
    until = time.monotonic() + 5.0
    while (pids := build_processes(directory, sid)) and time.monotonic() < until:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed += [pid for pid in pids if pid not in killed]
        time.sleep(POLL_S)
    return killed


def kill_leftover_build(directory: Path) -> list[int]:
    """Kill what is left of a build whose starter was killed (the processes of its
    session, recorded in the folder, still working there: ninja, compilers), so two builds
    never write in one folder. Only the lock holder calls this. The pids killed."""
    try:
        sid = int((directory / SID_FILE).read_text().strip())
    except (OSError, ValueError):
        return []
    killed = _kill_session(directory, sid)
    if killed:
        logger.warning("killed %d process(es) left by an interrupted build in %s", len(killed), directory)
    (directory / SID_FILE).unlink(missing_ok=True)
    return killed
