"""The intake actor: accepts connections on the Unix socket (each served by a
`Connection`), validates and tokenizes requests off the event loop, assigns request ids
and forwards them, with the peer's uid, to the detokenizer and the scheduler of the
model they name (the pool's: llmd.pool; a model not loaded is loaded first, the request
waiting). The HTTP intake admits its requests through the same `admit`.

Bad input gets an `Error` (a stable code and a message that names the field and limit,
never a traceback, never the raw input) and the connection stays usable where the
frame boundaries are still known."""
from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import msgspec

from llmd.actors.connection import Connection
from llmd.actors.connection_limits import OpenConnections
from llmd.actors.error_text import safe_message
from llmd.actors.messages import AbortRequest, AddRequest, Query, RegisterRequest, RequestEvent
from llmd.actors.peer_credentials import is_admin
from llmd.actors.quotas import QuotaLimits, Quotas
from llmd.actors.request_sink import RequestSink
from llmd.actors.runtime import Actor
from llmd.daemon_config import DaemonConfig
from llmd.input_processor import InputProcessor, PreparedRequest
from llmd.pool.pool import ModelPool
from llmd.pool.registry import UnknownModel
from llmd.pool.slot import Lease, ModelUnavailable
from llmd_client.durations import parse_duration
from llmd_client.framing import JsonLinesCodec, MsgpackCodec
from llmd_client.protocol import (MAX_CACHE_SALT_CHARS, PROTOCOL_VERSION, ChatMessage, Embed, Error, ModelsReply,
                                  Output, Submit, Usage, Welcome)

logger = logging.getLogger("llmd.intake")
T = TypeVar("T")
LARGE_PROMPT_CHARS = 64 << 10  # prompts longer than this are tokenized apart from the rest


class Admission(NamedTuple):
    """An admitted request: where its outputs go, whose it is, which model runs it."""

    sink: RequestSink
    uid: int
    model: Any  # llmd.pool.loaded_model.LoadedModel


