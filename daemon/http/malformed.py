"""The HTTP faces' connections, before any handler. Requests that are not HTTP: a bad
request line, method, URL or header, a line over the size limit. aiohttp answers them
itself, before any handler, with a 400 whose body is the parser's message (which quotes
the offending bytes: the raw URL or header) and a traceback in the log for each one.
Here they get a fixed 400 text that repeats nothing the client sent, and one warning
line, at most one per interval however many arrive (the lines in between are counted),
with no traceback. And each connection counts against the daemon's connection limits,
in all and per user, with the protocol socket's (a client that opens connections and
sends slowly holds a descriptor each): past them it is answered 503 and closed."""
from __future__ import annotations

import asyncio
import logging
import math
import socket
import time

import msgspec
from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from llmd.actors.peer_credentials import peer_ids

logger = logging.getLogger("llmd.http")
LOG_INTERVAL_S = 10.0


class MalformedLog:
    """One warning line per interval, saying how many malformed requests came since."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._unlogged = 0

    def __call__(self, exc: BaseException, tcp_peer: str | None) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more since the last report)" if self._unlogged else ""
        self._last, self._unlogged = now, 0
        peer = f" from {tcp_peer}" if tcp_peer else ""
        logger.warning("malformed HTTP request%s answered 400: %s%s", peer, type(exc).__name__, more)


log_malformed = MalformedLog()


def reason(exc: BaseException) -> str:
    """A fixed text for the client, by the kind of error only."""
    if isinstance(exc, LineTooLong):
        return "Bad Request: the request line or a header is too long\n"
    return "Bad Request: malformed HTTP request\n"


class QuietRequestHandler(web_protocol.RequestHandler):
    """aiohttp's protocol, answering a request its parser refused without echo or
    traceback, and counting its connection against the limits (`_Server.connections`,
    an llmd.actors.connection_limits.OpenConnections): a Unix socket's by its peer's uid, a TCP
    one in all only (its owner is looked up per request, off the event loop)."""

    _counted_uid: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        limits = getattr(self._manager, "connections", None)
        if limits is None:
            return
        sock = transport.get_extra_info("socket")
        uid = peer_ids(sock)[0] if sock is not None and sock.family == socket.AF_UNIX else -1
        refusal = limits.admit_http(uid)
        if refusal is None:
            self._counted_uid = uid
            return
        body = msgspec.json.encode({"error": {"message": refusal.message, "type": "overloaded",
                                              "code": refusal.code}})
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted_uid is not None:
            self._manager.connections.release_http(self._counted_uid)
            self._counted_uid = None
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        log_malformed(exc, peer[0] if isinstance(peer, tuple) else None)
        response = web.Response(status=status if 400 <= status < 500 else 400, text=reason(exc))
        response.force_close()
        return response


class _Server(web.Server):
    connections = None  # the limits its connections count against (QuietAppRunner's)

    def __call__(self) -> web_protocol.RequestHandler:
        return QuietRequestHandler(self, loop=self._loop, **self._kwargs)


class QuietAppRunner(web.AppRunner):
    """web.AppRunner whose connections use QuietRequestHandler, counted against
    `connections` (None: no limit)."""

    def __init__(self, app: web.Application, *, connections=None, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._connections = connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The application's server, made by aiohttp; only the protocol it creates per
        # connection changes (tests/test_http_hardening.py checks the behaviour).
        server.__class__ = _Server
        server.connections = self._connections
        return server
