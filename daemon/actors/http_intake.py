"""The HTTP intake actor: serves the OpenAI, Ollama and llama.cpp APIs (llmd.http) on an
HTTP Unix socket beside the protocol socket and, when asked, on a loopback TCP port,
with aiohttp on the daemon's own event loop. Requests go through the same intake as the
socket protocol's (validation, tokenizing in the pool, per-user cache salt, limits), so
both faces feed one scheduler.

Who is asking: on the Unix socket the peer's uid (SO_PEERCRED); on TCP the uid that
owns the client's end of the loopback connection, and the request must carry a bearer
token unless the operator turned that off (a key says "let in", not who: every key
is the same to the daemon, so the uid still comes from the connection). The uid is
looked up only for the routes that start generations (it keys quotas and the prefix
cache salt); `/health`, `/metrics` and the informational routes need none. On TCP the
lookup is one NETLINK_SOCK_DIAG query (a /proc/net/tcp scan where netlink is
unavailable), made in a thread of its own, once per connection: nothing per
connection on the event loop grows with the machine's connection count. `/health`
answers 200 only while the engine makes progress; `/metrics` is the Prometheus text."""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import socket
import weakref
from collections.abc import Awaitable, Callable

from aiohttp import web

from llmd.actors.connection_limits import CLOSE_TIMEOUT_S
from llmd.actors.intake import IntakeActor
from llmd.actors.messages import Query
from llmd.actors.peer_credentials import peer_ids, tcp_peer_uid
from llmd.actors.runtime import Actor
from llmd.http import (embeddings_api, llamacpp_api, ollama_api, openai_api, openai_chat, responses_api,
                       sleep_api, tokenize_api)
from llmd.http.context import release_model
from llmd.http.errors import ApiError
from llmd.http.guard import HOST_REFUSED, BrowserGuard
from llmd.http.malformed import QuietAppRunner
from llmd_client.protocol import MAX_FRAME_BYTES

logger = logging.getLogger("llmd.http")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_API_KEY_BYTES = 4096  # a longer Authorization token is refused unread
# The allowed origin a request came from, for its response's CORS headers.
CORS_ORIGIN = web.RequestKey("cors_origin", str) if hasattr(web, "RequestKey") else "cors_origin"


