"""The HTTP intake actor: serves the OpenAI, Ollama and llama.cpp APIs (llmd.http) on an
HTTP Unix socket beside the protocol socket and, when asked, on a loopback TCP port,
with aiohttp on the daemon's own event loop. Requests go through the same intake as the
socket protocol's (validation, tokenizing in the pool, per-user cache salt, limits), so
both faces feed one scheduler.

Who is asking: on the Unix socket the peer's uid (SO_PEERCRED); on TCP the uid that
owns the client's end of the loopback connection (from /proc/net/tcp), and the request
must carry a bearer token unless the operator turned that off. `/health` answers 200
only while the engine makes progress; `/metrics` is the Prometheus text."""
from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import weakref
from collections.abc import Awaitable, Callable

from aiohttp import web

from llmd.actors.intake import IntakeActor
from llmd.actors.messages import Query
from llmd.actors.peer_credentials import peer_ids, tcp_peer_uid
from llmd.actors.runtime import Actor
from llmd.http import llamacpp_api, ollama_api, openai_api
from llmd.http.context import ServedModel
from llmd.http.errors import ApiError
from llmd_client.protocol import MAX_FRAME_BYTES

logger = logging.getLogger("llmd.http")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpIntakeActor(Actor):
    name = "http"

    def __init__(self, sockets: list[socket.socket], intake: IntakeActor, metrics: Actor, served: ServedModel, *,
                 api_keys: list[str] | None, listen_backlog: int = 4096) -> None:
        """`api_keys`: the bearer tokens TCP clients must send; None lets TCP clients in
        without one (Unix socket clients are checked by the socket's file mode)."""
        super().__init__()
        self.sockets = sockets
        self.intake = intake
        self.metrics = metrics
        self.served = served
        self.api_keys = [k.encode() for k in api_keys] if api_keys is not None else None
        self.listen_backlog = listen_backlog
        self._tcp_uids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_FRAME_BYTES)
        app["served"] = self.served
        app["intake"] = self.intake
        app["max_body"] = MAX_FRAME_BYTES
        routes = [("GET", "/health", self._health), ("GET", "/metrics", self._metrics)]
        for method, path, handler in routes + openai_api.ROUTES + ollama_api.ROUTES + llamacpp_api.ROUTES:
            app.router.add_route(method, path, handler)
        # Ollama's clients also ask with HEAD to see if the server is up.
        app.router.add_route("HEAD", "/", ollama_api.root)
        return app

    async def run(self) -> None:
        # handler_cancellation: a client that hangs up cancels its handler, which aborts
        # its requests (llmd.http.bridge.Generation) within one engine step.
        runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            for sock in self.sockets:
                await web.SockSite(runner, sock, backlog=self.listen_backlog).start()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        errors = _error_shape(request.path)
        try:
            tcp = isinstance(request.transport.get_extra_info("sockname"), tuple) if request.transport else False
            if tcp and self.api_keys is not None and request.path != "/health":
                self._authenticate(request)
            request["uid"] = self._peer_uid(request, tcp)
            return await handler(request)
        except ApiError as exc:
            return errors(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return errors(ApiError(exc.status, exc.reason, code="not_found" if exc.status == 404 else None))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
            logger.exception("internal error handling %s %s", request.method, route)
            return errors(ApiError(500, "internal error; see the daemon log", code="internal"))

    def _authenticate(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, key) for key in self.api_keys):
            raise ApiError(401, "a valid API key is required: send Authorization: Bearer <key>",
                           code="invalid_api_key")

    def _peer_uid(self, request: web.Request, tcp: bool) -> int:
        transport = request.transport
        if transport is None:
            return -1
        if not tcp:
            return peer_ids(transport.get_extra_info("socket"))[0]
        uid = self._tcp_uids.get(transport)
        if uid is None:
            uid = tcp_peer_uid(transport.get_extra_info("peername"), transport.get_extra_info("sockname"))
            self._tcp_uids[transport] = uid
        return uid

    async def _query(self, kind: str):
        reply = asyncio.get_running_loop().create_future()
        self.metrics.send(Query(kind, 0, True, reply))
        return await reply

    async def _health(self, request: web.Request) -> web.Response:
        ok, detail = await self._query("health")
        if self.intake.draining:
            ok, detail = False, "shutting down"
        return web.json_response({"status": "ok" if ok else "unavailable", "detail": detail},
                                 status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = await self._query("metrics")
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


def _error_shape(path: str) -> Callable[[ApiError], web.Response]:
    if path.startswith("/api/") or path == "/":
        return ollama_api.error_response
    if path == "/infill":
        return llamacpp_api.error_response
    return openai_api.error_response
