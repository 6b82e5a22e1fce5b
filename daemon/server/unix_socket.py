"""A listening Unix socket: where the daemon binds when not told, binding without ever
stealing a live daemon's socket (or letting a client find one that refuses it), and
closing it with its file on the way out."""
from __future__ import annotations

import errno
import grp
import logging
import os
import socket
import stat
from pathlib import Path

from llmd_client.socket_path import SYSTEM_SOCKET, USER_SOCKET_NAME

logger = logging.getLogger("llmd.server")


def bind_path() -> str:
    """Where to bind when no path is given: $LLMD_SOCKET, else the system socket when we
    may create it (root, or the llmd user with /run/llmd writable), else
    $XDG_RUNTIME_DIR/llmd.sock. Clients look in the same places (llmd_client.socket_path)."""
    if os.environ.get("LLMD_SOCKET"):
        return os.environ["LLMD_SOCKET"]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    system_dir = os.path.dirname(SYSTEM_SOCKET)
    if os.getuid() == 0 or not runtime or os.path.isdir(system_dir) and os.access(system_dir, os.W_OK):
        return SYSTEM_SOCKET
    return os.path.join(runtime, USER_SOCKET_NAME)


def bind_socket(path: str, group: str | None, backlog: int = 4096) -> socket.socket:
    """A listening Unix socket at `path`, mode 0660. Refuses to steal a live daemon's
    socket; removes a stale one."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise ValueError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise ValueError(f"another daemon is already listening on {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            p.unlink(missing_ok=True)
        finally:
            probe.close()
    p.parent.mkdir(parents=True, exist_ok=True)
    # Bind under a temporary name and rename once listening: a client never finds a
    # socket file that refuses connections (or has the wrong mode).
    staging = str(p.with_name(f".{p.name}.{os.getpid()}"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)
    try:
        sock.bind(staging)
    finally:
        os.umask(old_umask)
    try:
        os.chmod(staging, 0o660)
        if group:
            try:
                os.chown(staging, -1, grp.getgrnam(group).gr_gid)
            except (KeyError, PermissionError):
                pass  # no such group here, or not ours to give: mode 0660 with our own group
        sock.listen(backlog)
        os.rename(staging, path)
    except BaseException:
        sock.close()
        Path(staging).unlink(missing_ok=True)
        raise
    sock.setblocking(False)
    return sock


def socket_name(sock: socket.socket) -> str | None:
    """The path a Unix socket is bound to (an adopted one's too), or None."""
    try:
        name = sock.getsockname()
    except OSError:
        return None
    return name if isinstance(name, str) and name else None


def close_socket(sock: socket.socket | None, path: str | None) -> None:
    """Close `sock` and remove the socket file at `path` (either may be None)."""
    if sock is not None:
        sock.close()
    if path:
        try:
            os.unlink(path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                logger.warning("could not remove %s: %s", path, exc.strerror)
