"""Start the real `llmd serve` as a subprocess on a temporary socket, and talk to it with
raw frames (independent of llmd_client's Client, which is tested against it too)."""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from llmd_client.protocol import ServerMessage
from zygote import ForkedProcess, zygote_for

LLMD = [sys.executable, "-m", "llmd.cli"]
# Every daemon started and not yet stopped: conftest stops what a test left behind.
LIVE: set[Daemon] = set()


def stop_all() -> None:
    for daemon in list(LIVE):
        daemon.stop(timeout=10.0)


class Daemon:
    @staticmethod
    def command(model: str, sock: str, *args: str) -> list[str]:
        return LLMD + ["serve", "--model", model, "--socket", sock, "--max-model-len", "256",
                       "--num-gpu-blocks-override", "128", *args]

    def __init__(self, model: str, sock: Path, *args: str, env: dict | None = None) -> None:
        self.sock = str(sock)
        self.log = Path(str(sock) + ".log")
        cmd = self.command(model, self.sock, *args)
        env = {**os.environ, **(env or {})}
        zygote = zygote_for(env)  # forked with the imports done, unless `env` asks otherwise (zygote.py)
        self.proc: subprocess.Popen | ForkedProcess
        if zygote is not None:
            self.proc = zygote.spawn(cmd[len(LLMD):], self.log, env)
        else:
            with self.log.open("wb") as log:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                             start_new_session=True)
        LIVE.add(self)

    def wait_ready(self, timeout: float = 60.0) -> Daemon:
        """Self once it serves; a daemon that exits or is not ready in time is stopped
        (its whole process group) before the error is raised."""
        try:
            return self._wait_ready(timeout)
        except BaseException:
            self.stop(timeout=10.0)
            raise

    def _wait_ready(self, timeout: float) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with RawConn(self.sock) as conn:
                    conn.send({"type": "status"})
                    reply = conn.recv()
                    # While the model loads the socket already answers status ("loading").
                    if reply["type"] == "status_reply" and reply.get("engine_state") != "loading":
                        return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"daemon not ready:\n{self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and wait for it; past `timeout` it is killed. Then whatever
        is left of its process group (worker processes of a daemon that died) is killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        LIVE.discard(self)
        return self.proc.returncode

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


class RawConn:
    """Length-prefixed msgpack (or JSON lines) over the socket, messages as plain dicts."""

    def __init__(self, path: str, json_mode: bool = False, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.json = json_mode
        self.buf = b""

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, message: dict) -> None:
        if self.json:
            self.sock.sendall(msgspec.json.encode(message) + b"\n")
        else:
            body = msgspec.msgpack.encode(message)
            self.sock.sendall(struct.pack(">I", len(body)) + body)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            self.buf += chunk

    def recv(self) -> dict:
        if self.json:
            while b"\n" not in self.buf:
                self._fill(len(self.buf) + 1)
            line, self.buf = self.buf.split(b"\n", 1)
            message = msgspec.json.decode(line)
        else:
            self._fill(4)
            (size,) = struct.unpack(">I", self.buf[:4])
            self._fill(4 + size)
            body, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
            message = msgspec.msgpack.decode(body)
        msgspec.convert(message, ServerMessage)  # every reply must match the schema
        return message

    def until_final(self, ident: str) -> list[dict]:
        """Messages for `ident` up to and including the one carrying usage."""
        out = []
        while True:
            message = self.recv()
            if message.get("id") == ident:
                out.append(message)
                if message["type"] == "error" or message.get("usage") is not None:
                    return out