class IntakeActor(Actor):
    name = "intake"

    def __init__(self, sock: socket.socket, pool: ModelPool, *, metrics: Actor, server_version: str,
                 config: DaemonConfig, max_connections: int) -> None:
        """`pool`: the models, loaded on demand; `config`: the operator's limits;
        `max_connections` is config's, capped by the open-files limit."""
        super().__init__()
        self.sock = sock
        self.models = pool
        self.metrics = metrics
        self.welcome = Welcome(protocol_version=PROTOCOL_VERSION, server_version=server_version,
                               model=pool.registry.default.name)
        self.config = config
        self.idle_timeout_s = config.idle_timeout_s
        self.quotas = Quotas(QuotaLimits(requests_per_user=config.max_pending_requests_per_user,
                                         requests_per_connection=config.max_pending_requests_per_connection,
                                         tokens_per_user=config.max_pending_tokens_per_user))
        self.registry: dict[str, Admission] = {}
        self.waiting_for_models = 0  # requests reserved against the limits, waiting for a model to load
        self.connections = OpenConnections(max_connections, config.max_connections_per_user)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmd-tokenize")
        self.large_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-tokenize-long")
        self.draining = False
        self._server: asyncio.base_events.Server | None = None

    async def run(self) -> None:
        # asyncio listens again on the socket it is given, with its own backlog of 100
        # unless told: 1,000 clients connecting at once would find the queue full.
        self._server = await asyncio.start_unix_server(self._on_connection, sock=self.sock, limit=1 << 16,
                                                       backlog=self.config.listen_backlog)
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
        refusal = self.connections.refusal(conn.uid)
        if refusal is not None:
            await conn.refuse(refusal)
            return
        self.connections.add(conn)
        await conn.serve(codec, held)

    async def admit(self, submit: Submit | Embed, uid: int, sink: RequestSink, *, strict_max_tokens: bool = True,
                    num_ctx: int | None = None, lease: Lease | None = None) -> Error | PreparedRequest:
        """Validate and tokenize `submit` (in the pool), then hand it to its model's
        detokenizer and scheduler with `sink` as its destination: the model `lease`
        pins, else the one `submit.model` names (loaded first if need be, the request
        waiting). An Error (naming the field and the limit) means nothing was started.
        A prompt plus max_tokens past max_model_len is refused (vLLM's rule), or with
        `strict_max_tokens=False` shortened to fit (Ollama's num_predict and llama.cpp's
        n_predict mean "at most"). `num_ctx`: Ollama's context length for this request
        (at most max_model_len). An Embed is admitted the same way: its prompt counts
        against the same limits and quotas, and it waits for its model the same way."""
        client_id = sink.client_id
        if isinstance(submit, Submit):
            if submit.tools and submit.messages is None:
                return Error(code="invalid_params", id=client_id,
                             message="tools needs messages (a chat) to describe them")
            if submit.cache_salt is not None and len(submit.cache_salt) > MAX_CACHE_SALT_CHARS:
                return Error(code="invalid_params", id=client_id,
                             message=f"cache_salt must have at most {MAX_CACHE_SALT_CHARS} characters")
        if self.draining:
            return Error(code="shutting_down", id=client_id, message="the daemon is shutting down")
        if len(self.registry) + self.waiting_for_models >= self.config.max_pending_requests:
            return Error(code="overloaded", id=client_id,
                         message=f"too many requests in flight (limit {self.config.max_pending_requests})")
        try:
            spec = self.models.resolve(submit.model) if lease is None else None
        except UnknownModel as exc:
            return Error(code="model_not_found", id=client_id, message=str(exc))
        refusal = self.quotas.reserve(uid, sink.connection)
        if refusal is not None:
            return Error(code="overloaded", id=client_id, message=refusal)
        owned = None
        try:
            if lease is None:
                self.waiting_for_models += 1
                try:
                    lease = owned = await self.models.acquire(spec, _keep_alive(submit))
                finally:
                    self.waiting_for_models -= 1
            result = await self._admit_on(lease, submit, uid, sink, strict_max_tokens, num_ctx)
        except ModelUnavailable as exc:
            result = Error(code=exc.code, id=client_id, message=str(exc))
        except BaseException:
            self.quotas.release(uid, sink.connection)
            raise
        finally:
            if owned is not None:
                owned.release()  # the request holds its own pin, till its last output
        if sink.release is None:  # not admitted: what it reserved goes back
            self.quotas.release(uid, sink.connection)
        return result

    async def _admit_on(self, lease: Lease, submit: Submit | Embed, uid: int, sink: RequestSink,
                        strict_max_tokens: bool, num_ctx: int | None) -> Error | PreparedRequest:
        client_id = sink.client_id
        model = lease.model
        if not lease.valid:  # its model failed since the lease was taken
            return _model_failed(model.name, client_id)
        processor: InputProcessor = model.input_processor
        chars = _prompt_chars(submit)
        truncating = isinstance(submit, Embed) and submit.truncate  # its text is cut before tokenizing
        if chars > processor.max_prompt_chars and not truncating:
            return Error(code="invalid_params", id=client_id,
                         message=f"prompt is too long: no prompt of {chars} characters fits max_model_len "
                                 f"({processor.max_model_len} tokens)")
        prepared = await self._prepare(processor, submit, uid, chars, strict_max_tokens, num_ctx)
        if isinstance(prepared, Error):
            return msgspec.structs.replace(prepared, id=client_id)
        if not lease.valid:  # its model failed while the prompt was tokenized
            return _model_failed(model.name, client_id)
        tokens = len(prepared.token_ids) * len(prepared.children)
        refusal = self.quotas.charge_tokens(uid, tokens) if sink.wanted else "gone"
        if refusal is not None:
            return prepared if refusal == "gone" else Error(code="overloaded", id=client_id, message=refusal)
        request_id = prepared.request_id
        sink.request_id = request_id
        sink.release = functools.partial(self._release, request_id, uid, sink.connection, tokens, lease.share())
        self.registry[request_id] = Admission(sink, uid, model)
        arrival = prepared.children[0].arrival_time
        self.metrics.send(RequestEvent(request_id, "queued", arrival, uid=uid, prompt_tokens=len(prepared.token_ids),
                                       model=model.name))
        # The detokenizer must know the request before any of its tokens can arrive.
        model.detokenizer.send(RegisterRequest(request_id, prepared.token_ids, prepared.params,
                                               prepared.child_ids, sink))
        model.scheduler.send(AddRequest(request_id, prepared.children))
        return prepared

    async def _prepare(self, processor: InputProcessor, submit: Submit | Embed, uid: int, chars: int,
                       strict_max_tokens: bool, num_ctx: int | None) -> PreparedRequest | Error:
        request_id = self._new_request_id()
        salt = self.cache_salt(uid, submit.cache_salt if isinstance(submit, Submit) else None)
        try:
            return await self.in_tokenizer_pool(chars, self.prepare, processor, request_id, submit, uid, salt,
                                                time.monotonic(), strict_max_tokens, num_ctx)
        except ValueError as exc:
            return Error(code="invalid_params", message=safe_message(exc))

    async def in_tokenizer_pool(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, tokenizer work on a text of `chars` characters, off the event loop.
        Long texts are tokenized on a pool of their own, so they never hold up short ones."""
        pool = self.large_pool if chars > LARGE_PROMPT_CHARS else self.pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def tokenize(self, processor: InputProcessor, prompt: str | list[ChatMessage], *,
                       add_special_tokens: bool, **template: Any) -> list[int]:
        """A text's or a chat's token ids, as a request's prompt would have them (in the
        model whose `processor` it is), with no request admitted (vLLM's /tokenize).
        Raises ValueError naming the field."""
        if isinstance(prompt, str):
            return await self.in_tokenizer_pool(len(prompt), functools.partial(
                processor.tokenize, prompt, add_special_tokens=add_special_tokens))
        return await self.in_tokenizer_pool(sum(len(m.content) for m in prompt), functools.partial(
            processor.render_chat, _template_messages(prompt), add_special_tokens=add_special_tokens, **template))

    def _new_request_id(self) -> str:
        """A server request id: random, so an id says nothing about other users' activity
        (sequential ids told how many requests the daemon had served, and when)."""
        while (request_id := f"r{secrets.token_hex(6)}") in self.registry:
            pass
        return request_id

    def _release(self, request_id: str, uid: int, connection: object | None, tokens: int, pin: Lease) -> None:
        self.registry.pop(request_id, None)
        self.quotas.release(uid, connection, tokens)
        pin.release()

    def abort(self, request_ids: list[str]) -> None:
        """Abort admitted requests, each at its model's scheduler."""
        by_model: dict[int, tuple[Any, list[str]]] = {}
        for request_id in request_ids:
            entry = self.registry.get(request_id)
            if entry is not None:
                by_model.setdefault(id(entry.model), (entry.model, []))[1].append(request_id)
        for model, ids in by_model.values():
            if model.scheduler is not None:
                model.scheduler.send(AbortRequest(ids))

    def fail_model_requests(self, model: Any, reason: str) -> None:
        """End every request of a model whose actors died (nothing else will): each
        gets its final output, with finish_reason "error" and the reason."""
        for request_id, entry in list(self.registry.items()):
            if entry.model is model:
                sink = entry.sink
                self.metrics.send(RequestEvent(request_id, "finished", time.monotonic(), finish_reason="error"))
                sink.finished()
                sink.send(Output(id=sink.client_id, finish_reason="error", error=f"model {model.name} failed: {reason}",
                                 usage=Usage(prompt_tokens=0, completion_tokens=0)))

    def must_wait(self, submit: Submit) -> bool:
        """The model `submit` names is known and does not serve now: admitting it waits
        for a load (or for room), so a connection admits it beside its other work."""
        try:
            return not self.models.serving_now(self.models.resolve(submit.model))
        except UnknownModel:
            return False

    async def load_model(self, requested: str | None, keep_alive: float | str | None) -> ModelsReply | Error:
        """Load a model and keep it for `keep_alive` (llmctl load); the reply says how it stands."""
        try:
            spec = self.models.resolve(requested)
            await self.models.load(spec, None if keep_alive is None else parse_duration(keep_alive))
        except UnknownModel as exc:
            return Error(code="model_not_found", message=str(exc))
        except ModelUnavailable as exc:
            return Error(code=exc.code, message=str(exc))
        return await self._model_reply(spec.name)

    async def unload_model(self, requested: str) -> ModelsReply | Error:
        """Unload a model once its requests are done (llmctl unload)."""
        try:
            spec = self.models.resolve(requested)
        except UnknownModel as exc:
            return Error(code="model_not_found", message=str(exc))
        await self.models.unload(spec)
        return await self._model_reply(spec.name)

    async def sleep_model(self, requested: str | None, level: int) -> ModelsReply | Error:
        """Put a model to sleep once its requests are done (llmctl sleep)."""
        try:
            spec = self.models.resolve(requested)
        except UnknownModel as exc:
            return Error(code="model_not_found", message=str(exc))
        await self.models.sleep(spec, level)
        return await self._model_reply(spec.name)

    async def wake_model(self, requested: str | None) -> ModelsReply | Error:
        """Wake a sleeping model, or load one that is not loaded (llmctl wake)."""
        return await self.load_model(requested, None)

    async def _model_reply(self, name: str) -> ModelsReply:
        reply = await self.query("models", 0, True)
        return ModelsReply([m for m in reply.models if m.name == name])

    def cache_salt(self, uid: int, requested: str | None) -> str | None:
        """The prefix-cache key's salt: per user unless the operator shares the cache, so
        one user's prompts are never a cache hit (a timing and `cached_tokens` oracle)
        for another."""
        if self.config.prefix_cache_scope == "shared":
            return requested
        return f"uid={uid}" if requested is None else f"uid={uid}/{requested}"

    def prepare(self, processor: InputProcessor, request_id: str, submit: Submit | Embed, uid: int,
                cache_salt: str | None, arrival: float, strict_max_tokens: bool = False,
                num_ctx: int | None = None) -> PreparedRequest:
        """Runs in the tokenizer pool."""
        if isinstance(submit, Embed):
            prompt = submit.prompt if submit.token_ids is None else submit.token_ids
            return processor.prepare_pooling(request_id, prompt, submit.pooling, truncate=submit.truncate,
                                             num_ctx=num_ctx, priority=submit.priority, cache_salt=cache_salt,
                                             arrival_time=arrival, owner=uid)
        if submit.messages is not None:
            tools = {"template_kwargs": {"tools": submit.tools}} if submit.tools else {}
            prompt: str | list[int] = processor.render_chat(_template_messages(submit.messages), **tools)
        elif submit.token_ids is not None:
            prompt = submit.token_ids
        else:
            prompt = submit.prompt
        return processor.prepare(request_id, prompt, submit.sampling, priority=submit.priority,
                                 cache_salt=cache_salt, arrival_time=arrival,
                                 strict_max_tokens=strict_max_tokens, num_ctx=num_ctx, owner=uid)

    async def query(self, kind: str, uid: int, admin: bool):
        reply = asyncio.get_running_loop().create_future()
        self.metrics.send(Query(kind, uid, admin, reply))
        return await reply

    def is_admin(self, uid: int, gid: int) -> bool:
        return is_admin(uid, gid, self.config.admin_group)

    def stop_accepting(self, close_listener: bool = True) -> None:
        """Drain: new requests are refused with `shutting_down`. With close_listener the
        socket stops accepting (under socket activation new clients then wait for the
        next start); otherwise new clients still connect and are told why."""
        self.draining = True
        if close_listener and self._server is not None:
            self._server.close()

    def live_request_ids(self) -> list[str]:
        return list(self.registry)

    async def flush_connections(self, timeout: float) -> None:
        """Write out every connection's buffered replies, within `timeout` for all."""
        await self.connections.flush(timeout)

    async def close_connections(self) -> None:
        await self.connections.close_all()


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (tool fields only where given: templates
    test for them with `is defined` as well as for truth)."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        for name in ("tool_calls", "tool_call_id", "name"):
            if getattr(m, name) is not None:
                message[name] = getattr(m, name)
        out.append(message)
    return out


def _keep_alive(submit: Submit | Embed) -> float | None:
    return None if submit.keep_alive is None else parse_duration(submit.keep_alive)


def _model_failed(name: str, client_id: str | None) -> Error:
    return Error(code="model_unavailable", id=client_id,
                 message=f"model {name} failed; send the request again to load it afresh")


def _prompt_chars(submit: Submit | Embed) -> int:
    if submit.prompt is not None:
        return len(submit.prompt)
    if isinstance(submit, Submit) and submit.messages is not None:
        return sum(len(m.content) + len(m.role) for m in submit.messages)
    return 0
