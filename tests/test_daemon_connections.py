"""The daemon's connections against abusive clients, end to end: the limits on open
connections in all and per user (the protocol socket's and the HTTP faces' counted
together), the idle timeout and the listen backlog, and a stop that ends while clients
flood it and never read."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import time

import msgspec
import pytest

from daemon_util import Daemon, RawConn
from http_clients import http_socket
from test_daemon import _assert_serves, model  # noqa: F401  (model: the module's fixture)


def test_connection_limits_idle_timeout_and_backlog(model, tmp_path):
    """Per-user connection cap with a clear refusal (and one log line), idle connections
    closed, the listen backlog the daemon asked for kept (asyncio's default is 100)."""
    config = tmp_path / "llmd.toml"
    config.write_text("max_connections_per_user = 3\nidle_timeout_s = 4.0\nlisten_backlog = 2048\n")
    d = Daemon(model, tmp_path / "s.sock", "--config", str(config)).wait_ready()
    try:
        listing = subprocess.run(["ss", "-xlnH"], capture_output=True, text=True).stdout
        # The socket was bound under a staging name (then renamed): the kernel shows that one.
        # Its whole path: other tests' daemons (another xdist worker) stage an "s.sock" too.
        staged = os.path.join(os.path.dirname(str(d.sock)), f".{os.path.basename(d.sock)}.")
        line = next(row for row in listing.splitlines() if staged in row)
        assert int(line.split()[3]) == 2048  # Send-Q of a listening socket: its backlog
        held = [RawConn(d.sock) for _ in range(3)]
        for conn in held:
            conn.send({"type": "status"})
            assert conn.recv()["type"] == "status_reply"
        with RawConn(d.sock, json_mode=True) as extra:
            extra.send({"type": "status"})
            reply = extra.recv()
        assert reply["code"] == "overloaded" and "limit 3" in reply["message"]
        assert d.stderr().count("refusing connections") == 1
        time.sleep(5.0)  # idle past the timeout: the daemon closes them
        for conn in held:
            with pytest.raises((ConnectionError, OSError)):
                conn.send({"type": "status"})
                conn.recv()
            conn.close()
        _assert_serves(d.sock)
    finally:
        assert d.stop() == 0, d.stderr()


def test_http_connections_count_against_the_same_limits(model, tmp_path):
    """A user's connections to the HTTP faces count with their socket connections against
    max_connections_per_user: three HTTP clients that send half a request and wait (each
    holds a descriptor) use the user's limit; a fourth HTTP connection is answered 503
    naming the limit and a socket one `overloaded`; once one of them goes, an HTTP request
    is served. Before, the HTTP faces took connections without limit (400 half-sent
    requests held 415 descriptors)."""
    config = tmp_path / "llmd.toml"
    config.write_text("max_connections_per_user = 3\n")
    d = Daemon(model, tmp_path / "s.sock", "--config", str(config)).wait_ready()
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while len(held) < 3:
            # wait_ready's own connection counts until the daemon has closed its end: a
            # connection refused meanwhile (a 503 at once) is tried again
            assert time.monotonic() < deadline, "the user's limit never came free"
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(http_socket(d.sock))
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            conn.settimeout(0.5)
            try:
                refused_now = conn.recv(64).startswith(b"HTTP/1.1 503")
            except TimeoutError:  # no answer: it is held, waiting for the rest of its body
                refused_now = False
            if refused_now:
                conn.close()
            else:
                held.append(conn)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
            extra.settimeout(10)
            extra.connect(http_socket(d.sock))
            reply = b""
            while chunk := extra.recv(4096):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"too many connections from this user (limit 3)" in body, reply
        with RawConn(d.sock, json_mode=True) as refused:
            refused.send({"type": "status"})
            assert refused.recv()["code"] == "overloaded"
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the daemon sees the close within a moment
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as again:
                again.settimeout(10)
                again.connect(http_socket(d.sock))
                again.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status = again.recv(64)
            if status.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status.startswith(b"HTTP/1.1 200"), status
    finally:
        for conn in held:
            conn.close()
        assert d.stop() == 0, d.stderr()


def test_sigterm_ends_while_clients_flood_and_never_read(model, tmp_path):
    """Clients send as fast as they can and never read the replies: two status frames on
    the daemon's socket, two pipelined HTTP GET /v1/models on its HTTP socket, until the
    daemon stops reading them too (their sends block: its replies backed up); then
    SIGTERM. The daemon exits 0 within 15 s with no traceback, while they still send.
    Before, its stop closed such connections gracefully, a close that waits for the
    client to read (the socket face never exited), and aiohttp waited 60 s twice for a
    handler stuck writing (still running 60 s on)."""
    status = msgspec.msgpack.encode({"type": "status"})
    frames = [struct.pack(">I", len(status)) + status] * 2 + [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"] * 2
    for attempt in range(2):
        d = Daemon(model, tmp_path / f"s{attempt}.sock", "--drain-timeout-s", "1").wait_ready()
        conns = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in frames]
        try:
            for i, conn in enumerate(conns):
                conn.settimeout(0.5)
                conn.connect(d.sock if i < 2 else http_socket(d.sock))
            blocked: set[int] = set()
            deadline = time.monotonic() + 30
            while len(blocked) < len(conns):
                assert time.monotonic() < deadline, f"the daemon went on reading clients that never read: {blocked}"
                for i, conn in enumerate(conns):
                    if i not in blocked:
                        try:
                            conn.sendall(frames[i] * 16)
                        except TimeoutError:
                            blocked.add(i)
            d.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            while d.proc.poll() is None:
                assert time.monotonic() < deadline, f"attempt {attempt}: still running 15 s after SIGTERM"
                for i, conn in enumerate(conns):
                    with contextlib.suppress(OSError):
                        conn.sendall(frames[i])
            assert d.proc.poll() == 0
            assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]
        finally:
            for conn in conns:
                conn.close()
            d.stop()
