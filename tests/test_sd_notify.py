"""llmd.server.sd_notify against real sockets: the sd_notify(3) datagram protocol on a path and
an abstract AF_UNIX socket, watchdog settings, and sd_listen_fds(3) adoption of a
listening socket passed as fd 3 to a process whose pid is LISTEN_PID."""
from __future__ import annotations

import ast
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from llmd.server import sd_notify

SOURCE = Path(sd_notify.__file__)


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
                "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture
def short_dir():
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="llmd-sd-", dir="/tmp") as d:
        yield Path(d)


def _receiver(address) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(5)
    return s


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, clean_env, short_dir):
    """A datagram socket standing in for systemd's, with $NOTIFY_SOCKET pointing at it."""
    if request.param == "path":
        path = str(short_dir / "notify")
        sock, env = _receiver(path), path
    else:
        name = f"llmd-test-{uuid.uuid4().hex}"
        sock, env = _receiver(b"\0" + name.encode()), "@" + name
    clean_env.setenv("NOTIFY_SOCKET", env)
    with sock:
        yield sock


def _recv(sock: socket.socket) -> bytes:
    return sock.recv(65536)


# ---------------------------------------------------------------- notify ----

def test_notify_sends_fields_as_one_datagram(notify_socket):
    assert sd_notify.notify("READY=1", "STATUS=serving tiny-llama") is True
    assert _recv(notify_socket) == b"READY=1\nSTATUS=serving tiny-llama"


def test_convenience_messages_exact(notify_socket):
    assert sd_notify.status("loading model")
    assert _recv(notify_socket) == b"STATUS=loading model"
    assert sd_notify.ready()
    assert _recv(notify_socket) == b"READY=1"
    assert sd_notify.ready("serving x")
    assert _recv(notify_socket) == b"READY=1\nSTATUS=serving x"
    assert sd_notify.watchdog()
    assert _recv(notify_socket) == b"WATCHDOG=1"
    assert sd_notify.stopping()
    assert _recv(notify_socket) == b"STOPPING=1"
    assert sd_notify.stopping("draining 3 requests")
    assert _recv(notify_socket) == b"STOPPING=1\nSTATUS=draining 3 requests"
    assert sd_notify.extend_timeout(90)
    assert _recv(notify_socket) == b"EXTEND_TIMEOUT_USEC=90000000"
    assert sd_notify.notify(f"MAINPID={os.getpid()}")
    assert _recv(notify_socket) == f"MAINPID={os.getpid()}".encode()


def test_status_is_kept_on_one_line(notify_socket):
    assert sd_notify.status("line one\nline two")
    assert _recv(notify_socket) == b"STATUS=line one line two"


def test_utf8_status(notify_socket):
    assert sd_notify.status("modèle chargé ✓")
    assert _recv(notify_socket) == "STATUS=modèle chargé ✓".encode()


def test_malformed_field_is_a_programming_error(notify_socket):
    with pytest.raises(ValueError):
        sd_notify.notify("READY")
    with pytest.raises(ValueError):
        sd_notify.notify("READY=1\nSTATUS=x")


def test_noop_without_notify_socket(clean_env):
    assert sd_notify.notify("READY=1") is False
    assert sd_notify.ready("x") is False
    assert sd_notify.status("x") is False
    assert sd_notify.stopping() is False
    assert sd_notify.watchdog() is False
    assert sd_notify.notify() is False


@pytest.mark.parametrize("value", ["", "relative/path", "vsock:2:1234"])
def test_unusable_notify_socket_is_a_noop(clean_env, value):
    clean_env.setenv("NOTIFY_SOCKET", value)
    assert sd_notify.notify("READY=1") is False


def test_send_failure_never_raises(clean_env, short_dir, caplog):
    clean_env.setenv("NOTIFY_SOCKET", str(short_dir / "nobody-listens"))
    with caplog.at_level(logging.DEBUG, logger="llmd.server.sd_notify"):
        assert sd_notify.ready("x") is False
    assert any("failed" in r.getMessage() for r in caplog.records)
    clean_env.setenv("NOTIFY_SOCKET", "@llmd-test-nobody-" + uuid.uuid4().hex)
    assert sd_notify.watchdog() is False
    # A stream socket where a datagram socket is expected: connect fails, no raise.
    path = str(short_dir / "stream")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        s.listen()
        clean_env.setenv("NOTIFY_SOCKET", path)
        assert sd_notify.status("x") is False


# -------------------------------------------------------------- watchdog ----

def test_watchdog_interval(clean_env):
    assert sd_notify.watchdog_interval() is None
    clean_env.setenv("WATCHDOG_USEC", "60000000")
    assert sd_notify.watchdog_interval() == pytest.approx(30.0)
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sd_notify.watchdog_interval() == pytest.approx(30.0)
    clean_env.setenv("WATCHDOG_USEC", "500000")
    assert sd_notify.watchdog_interval() == pytest.approx(0.25)


