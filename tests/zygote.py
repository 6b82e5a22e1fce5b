"""Daemons for the tests, forked from a process that has already imported them.

Every `llmd serve` the tests start would import torch, transformers (whose model configs
pull in torch.distributed and sympy) and llmd first: ~5 of the ~7 CPU-seconds a tiny
daemon takes to start and stop, paid a hundred times a run. A zygote (one per test
process, started on first use) imports them once and forks a child per daemon. The
child is what `python -m llmd.cli ARGS` would be after its imports: a new session,
stdin and stdout on /dev/null, stderr to the daemon's log, the same environment and
working directory, `llmd.cli` run as `__main__`, atexit handlers run at exit.

Only the daemon's imports are shared: the zygote runs nothing else (no thread, no
OpenMP team, no event loop), so each child starts as a fresh process would. A daemon
whose environment differs from the one the zygote was started with (a test's `env=`,
a variable set since) is started the ordinary way, since the imports may read it.
`LLMD_TEST_ZYGOTE=0` starts every daemon the ordinary way.

The zygote is the daemons' parent: it reaps them and answers for their exit status,
so `ForkedProcess` offers the part of subprocess.Popen the tests use."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZYGOTE_ENV = "LLMD_TEST_ZYGOTE"

# The zygote's program: import, then answer requests (one JSON line each on stdin, one
# JSON line back on stdout) until stdin closes; a forked child leaves the loop and runs
# the daemon at top level, so it exits the way `python -m llmd.cli` does.
_ZYGOTE = r"""
import json, os, runpy, signal, sys, time

import llmd.cli, llmd.server.serve  # the daemon's own imports
import transformers.utils.type_validators  # what every model config class imports (torch.distributed, sympy)
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

status = {}  # pid -> Popen-style return code, once reaped
buffer = b""

def reap():
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status[pid] = -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)

def reply(message):
    os.write(1, (json.dumps(message) + "\n").encode())

def serve():
    global buffer
    reply({"ready": os.getpid()})
    while True:
        while b"\n" not in buffer:
            chunk = os.read(0, 65536)
            if not chunk:
                reap()
                sys.exit(0)
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        request = json.loads(line)
        reap()
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                return request
            reply({"pid": pid})
        elif request["op"] == "wait":
            pid, deadline = request["pid"], time.monotonic() + request["timeout"]
            while pid not in status and time.monotonic() < deadline:
                time.sleep(0.01)
                reap()
            reply({"returncode": status.get(pid)})

request = serve()
# The child: a daemon as `python -m llmd.cli ARGS` would start it.
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
log = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(null, 0)
os.dup2(null, 1)
os.dup2(log, 2)
os.close(null)
os.close(log)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.argv = [llmd.cli.__file__, *request["args"]]
del sys.modules["llmd.cli"]  # as under `python -m`, where the module is __main__ only
del request, buffer, status
runpy.run_module("llmd.cli", run_name="__main__", alter_sys=True)
"""


class ForkedProcess:
    """A daemon forked by the zygote: pid, args, returncode, poll(), wait(), send_signal(),
    terminate() and kill() as subprocess.Popen's."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._zygote.returncode(self.pid, min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may be another process's by now
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this test process (see the module doc)."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="llmd-test-zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=_BASE_ENV, start_new_session=True)
        self._lines = b""
        ready = self._read()
        if "ready" not in ready:
            raise RuntimeError(f"the test zygote did not start: {ready}")

    def _read(self) -> dict:
        while b"\n" not in self._lines:
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the test zygote exited with {self.proc.wait()}: "
                                   f"{Path(self.log.name).read_text(errors='replace')[-3000:]}")
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self._read()

    def spawn(self, args: list[str], stderr: Path, env: dict[str, str]) -> ForkedProcess:
        pid = self._ask({"op": "spawn", "args": args, "stderr": str(stderr), "cwd": os.getcwd(), "env": env})["pid"]
        return ForkedProcess(self, pid, [sys.executable, "-m", "llmd.cli", *args])

    def returncode(self, pid: int, timeout: float) -> int | None:
        return self._ask({"op": "wait", "pid": pid, "timeout": timeout})["returncode"]

    def close(self) -> None:
        """Stop the zygote (the daemons it forked are the tests' to stop)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


# pytest names the running test in the environment: the one variable a daemon's
# environment may differ in and still be forked (the child is given it).
_PER_TEST = "PYTEST_CURRENT_TEST"


def _imported_with(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key != _PER_TEST}


# The environment of the test process when the tests were collected (conftest has set
# what it sets): the zygote's, whenever it starts.
_BASE_ENV = _imported_with(dict(os.environ))
_zygote: Zygote | None = None


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """This test process's zygote, started on first use, when a daemon with environment
    `env` may be forked from it; None when it must start the ordinary way."""
    global _zygote
    if _BASE_ENV.get(ZYGOTE_ENV, "1") == "0" or _imported_with(env) != _BASE_ENV:
        return None
    if _zygote is None:
        _zygote = Zygote()
    return _zygote


def close_zygote() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None
