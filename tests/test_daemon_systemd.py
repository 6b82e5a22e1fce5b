"""The real daemon under the service manager's protocol: it adopts a listening socket
passed as fd 3 (LISTEN_FDS/LISTEN_PID), serves a client that connected before it even
started, and reports READY=1 / STOPPING=1 on NOTIFY_SOCKET. Plus the supervisor's rule
that a dying actor fails the daemon loudly."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


from daemon_util import RawConn
from llmd.actors.runtime import Actor, Supervisor
from llmd_tools.make_model import fixture_path

# Put the inherited listener at fd 3, name ourselves in LISTEN_PID, then exec the daemon
# (exec keeps the pid, as systemd's own spawning does).
WRAPPER = r"""
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.set_inheritable(3, True)
env = dict(os.environ, LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
os.execve(sys.executable, [sys.executable, "-m", "llmd.cli", "serve"] + sys.argv[2:], env)
"""


def test_socket_activation_and_notify():
    base = Path(tempfile.mkdtemp(prefix="llmd-sd-"))
    sock_path = str(base / "llmd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(base / "notify"))
    notify.settimeout(60)
    # A client connects and submits before the daemon process even exists.
    early = RawConn(sock_path, timeout=60)
    early.send({"type": "submit", "id": "early", "prompt": "hi", "sampling": {"max_tokens": 3}})
    env = {**os.environ, "NOTIFY_SOCKET": str(base / "notify")}
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(listener.fileno()),
                             "--model", str(fixture_path("tiny-llama")), "--max-model-len", "256",
                             "--num-gpu-blocks-override", "64"],
                            pass_fds=[listener.fileno()], env=env, stderr=subprocess.PIPE, text=True)
    listener.close()  # only the daemon holds it now
    try:
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert any(m.startswith("STATUS=") for m in messages)
        final = early.until_final("early")[-1]
        assert final["usage"]["completion_tokens"] == 3
        early.close()
        proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert proc.wait(30) == 0
        assert os.path.exists(sock_path)  # an adopted socket belongs to the service manager
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


class _Crashing(Actor):
    name = "crashing"

    async def handle(self, message: object) -> None:
        raise RuntimeError("boom")


def test_an_actor_that_dies_fails_the_daemon():
    async def main() -> tuple[bool, str | None]:
        supervisor = Supervisor()
        actor = _Crashing()
        supervisor.start(actor)
        actor.send("anything")
        await asyncio.wait_for(supervisor.failed.wait(), 5)
        await supervisor.stop(["crashing"])
        return supervisor.failed.is_set(), supervisor.failure

    failed, why = asyncio.run(main())
    assert failed and "crashing" in why and "boom" in why


def test_stopping_actors_in_order_is_not_a_failure():
    async def main() -> bool:
        supervisor = Supervisor()
        supervisor.start(_Crashing())
        await asyncio.sleep(0)
        await supervisor.stop(["crashing"])
        return supervisor.failed.is_set()

    assert asyncio.run(main()) is False


# Two inherited listeners (llmd.socket's two ListenStream=): fds 3 and 4.
WRAPPER_TWO = r"""
import os, sys
first, second = int(sys.argv[1]), int(sys.argv[2])
os.dup2(first, 3); os.dup2(second, 4)
for fd in (first, second):
    if fd not in (3, 4):
        os.close(fd)
os.set_inheritable(3, True); os.set_inheritable(4, True)
env = dict(os.environ, LISTEN_FDS="2", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="llmd:llmd")
os.execve(sys.executable, [sys.executable, "-m", "llmd.cli", "serve"] + sys.argv[3:], env)
"""


def test_socket_activation_of_the_http_socket_too():
    """llmd.socket passes the protocol and the HTTP socket; the daemon tells them apart by
    name, serves HTTP on the adopted one (a client that connected before the daemon
    started included) and leaves both to the service manager on exit."""
    base = Path(tempfile.mkdtemp(prefix="llmd-sd2-"))
    listeners = []
    for name in ("llmd.sock", "llmd-http.sock"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(base / name))
        listener.listen(16)
        listeners.append(listener)
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.settimeout(120)
    early.connect(str(base / "llmd-http.sock"))
    early.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER_TWO, *(str(s.fileno()) for s in listeners),
                             "--model", str(fixture_path("tiny-llama")), "--max-model-len", "256",
                             "--num-gpu-blocks-override", "64"],
                            pass_fds=[s.fileno() for s in listeners], stderr=subprocess.PIPE, text=True)
    for listener in listeners:
        listener.close()
    try:
        reply = b""
        while chunk := early.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and b'"object":"list"' in reply, reply[:300]
        with RawConn(str(base / "llmd.sock")) as conn:
            conn.send({"type": "submit", "id": "a", "prompt": "hi", "sampling": {"max_tokens": 2}})
            assert conn.until_final("a")[-1]["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert (base / "llmd.sock").exists() and (base / "llmd-http.sock").exists()
        assert not list(base.glob("llmd-http-http.sock"))  # no third socket of its own
    finally:
        early.close()
        if proc.poll() is None:
            proc.kill()
