"""The intake actor: accepts connections on the Unix socket, decodes frames, validates,
tokenizes off the event loop, assigns request ids, records the peer's uid
(SO_PEERCRED) and forwards requests. A closed connection aborts all its requests.

Bad input gets an `Error` (a stable code and a message that names the field and limit,
never a traceback, never the raw input) and the connection stays usable where the
frame boundaries are still known."""
from __future__ import annotations

import abc
import asyncio
import collections
import functools
import grp
import itertools
import math
import logging
import os
import pwd
import re
import socket
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from llmd.actors.messages import AbortRequest, AddRequest, Query, RegisterRequest, RequestEvent
from llmd.actors.quotas import QuotaLimits, Quotas
from llmd.actors.runtime import Actor
from llmd.input_processor import InputProcessor, PreparedRequest
from llmd_client.framing import FrameError, JsonLinesCodec, MsgpackCodec
from llmd_client.protocol import (MAX_CACHE_SALT_CHARS, PROTOCOL_VERSION, Abort, Accepted, ClientMessage, Error, Hello,
                                  Metrics, MetricsReply, SamplingParams, Status, Submit, Welcome)

logger = logging.getLogger("llmd.intake")
_PEERCRED = struct.Struct("3i")
MAX_CLIENT_ID_CHARS = 128
LARGE_PROMPT_CHARS = 64 << 10  # prompts longer than this are tokenized apart from the rest
_QUOTED_VALUE = re.compile(r"'[^']*'|\"[^\"]*\"")
_BACKTICKED = re.compile(r"`([^`]*)`")
# What msgspec puts in backticks: field names, `$.paths` and type names (`int | null`).
_NAME = re.compile(r"[$A-Za-z_][A-Za-z0-9_.$\[\] |,]{0,63}")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(.*?)`( - at `\$[A-Za-z0-9_.\[\]]*`)?$", re.S)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def safe_message(exc: BaseException, limit: int = 300) -> str:
    """An error's text without any (possibly user-supplied) values, bounded. msgspec
    names fields, paths and types in backticks and quotes values: names are kept (a name
    that is not a plain identifier or path could be anything, and is dropped too)."""
    text = str(exc)
    unknown = _UNKNOWN_FIELD.match(text)
    if unknown:  # the field's name is the client's: keep it only when it is a plain name
        name = unknown.group(1) if _IDENTIFIER.fullmatch(unknown.group(1)) else "<value>"
        return f"Object contains unknown field `{name}`{unknown.group(2) or ''}"[:limit]
    text = _QUOTED_VALUE.sub("<value>", text)
    text = _BACKTICKED.sub(lambda m: m.group(0) if _NAME.fullmatch(m.group(1)) else "<value>", text)
    return text[:limit]


def frame_error_message(exc: BaseException) -> str:
    """A readable reason for a frame that does not decode as a message."""
    text = safe_message(exc)
    unknown = _UNKNOWN_FIELD.match(text)
    if unknown and unknown.group(1) in SamplingParams.__struct_fields__ and not unknown.group(2):
        return f"unknown field `{unknown.group(1)}`: sampling fields go in `sampling`"
    return text


class RequestSink(abc.ABC):
    """Where the detokenizer sends one request's outputs (`send`) and says that the request
    is over (`finished`). Subclasses deliver to a socket connection or an HTTP response."""

    __slots__ = ("client_id", "request_id", "stream", "finished_samples", "release")

    def __init__(self, client_id: str, stream: bool) -> None:
        self.client_id = client_id
        self.request_id = ""  # set on admission
        self.stream = stream
        self.finished_samples: set[int] = set()
        self.release: Callable[[], None] | None = None  # set on admission: gives back what it held

    @abc.abstractmethod
    def send(self, message: object) -> None:
        """Deliver one message to the request's client."""

    @property
    def wanted(self) -> bool:
        """False once the peer has gone: a request it no longer waits for is not started."""
        return True

    @property
    def connection(self) -> object | None:
        """What the per-connection request limit counts against (None: no such limit)."""
        return None

    def finished(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None


class ConnectionSink(RequestSink):
    """A request submitted on a protocol connection, under the connection's id for it."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection, client_id: str, stream: bool) -> None:
        super().__init__(client_id, stream)
        self.conn = conn

    @property
    def connection(self) -> object:
        return self.conn

    def send(self, message: object) -> None:
        self.conn.send(message)

    @property
    def wanted(self) -> bool:
        return not self.conn.closed

    def finished(self) -> None:
        self.conn.requests.pop(self.client_id, None)
        super().finished()


class Connection:
    def __init__(self, intake: IntakeActor, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.intake = intake
        self.reader = reader
        self.writer = writer
        self.codec: MsgpackCodec | JsonLinesCodec | None = None
        self.requests: dict[str, RequestSink] = {}
        self.closed = False
        self.uid, self.gid = peer_ids(writer.get_extra_info("socket"))
        self.admin = intake.is_admin(self.uid, self.gid)
        self._local_ids = itertools.count(1)

    def send(self, message: object) -> None:
        # The peer may have gone before this connection's reader noticed: drop, don't raise
        # (the reader's end-of-stream aborts the connection's requests).
        if self.closed or self.codec is None or self.writer.is_closing():
            return
        self.writer.write(self.codec.encode(message))

    async def _read(self, size: int) -> bytes:
        """The next bytes from the peer; b"" at its end, or when it stayed silent for the
        idle timeout with no request in flight (an idle connection holds a descriptor)."""
        if self.requests:
            return await self.reader.read(size)
        try:
            return await asyncio.wait_for(self.reader.read(size), self.intake.idle_timeout_s)
        except TimeoutError:
            return b""

    async def refuse(self, error: Error) -> None:
        """Tell the peer why it cannot stay (in its own framing), then close."""
        try:
            first = await asyncio.wait_for(self.reader.read(1), 2.0)
            if first:
                self.codec = (JsonLinesCodec if first == b"{" else MsgpackCodec)(ClientMessage)
                self.send(error)
                await asyncio.wait_for(self.writer.drain(), 2.0)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            await self._close()

    async def serve(self, codec: MsgpackCodec | JsonLinesCodec | None = None, held: list[bytes] = ()) -> None:
        """Serve the connection to its end. `codec` and `held` (frames read but not yet
        answered) continue a connection the loading responder took while the model loaded."""
        try:
            if codec is None:
                data = await self._read(1)
                if not data:
                    return
                self.codec = (JsonLinesCodec if data == b"{" else MsgpackCodec)(ClientMessage)
            else:
                self.codec, data = codec, b""
            pending = list(held)
            while data or pending:
                try:
                    frames = pending + self.codec.feed(data)
                    pending = []
                except FrameError as exc:
                    self.send(Error(code="bad_frame", message=safe_message(exc)))
                    return  # the stream cannot be resynchronised
                for body in frames:
                    await self._dispatch_frame(body)
                    if self.closed:
                        return
                await self.writer.drain()
                data = await self._read(1 << 16)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            logger.exception("connection handler failed")
        finally:
            await self._close()

    async def _dispatch_frame(self, body: bytes) -> None:
        try:
            message = self.codec.decode(body)
        except msgspec.ValidationError as exc:
            text = frame_error_message(exc)
            if text.endswith("at `$.type`") or "missing required field `type`" in text:
                self.send(Error(code="bad_request", message="unknown or missing message type"))
            elif "`$.sampling" in text:
                self.send(Error(code="invalid_params", message=text))
            else:
                self.send(Error(code="bad_request", message=text))
            return
        except (msgspec.DecodeError, UnicodeDecodeError):
            what = "UTF-8 JSON" if self.codec.json else "msgpack (strings must be UTF-8)"
            self.send(Error(code="bad_frame", message=f"frame is not valid {what}"))
            return
        try:
            await self._dispatch(message)
        except Exception:  # a bug must not take the connection's peer down with a traceback
            logger.exception("internal error handling a %s message", type(message).__name__)
            self.send(Error(code="internal", message="internal error; see the daemon log"))

    async def _dispatch(self, message: object) -> None:
        match message:
            case Hello(protocol_version=version):
                if version != PROTOCOL_VERSION:
                    self.send(Error(code="unsupported_version",
                                    message=f"protocol version {version} is not supported (this daemon speaks "
                                            f"{PROTOCOL_VERSION})"))
                    self.closed = True
                    return
                self.send(Welcome(protocol_version=PROTOCOL_VERSION, server_version=self.intake.server_version,
                                  model=self.intake.model_name))
            case Submit():
                await self._submit(message)
            case Abort(id=ident):
                self._abort(ident)
            case Status():
                self.send(await self.intake.query("status", self.uid, self.admin))
            case Metrics():
                self.send(MetricsReply(await self.intake.query("metrics", self.uid, self.admin)))

    async def _submit(self, submit: Submit) -> None:
        intake = self.intake
        if submit.id is not None and len(submit.id) > MAX_CLIENT_ID_CHARS:  # first: it is never echoed whole
            self.send(Error(code="bad_request", message=f"id must have at most {MAX_CLIENT_ID_CHARS} characters"))
            return
        client_id = submit.id if submit.id is not None else f"c{next(self._local_ids)}"
        sources = sum(x is not None for x in (submit.prompt, submit.messages, submit.token_ids))
        if sources != 1:
            self.send(Error(code="bad_request", id=client_id,
                            message="exactly one of prompt, messages or token_ids is required"))
            return
        if client_id in self.requests:
            self.send(Error(code="bad_request", id=client_id, message="id is already in use on this connection"))
            return
        sink = ConnectionSink(self, client_id, submit.stream)
        result = await intake.admit(submit, self.uid, sink)
        if isinstance(result, Error):
            self.send(result)
        elif sink.wanted:
            self.requests[client_id] = sink
            self.send(Accepted(id=client_id, request_id=sink.request_id, prompt_tokens=len(result.token_ids)))

    def _abort(self, ident: str) -> None:
        sink = self.requests.get(ident)
        if sink is None:
            entry = self.intake.registry.get(ident)
            if entry is None:
                self.send(Error(code="unknown_id", id=ident[:MAX_CLIENT_ID_CHARS], message="no such request in flight"))
                return
            sink, owner = entry
            if owner != self.uid and not self.admin:
                self.send(Error(code="forbidden", id=ident[:MAX_CLIENT_ID_CHARS],
                                message="the request belongs to another user"))
                return
        self.intake.abort([sink.request_id])

    async def _close(self) -> None:
        self.closed = True
        if self.requests:
            self.intake.abort([s.request_id for s in self.requests.values()])
        if self in self.intake.connections:
            self.intake.connections.discard(self)
            self.intake.connections_by_uid[self.uid] -= 1
        try:
            self.writer.close()
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class IntakeActor(Actor):
    name = "intake"

    def __init__(self, sock: socket.socket, input_processor: InputProcessor, *, scheduler: Actor,
                 detokenizer: Actor, metrics: Actor, model_name: str, server_version: str,
                 admin_group: str | None = "llmd-admin", max_pending_requests: int = 4096,
                 prefix_cache_scope: str = "user", listen_backlog: int = 4096, max_connections: int = 4096,
                 max_connections_per_user: int = 256, idle_timeout_s: float = 600.0,
                 quotas: QuotaLimits = QuotaLimits()) -> None:
        super().__init__()
        self.sock = sock
        self.input_processor = input_processor
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.model_name = model_name
        self.server_version = server_version
        self.admin_group = admin_group
        self.max_pending_requests = max_pending_requests
        self.prefix_cache_scope = prefix_cache_scope
        self.listen_backlog = listen_backlog
        self.max_connections = max_connections
        self.max_connections_per_user = max_connections_per_user
        self.idle_timeout_s = idle_timeout_s
        self.quotas = Quotas(quotas)
        self.connections_by_uid: collections.Counter[int] = collections.Counter()
        self._last_refusal_log = -math.inf
        self.registry: dict[str, tuple[RequestSink, int]] = {}
        self.connections: set[Connection] = set()
        self.request_counter = itertools.count(1)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmd-tokenize")
        self.large_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-tokenize-long")
        self.draining = False
        self._server: asyncio.base_events.Server | None = None

    async def run(self) -> None:
        # asyncio listens again on the socket it is given, with its own backlog of 100
        # unless told: 1,000 clients connecting at once would find the queue full.
        self._server = await asyncio.start_unix_server(self._on_connection, sock=self.sock, limit=1 << 16,
                                                       backlog=self.listen_backlog)
        try:
            await asyncio.Event().wait()
        finally:
            self._server.close()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.large_pool.shutdown(wait=False, cancel_futures=True)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.adopt(reader, writer)

    async def adopt(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    codec: MsgpackCodec | JsonLinesCodec | None = None, held: list[bytes] = ()) -> None:
        """Serve a connection: a new one, or one the loading responder hands over."""
        conn = Connection(self, reader, writer)
        refusal = self._connection_refusal(conn.uid)
        if refusal is not None:
            await conn.refuse(refusal)
            return
        self.connections.add(conn)
        self.connections_by_uid[conn.uid] += 1
        await conn.serve(codec, held)

    def _connection_refusal(self, uid: int) -> Error | None:
        """Why a new connection cannot be served (too many in all, or from its user), or None."""
        if len(self.connections) >= self.max_connections:
            reason = f"too many connections (limit {self.max_connections})"
        elif self.connections_by_uid[uid] >= self.max_connections_per_user:
            reason = f"too many connections from this user (limit {self.max_connections_per_user})"
        else:
            return None
        now = time.monotonic()
        if now - self._last_refusal_log >= 10.0:  # a storm of refusals logs one line per 10 s
            self._last_refusal_log = now
            logger.warning("refusing connections: %s (uid %d)", reason, uid)
        return Error(code="overloaded", message=reason)

    async def admit(self, submit: Submit, uid: int, sink: RequestSink, *,
                    strict_max_tokens: bool = True) -> Error | PreparedRequest:
        """Validate and tokenize `submit` (in the pool), then hand it to the detokenizer and
        the scheduler with `sink` as its destination. An Error (naming the field and the
        limit) means nothing was started. A prompt plus max_tokens past max_model_len is
        refused (vLLM's rule), or with `strict_max_tokens=False` shortened to fit (Ollama's
        num_predict and llama.cpp's n_predict mean "at most")."""
        client_id = sink.client_id
        if submit.cache_salt is not None and len(submit.cache_salt) > MAX_CACHE_SALT_CHARS:
            return Error(code="invalid_params", id=client_id,
                         message=f"cache_salt must have at most {MAX_CACHE_SALT_CHARS} characters")
        if self.draining:
            return Error(code="shutting_down", id=client_id, message="the daemon is shutting down")
        if len(self.registry) >= self.max_pending_requests:
            return Error(code="overloaded", id=client_id,
                         message=f"too many requests in flight (limit {self.max_pending_requests})")
        chars = _prompt_chars(submit)
        if chars > self.input_processor.max_prompt_chars:
            return Error(code="invalid_params", id=client_id,
                         message=f"prompt is too long: no prompt of {chars} characters fits max_model_len "
                                 f"({self.input_processor.max_model_len} tokens)")
        refusal = self.quotas.reserve(uid, sink.connection)
        if refusal is not None:
            return Error(code="overloaded", id=client_id, message=refusal)
        try:
            prepared = await self._prepare(submit, uid, chars, strict_max_tokens)
        except BaseException:
            self.quotas.release(uid, sink.connection)
            raise
        if isinstance(prepared, Error):
            self.quotas.release(uid, sink.connection)
            return msgspec.structs.replace(prepared, id=client_id)
        tokens = len(prepared.token_ids) * len(prepared.children)
        refusal = self.quotas.charge_tokens(uid, tokens) if sink.wanted else "gone"
        if refusal is not None:
            self.quotas.release(uid, sink.connection)
            return prepared if refusal == "gone" else Error(code="overloaded", id=client_id, message=refusal)
        request_id = prepared.request_id
        sink.request_id = request_id
        sink.release = functools.partial(self._release, request_id, uid, sink.connection, tokens)
        self.registry[request_id] = (sink, uid)
        arrival = prepared.children[0].arrival_time
        self.metrics.send(RequestEvent(request_id, "queued", arrival, uid=uid,
                                       prompt_tokens=len(prepared.token_ids)))
        # The detokenizer must know the request before any of its tokens can arrive.
        self.detokenizer.send(RegisterRequest(request_id, prepared.token_ids, prepared.params,
                                              prepared.child_ids, sink))
        self.scheduler.send(AddRequest(request_id, prepared.children))
        return prepared

    async def _prepare(self, submit: Submit, uid: int, chars: int, strict_max_tokens: bool
                       ) -> PreparedRequest | Error:
        request_id = f"r{next(self.request_counter)}"
        # Long texts are tokenized on a pool of their own, so they never hold up short ones.
        pool = self.large_pool if chars > LARGE_PROMPT_CHARS else self.pool
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, self.prepare, request_id, submit, uid, self.cache_salt(uid, submit.cache_salt),
                time.monotonic(), strict_max_tokens)
        except ValueError as exc:
            return Error(code="invalid_params", message=safe_message(exc))

    def _release(self, request_id: str, uid: int, connection: object | None, tokens: int) -> None:
        self.registry.pop(request_id, None)
        self.quotas.release(uid, connection, tokens)

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.send(AbortRequest(request_ids))

    def cache_salt(self, uid: int, requested: str | None) -> str | None:
        """The prefix-cache key's salt: per user unless the operator shares the cache, so
        one user's prompts are never a cache hit (a timing and `cached_tokens` oracle)
        for another."""
        if self.prefix_cache_scope == "shared":
            return requested
        return f"uid={uid}" if requested is None else f"uid={uid}/{requested}"

    def prepare(self, request_id: str, submit: Submit, uid: int, cache_salt: str | None, arrival: float,
                strict_max_tokens: bool = False):
        """Runs in the tokenizer pool."""
        processor = self.input_processor
        if submit.messages is not None:
            prompt: str | list[int] = processor.render_chat([{"role": m.role, "content": m.content}
                                                              for m in submit.messages])
        elif submit.token_ids is not None:
            prompt = submit.token_ids
        else:
            prompt = submit.prompt
        return processor.prepare(request_id, prompt, submit.sampling, priority=submit.priority,
                                 cache_salt=cache_salt, arrival_time=arrival,
                                 strict_max_tokens=strict_max_tokens, owner=uid)

    async def query(self, kind: str, uid: int, admin: bool):
        reply = asyncio.get_running_loop().create_future()
        self.metrics.send(Query(kind, uid, admin, reply))
        return await reply

    def is_admin(self, uid: int, gid: int) -> bool:
        if uid in (0, os.getuid()):
            return True
        if not self.admin_group:
            return False
        try:
            group = grp.getgrnam(self.admin_group)
        except KeyError:
            return False
        if gid == group.gr_gid:
            return True
        try:
            return pwd.getpwuid(uid).pw_name in group.gr_mem
        except KeyError:
            return False

    def stop_accepting(self, close_listener: bool = True) -> None:
        """Drain: new requests are refused with `shutting_down`. With close_listener the
        socket stops accepting (under socket activation new clients then wait for the
        next start); otherwise new clients still connect and are told why."""
        self.draining = True
        if close_listener and self._server is not None:
            self._server.close()

    def live_request_ids(self) -> list[str]:
        return list(self.registry)


def _prompt_chars(submit: Submit) -> int:
    if submit.prompt is not None:
        return len(submit.prompt)
    if submit.messages is not None:
        return sum(len(m.content) + len(m.role) for m in submit.messages)
    return 0


def peer_ids(sock: socket.socket | None) -> tuple[int, int]:
    """(uid, gid) of a Unix socket's peer (SO_PEERCRED); (-1, -1) when it cannot be told."""
    try:
        _pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return uid, gid
    except (OSError, AttributeError):
        return -1, -1
