"""systemd integration without libsystemd: the sd_notify(3) and sd_listen_fds(3) protocols.

Standard library only (no torch, no third-party packages), so the daemon can report
readiness before anything heavy is imported, and tests need no systemd.

Notification (``Type=notify`` services)::

    from llmd.server import sd_notify
    sd_notify.status("loading model /var/lib/llmd/models/x")
    ...                                   # load weights, size the KV cache
    sd_notify.ready("serving x on /run/llmd/llmd.sock")
    interval = sd_notify.watchdog_interval()   # seconds between pings, or None
    ...                                   # every `interval` seconds: sd_notify.watchdog()
    sd_notify.stopping()                  # on SIGTERM, before draining

Every call is a no-op returning False when ``$NOTIFY_SOCKET`` is unset (the daemon run by
hand or under tests) and never raises: a failed send is logged at debug level.

Socket activation (``llmd.socket``)::

    socks = sd_notify.listen_fds()        # [] unless systemd passed us sockets

returns the listening sockets systemd passed (fd 3 onwards) as ``socket.socket`` objects.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
_LISTEN_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def _notify_address() -> str | bytes | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return None
    if addr[0] == "@":  # abstract namespace: a leading NUL byte instead of '@'
        return b"\0" + addr[1:].encode()
    if addr[0] == "/":
        return addr
    # systemd also knows vsock:CID:PORT (VMs); llmd runs as a local service only.
    log.debug("sd_notify: unsupported NOTIFY_SOCKET %r", addr)
    return None


def notify(*fields: str) -> bool:
    """Send ``fields`` (e.g. ``"READY=1"``, ``"STATUS=..."``) to systemd as one datagram.

    Returns True when the datagram was sent, False when ``$NOTIFY_SOCKET`` is unset or
    unusable or the send failed. Never raises for send failures.
    """
    if not fields:
        return False
    for f in fields:
        if "=" not in f or "\n" in f:
            raise ValueError(f"sd_notify field must be KEY=VALUE on one line, got {f!r}")
    addr = _notify_address()
    if addr is None:
        return False
    payload = "\n".join(fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(payload)
    except OSError as e:
        log.debug("sd_notify: sending %r to %r failed: %s", fields, addr, e)
        return False
    return True


def _status_field(text: str) -> str:
    # STATUS= is one line of free text; keep the datagram well formed.
    return "STATUS=" + " ".join(str(text).splitlines())


def ready(status: str | None = None) -> bool:
    """``READY=1`` (plus an optional ``STATUS=``): the model is loaded and the socket is
    being served. Before it, systemd holds ``systemctl start`` and ordered units."""
    fields = ["READY=1"]
    if status is not None:
        fields.append(_status_field(status))
    return notify(*fields)


def status(text: str) -> bool:
    """``STATUS=text``: shown by ``systemctl status llmd``."""
    return notify(_status_field(text))


def stopping(status: str | None = None) -> bool:
    """``STOPPING=1``: the daemon began its shutdown (drain)."""
    fields = ["STOPPING=1"]
    if status is not None:
        fields.append(_status_field(status))
    return notify(*fields)


def watchdog() -> bool:
    """``WATCHDOG=1``: keep-alive ping for ``WatchdogSec=``."""
    return notify("WATCHDOG=1")


def extend_timeout(seconds: float) -> bool:
    """``EXTEND_TIMEOUT_USEC=``: ask for ``seconds`` more before the start (or stop)
    timeout fires, e.g. while loading a model bigger than ``TimeoutStartSec=`` allows."""
    return notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of ``$WATCHDOG_USEC``), or None when no
    watchdog applies to this process (unset, invalid, zero, or ``$WATCHDOG_PID`` names
    another process — e.g. a worker that inherited the environment)."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    try:
        value = int(usec)
    except ValueError:
        log.debug("sd_notify: invalid WATCHDOG_USEC %r", usec)
        return None
    if value <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            log.debug("sd_notify: invalid WATCHDOG_PID %r", pid)
            return None
    return value / 1_000_000 / 2


def listen_fds_with_names(unset_env: bool = True) -> list[tuple[socket.socket, str]]:
    """Like :func:`listen_fds`, with each socket's name from ``$LISTEN_FDNAMES``
    (``FileDescriptorName=`` of the socket unit; ``"unknown"`` when not given)."""
    try:
        pid_s = os.environ.get("LISTEN_PID")
        n_s = os.environ.get("LISTEN_FDS")
        names_s = os.environ.get("LISTEN_FDNAMES")
        if not pid_s or not n_s:
            return []
        try:
            pid, n = int(pid_s), int(n_s)
        except ValueError:
            log.debug("sd_listen_fds: invalid LISTEN_PID=%r LISTEN_FDS=%r", pid_s, n_s)
            return []
        if pid != os.getpid() or n <= 0:
            return []
        names = names_s.split(":") if names_s else []
        if len(names) != n:
            names = ["unknown"] * n
        out: list[tuple[socket.socket, str]] = []
        for fd, name in zip(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n), names):
            try:
                os.set_inheritable(fd, False)  # FD_CLOEXEC: workers must not inherit it
                sock = socket.socket(fileno=fd)  # family/type/proto detected from the fd
            except OSError as e:
                log.warning("sd_listen_fds: fd %d (%s) is not a usable socket: %s", fd, name, e)
                continue
            out.append((sock, name))
        return out
    finally:
        if unset_env:
            for key in _LISTEN_ENV:
                os.environ.pop(key, None)


def listen_fds(unset_env: bool = True) -> list[socket.socket]:
    """The sockets systemd passed by socket activation (``sd_listen_fds(3)``).

    Only when ``$LISTEN_PID`` is this process: fds 3 .. 3+``$LISTEN_FDS``-1, each made
    close-on-exec and wrapped as ``socket.socket`` (family detected from the fd). With
    ``unset_env`` the ``LISTEN_*`` variables are removed so child processes (GPU workers)
    do not see them. The sockets are returned as systemd passed them (blocking, already
    listening); asyncio's ``start_unix_server(sock=...)`` makes them non-blocking.
    """
    return [sock for sock, _ in listen_fds_with_names(unset_env)]