def test_watchdog_interval_pid_mismatch(clean_env):
    # e.g. a GPU worker that inherited the main process's environment
    clean_env.setenv("WATCHDOG_USEC", "60000000")
    clean_env.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sd_notify.watchdog_interval() is None


@pytest.mark.parametrize("usec,pid", [("0", None), ("-5", None), ("sixty", None),
                                      ("60000000", "not-a-pid")])
def test_watchdog_interval_invalid(clean_env, usec, pid):
    clean_env.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        clean_env.setenv("WATCHDOG_PID", pid)
    assert sd_notify.watchdog_interval() is None


# ------------------------------------------------------------ listen_fds ----

def test_no_fds_without_env(clean_env):
    assert sd_notify.listen_fds() == []


def test_wrong_listen_pid_gives_no_fds(clean_env):
    clean_env.setenv("LISTEN_PID", str(os.getpid() + 1))
    clean_env.setenv("LISTEN_FDS", "1")
    clean_env.setenv("LISTEN_FDNAMES", "llmd")
    assert sd_notify.listen_fds(unset_env=False) == []
    assert os.environ["LISTEN_FDS"] == "1"  # kept when asked to
    assert sd_notify.listen_fds() == []
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        assert key not in os.environ


@pytest.mark.parametrize("pid,n", [("abc", "1"), (None, "1"), ("self", "0"), ("self", "x")])
def test_invalid_listen_env_gives_no_fds(clean_env, pid, n):
    if pid is not None:
        clean_env.setenv("LISTEN_PID", str(os.getpid()) if pid == "self" else pid)
    clean_env.setenv("LISTEN_FDS", n)
    assert sd_notify.listen_fds() == []


# The wrapper does what systemd does before exec'ing a socket-activated service: the
# listening socket becomes fd 3 and LISTEN_PID names the process that will run the
# service (exec keeps the pid).
WRAPPER = textwrap.dedent("""
    import os, sys
    fd = int(sys.argv[1])
    if fd != 3:
        os.dup2(fd, 3)
        os.close(fd)
    env = dict(os.environ, LISTEN_FDS="1", LISTEN_FDNAMES="llmd")
    env["LISTEN_PID"] = str(os.getpid()) if sys.argv[2] == "self" else sys.argv[2]
    os.execve(sys.executable, [sys.executable, "-c", sys.argv[3]], env)
""")

CHILD = textwrap.dedent("""
    import json, os, socket, sys
    from llmd.server import sd_notify
    found = sd_notify.listen_fds_with_names()
    info = {
        "n": len(found),
        "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
    }
    if found:
        sock, name = found[0]
        info.update(fd=sock.fileno(), name=name, family=int(sock.family), type=int(sock.type),
                    inheritable=os.get_inheritable(sock.fileno()),
                    listening=sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    else:
        info["fd3_inheritable"] = os.get_inheritable(3)
    print(json.dumps(info), flush=True)
    if found:
        for _ in range(2):
            conn, _ = sock.accept()
            with conn:
                conn.sendall(b"echo:" + conn.recv(100))
""")


def _spawn(listener: socket.socket, pid: str) -> subprocess.Popen:
    fd = listener.fileno()
    return subprocess.Popen([sys.executable, "-c", WRAPPER, str(fd), pid, CHILD],
                            pass_fds=(fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _talk(path: str, payload: bytes, sock: socket.socket | None = None) -> bytes:
    c = sock or socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with c:
        c.settimeout(10)
        if sock is None:
            c.connect(path)
        c.sendall(payload)
        return c.recv(100)


def test_listen_fds_adopts_socket_at_fd3(short_dir):
    path = str(short_dir / "llmd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # A client that connects before the daemon runs (as during model load) waits in
    # the backlog instead of being refused.
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.connect(path)
    proc = _spawn(listener, "self")
    listener.close()  # from here on only the child holds the listening socket
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert info["n"] == 1
        assert info["fd"] == 3
        assert info["name"] == "llmd"
        assert info["family"] == socket.AF_UNIX
        assert info["type"] == socket.SOCK_STREAM
        assert info["listening"] == 1
        assert info["inheritable"] is False  # close-on-exec: workers don't inherit it
        assert info["env_left"] == []  # LISTEN_* cleared for children
        assert _talk(path, b"early", early) == b"echo:early"
        assert _talk(path, b"late") == b"echo:late"
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_listen_fds_ignores_socket_for_another_pid(short_dir):
    path = str(short_dir / "llmd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        proc = _spawn(listener, "1")
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    info = json.loads(out)
    assert info["n"] == 0
    assert info["fd3_inheritable"] is True  # fd 3 left alone
    assert info["env_left"] == []


def test_sd_notify_imports_only_the_standard_library():
    tree = ast.parse(SOURCE.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names