class HttpIntakeActor(Actor):
    name = "http"

    def __init__(self, sockets: list[socket.socket], intake: IntakeActor, metrics: Actor, models, *,
                 api_keys: list[str] | None, listen_backlog: int = 4096) -> None:
        """`models`: the model pool (llmd.pool.pool.ModelPool) the requests name models
        of; `api_keys`: the bearer tokens TCP clients must send; None lets TCP clients
        in without one (Unix socket clients are checked by the socket's file mode)."""
        super().__init__()
        self.sockets = sockets
        self.intake = intake
        self.metrics = metrics
        self.models = models
        self.api_keys = [k.encode() for k in api_keys] if api_keys is not None else None
        self.listen_backlog = listen_backlog
        config = getattr(intake, "config", None)  # Host/Origin checks, CORS: llmd.http.guard
        self.guard = BrowserGuard(getattr(config, "http_allowed_origins", None) or [],
                                  getattr(config, "http_host", None))
        # transport -> the future of its client's uid, for the connection's lifetime.
        self._tcp_uids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lookups = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="llmd-peer")
        # Handlers that never read request["uid"]: no lookup for them (a new route gets one).
        self._anonymous = {self._health, self._metrics, openai_api.models, openai_api.model, tokenize_api.tokenize,
                           tokenize_api.detokenize, ollama_api.tags, ollama_api.ps, ollama_api.show,
                           ollama_api.version, ollama_api.root, sleep_api.sleep, sleep_api.wake_up,
                           sleep_api.is_sleeping}

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_FRAME_BYTES)
        app["models"] = self.models
        app["model_cards"] = {}  # model name -> what listings say of it while it is not loaded
        app["intake"] = self.intake
        app["max_body"] = MAX_FRAME_BYTES
        app.on_response_prepare.append(_cors_headers)
        routes = [("GET", "/health", self._health), ("GET", "/metrics", self._metrics)]
        for method, path, handler in (routes + openai_api.ROUTES + openai_chat.ROUTES + responses_api.ROUTES
                                      + tokenize_api.ROUTES + ollama_api.ROUTES + embeddings_api.ROUTES
                                      + llamacpp_api.ROUTES + sleep_api.ROUTES):
            app.router.add_route(method, path, handler)
        # Ollama's clients also ask with HEAD to see if the server is up.
        app.router.add_route("HEAD", "/", ollama_api.root)
        return app

    async def run(self) -> None:
        # handler_cancellation: a client that hangs up cancels its handler, which aborts
        # its requests (llmd.http.bridge.Generation) within one engine step.
        # QuietAppRunner: a malformed request gets a 400 that echoes nothing, and no traceback;
        # each connection counts against the intake's connection limits (a 503 past them).
        # shutdown_timeout: at a stop (the requests drained already) a handler still writing
        # to a client that does not read is waited for this long, then cancelled and cut
        # off; aiohttp's 60 s, twice over, outlasts a service manager's stop timeout.
        runner = QuietAppRunner(self.make_app(), handler_cancellation=True, access_log=None,
                                shutdown_timeout=CLOSE_TIMEOUT_S,
                                connections=getattr(self.intake, "connections", None))
        await runner.setup()
        try:
            for sock in self.sockets:
                await web.SockSite(runner, sock, backlog=self.listen_backlog).start()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            self._lookups.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        errors = _error_shape(request.path)
        try:
            tcp = isinstance(request.transport.get_extra_info("sockname"), tuple) if request.transport else False
            if (preflight := self._browser_check(request, tcp)) is not None:
                return preflight
            if tcp and self.api_keys is not None and request.path != "/health":
                self._authenticate(request)
            if request.match_info.http_exception is None and request.match_info.handler not in self._anonymous:
                request["uid"] = await self._peer_uid(request, tcp)
            try:
                return await handler(request)
            finally:
                release_model(request)  # the response is done: its model may go idle
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

    def _browser_check(self, request: web.Request, tcp: bool) -> web.Response | None:
        """Refuse a TCP request whose Host is not this machine's (DNS rebinding) and any
        request from an origin that is not allowed (403); answer an allowed origin's CORS
        preflight (before the key check: browsers send no credentials on a preflight).
        An allowed origin's other responses get their CORS headers in _cors_headers."""
        if tcp and not self.guard.host_allowed(request.headers.get("Host")):
            raise ApiError(403, HOST_REFUSED, code="forbidden")
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if not self.guard.origin_allowed(origin):
            raise ApiError(403, "requests from this origin are not allowed: list it in http_allowed_origins",
                           code="forbidden")
        request[CORS_ORIGIN] = origin
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers=self.guard.preflight_headers(origin, request.headers))
        return None

    def _authenticate(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        # The header's bytes as sent (aiohttp keeps bytes that are not UTF-8 as surrogates).
        given = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not 0 < len(given) <= MAX_API_KEY_BYTES or \
                not any(hmac.compare_digest(given, key) for key in self.api_keys):
            raise ApiError(401, "a valid API key is required: send Authorization: Bearer <key>",
                           code="invalid_api_key")

    async def _peer_uid(self, request: web.Request, tcp: bool) -> int:
        transport = request.transport
        if transport is None:
            return -1
        if not tcp:
            return peer_ids(transport.get_extra_info("socket"))[0]  # one getsockopt
        lookup = self._tcp_uids.get(transport)
        if lookup is None:
            lookup = asyncio.get_running_loop().run_in_executor(
                self._lookups, tcp_peer_uid, transport.get_extra_info("peername"),
                transport.get_extra_info("sockname"))
            self._tcp_uids[transport] = lookup
        # shield: a handler cancelled by its client's hang-up leaves the shared answer be.
        return await asyncio.shield(lookup)

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


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An allowed origin may read the response (set before a stream's headers go out)."""
    origin = request.get(CORS_ORIGIN)
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")


def _error_shape(path: str) -> Callable[[ApiError], web.Response]:
    if path.startswith("/api/") or path == "/":
        return ollama_api.error_response
    if path == "/infill":
        return llamacpp_api.error_response
    return openai_api.error_response
