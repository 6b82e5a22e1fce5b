"""The optional Prometheus listener: `GET /metrics` on 127.0.0.1, answered with the
metrics actor's Prometheus text (asked for by a Query message, like `llmctl metrics`).

Minimal HTTP/1.1: one request per connection (`Connection: close`), GET only (405
otherwise), 404 for any other path, 400 for anything unreadable, 403 for a `Host` that
names no host of this machine: a web page that re-points its own name at 127.0.0.1
(DNS rebinding) must not read the counters, the same rule as the HTTP faces
(llmd.http.guard)."""
from __future__ import annotations

import asyncio
import logging
import socket

from llmd.actors.messages import Query
from llmd.actors.runtime import Actor
from llmd.http.guard import HOST_REFUSED, BrowserGuard

logger = logging.getLogger("llmd.metrics_http")

HOST = "127.0.0.1"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HEADER_TIMEOUT_S = 10.0
MAX_HEADER_LINES = 100
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed"}


def bind_metrics_socket(port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:port (bound before the model loads, so a busy
    port is reported at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen for metrics on {HOST}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


async def serve_metrics(sock: socket.socket, metrics: Actor, guard: BrowserGuard) -> asyncio.Server:
    """Serve /metrics on the bound socket; close the returned server to stop."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body, extra = await _respond(reader, metrics, guard)
            head = [f"HTTP/1.1 {status} {REASONS[status]}", f"Content-Type: {CONTENT_TYPE}",
                    f"Content-Length: {len(body)}", "Connection: close", *extra]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            await writer.drain()
        except (OSError, asyncio.TimeoutError):
            pass  # the peer went away or never finished its request
        finally:
            writer.close()

    return await asyncio.start_server(handle, sock=sock)


async def _respond(reader: asyncio.StreamReader, metrics: Actor,
                   guard: BrowserGuard) -> tuple[int, bytes, list[str]]:
    """(status, body, extra header lines) for one request."""
    hosts = []
    try:
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            request_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
            for _ in range(MAX_HEADER_LINES):
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, colon, value = line.decode("latin-1").partition(":")
                if colon and name.strip().lower() == "host":
                    hosts.append(value.strip())
            else:
                return 400, b"too many header lines\n", []
    except ValueError:  # a line longer than the stream's limit
        return 400, b"header line too long\n", []
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return 400, b"malformed request line\n", []
    method, target, _ = parts
    if len(hosts) > 1:
        return 400, b"more than one Host header\n", []
    if hosts and not guard.host_allowed(hosts[0]):
        return 403, HOST_REFUSED.encode() + b"\n", []
    if method != "GET":
        return 405, b"only GET is allowed\n", ["Allow: GET"]
    if target.split("?", 1)[0] != "/metrics":
        return 404, b"not found: try /metrics\n", []
    reply = asyncio.get_running_loop().create_future()
    metrics.send(Query("metrics", 0, True, reply))
    body = (await reply).encode()
    return 200, body, []
