"""Where the daemon's socket is, and what a failure to connect to it means."""
from __future__ import annotations

import errno
import os

from llmd_client.errors import DaemonNotRunning, LlmdError

SYSTEM_SOCKET = "/run/llmd/llmd.sock"  # the systemd service's socket
USER_SOCKET_NAME = "llmd.sock"  # under $XDG_RUNTIME_DIR for a per-user daemon


def default_socket_path(explicit: str | os.PathLike[str] | None = None) -> str:
    """The socket to use: `explicit` > $LLMD_SOCKET > the system socket when it exists >
    $XDG_RUNTIME_DIR/llmd.sock > the system socket (so the error names the usual path)."""
    if explicit:
        return os.fspath(explicit)
    env = os.environ.get("LLMD_SOCKET")
    if env:
        return env
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, USER_SOCKET_NAME)
    return SYSTEM_SOCKET


def http_socket_path(protocol_socket: str) -> str:
    """The daemon's HTTP Unix socket (OpenAI, Ollama and llama.cpp APIs): beside the
    protocol socket, `llmd.sock` -> `llmd-http.sock`."""
    head, name = os.path.split(protocol_socket)
    stem = name[:-len(".sock")] if name.endswith(".sock") else name
    return os.path.join(head, f"{stem}-http.sock")


def connect_error(path: str, exc: OSError) -> LlmdError:
    """Translate a failed connect() on `path` into an error a person can act on."""
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
        return DaemonNotRunning(path, "no socket")
    if isinstance(exc, ConnectionRefusedError) or exc.errno in (errno.ECONNREFUSED, errno.ENOTSOCK):
        return DaemonNotRunning(path, "nothing listening")
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return LlmdError(f"permission denied on {path}; the socket is group `llmd`: "
                         "add yourself with `usermod -aG llmd $USER` and log in again",
                         "permission_denied")
    if exc.errno == errno.EAGAIN:
        return LlmdError(f"llmd at {path} is busy: its queue of new connections is full; try again shortly",
                         "busy")
    if exc.errno == errno.ENAMETOOLONG or "too long" in str(exc):
        return LlmdError(f"socket path is too long for a Unix socket: {path}", "bad_socket_path")
    return LlmdError(f"cannot connect to {path}: {exc.strerror or exc}", "connect_failed")
