"""The HTTP listeners, bound before the model loads (so a busy port or a bad key file is
reported at once, and early clients wait in the backlog): a Unix socket beside the
protocol socket, with the same mode and group, and an optional TCP port."""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from pathlib import Path

from llmd.daemon_config import DaemonConfig
from llmd.server.unix_socket import bind_socket
from llmd_client.socket_path import http_socket_path

logger = logging.getLogger("llmd.http")


def api_keys(daemon: DaemonConfig) -> list[str] | None:
    """The bearer tokens TCP clients must send, from api_key, api_key_file (one key a
    line) and $LLMD_API_KEY; None when the operator turned the check off."""
    if not daemon.http_require_api_key:
        return None
    keys = [daemon.api_key] if daemon.api_key else []
    if daemon.api_key_file:
        try:
            keys += [line.strip() for line in Path(daemon.api_key_file).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise ValueError(f"cannot read api_key_file {daemon.api_key_file}: {exc.strerror}") from None
    if os.environ.get("LLMD_API_KEY"):
        keys.append(os.environ["LLMD_API_KEY"])
    if daemon.http_port is not None and not keys:
        raise ValueError("http_port needs an API key for TCP clients: set api_key_file, api_key or $LLMD_API_KEY "
                         "(or http_require_api_key = false to let every local process in)")
    return keys


def bind_tcp(host: str, port: int, backlog: int = 4096) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve http_host: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    if not ipaddress.ip_address(address[0]).is_loopback:
        logger.warning("HTTP listens on %s:%d, beyond loopback: other machines can reach it", address[0], port)
    return sock


def bind_http(daemon: DaemonConfig, protocol_path: str | None,
              adopted: socket.socket | None) -> tuple[list[socket.socket], str | None]:
    """(listening sockets, the Unix socket path we created or None). `adopted` is an
    HTTP socket the service manager passed in (llmd.socket's second ListenStream)."""
    sockets: list[socket.socket] = []
    created = None
    try:
        if adopted is not None:
            adopted.setblocking(False)
            sockets.append(adopted)
        elif daemon.http_socket or protocol_path:
            created = daemon.http_socket or http_socket_path(protocol_path)
            sockets.append(bind_socket(created, daemon.socket_group, daemon.listen_backlog))
        if daemon.http_port is not None:
            sockets.append(bind_tcp(daemon.http_host, daemon.http_port, daemon.listen_backlog))
    except BaseException:
        for sock in sockets:
            sock.close()
        if created:
            Path(created).unlink(missing_ok=True)
        raise
    return sockets, created


def is_http_socket(sock: socket.socket) -> bool:
    """Whether a socket the service manager passed is the HTTP one (by its path)."""
    try:
        name = sock.getsockname()
    except OSError:
        return False
    return isinstance(name, str) and name.endswith("-http.sock")
