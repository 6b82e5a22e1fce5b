"""The blocking Python client: one Unix-socket connection to llmd, many requests on it.

    from llmd_client import Client
    with Client() as llm:
        print(llm.generate("The capital of France is", max_tokens=8).text)
        for delta in llm.stream("Once upon a time", max_tokens=64):
            print(delta.text, end="", flush=True)
        vectors = [e.embedding for e in llm.embed(["first text", "second text"])]

A Client is meant for one thread (several of its streams may be interleaved there);
use AsyncClient, or one Client per thread, for concurrency.
"""
from __future__ import annotations

import errno
import socket as socketlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Unpack, overload

from llmd_client.async_client import AsyncClient, AsyncStream
from llmd_client.errors import ClientTimeout, ConnectionLost, ProtocolError
from llmd_client.framing import FrameError, MsgpackCodec
from llmd_client.protocol import (Accepted, ChatMessage, Error, Hello, Load, Metrics, MetricsReply, Models,
                                  ModelsReply, ModelStatus, Output, ServerMessage, Sleep, Status, StatusReply, Submit,
                                  Unload, Wake, Welcome)
from llmd_client.request_args import EmbedInput, RequestArgs, build_embeds, build_submit
from llmd_client.results import Delta, Embedding, Result, ResultBuilder, embedding_from
from llmd_client.routing import PendingReply, Router, reply_error
from llmd_client.socket_path import connect_error, default_socket_path
from llmd_client.streaming import RequestStream

__all__ = ["AsyncClient", "AsyncStream", "Client", "Stream", "default_socket_path"]

CLIENT_NAME = "llmd_client"
BUSY_RETRY_S = 2.0  # how long a full listen queue is retried before "busy"
_RECV_BYTES = 1 << 16


class _PendingReply(PendingReply):
    """Filled in by the routing as the blocking client reads; a reply that comes after
    its caller gave up waiting (wanted False) is dropped."""

    __slots__ = ("reply", "wanted")

    def __init__(self, expect: type) -> None:
        super().__init__(expect)
        self.reply: Any = None
        self.wanted = True

    def resolve(self, reply: Any) -> None:
        if self.wanted:
            self.reply = reply


class Client(Router[deque[Accepted | Output | Error], _PendingReply]):
    """Blocking client. `socket`: the daemon's socket (default: see default_socket_path);
    `timeout`: seconds to wait for connecting and for each message from the daemon
    (None: wait forever); on a timeout the request is aborted and ClientTimeout raised.
    Connects on first use, and again after the connection was lost."""

    def __init__(self, socket: str | None = None, timeout: float | None = None) -> None:
        super().__init__()
        self.socket_path = default_socket_path(socket)
        self.timeout = timeout
        self.welcome: Welcome | None = None
        self._sock: socketlib.socket | None = None
        self._codec = MsgpackCodec(ServerMessage)

    # -- connection ---------------------------------------------------------------------

    def connect(self) -> Welcome:
        """Connect (if not connected) and return the daemon's Welcome."""
        if self._sock is not None and self.welcome is not None:
            return self.welcome
        sock = self._connected_socket()
        self._sock = sock
        self._codec = MsgpackCodec(ServerMessage)
        try:
            reply = self._control(Hello(client=CLIENT_NAME), Welcome)
        except BaseException:
            self.close()
            raise
        self.welcome = reply
        return reply

    def _connected_socket(self) -> socketlib.socket:
        """A socket connected to the daemon. A full listen queue (EAGAIN, thousands of
        clients connecting at once) is retried for up to BUSY_RETRY_S before it is an error."""
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.socket_path)
                return sock
            except TimeoutError:
                sock.close()
                raise ClientTimeout(f"timed out connecting to {self.socket_path}") from None
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EAGAIN or time.monotonic() >= deadline:
                    raise connect_error(self.socket_path, exc) from None
            time.sleep(0.02)

    def close(self) -> None:
        """Close the connection; the daemon aborts every request still running on it."""
        sock, self._sock = self._sock, None
        self.welcome = None
        self._inboxes.clear()
        self._local_ids.clear()
        self._pending.clear()
        if sock is not None:
            sock.close()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- requests -----------------------------------------------------------------------

    def generate(self, prompt: str | None = None, **args: Unpack[RequestArgs]) -> Result:
        """Run one request to the end. Exactly one of prompt, messages or token_ids;
        the other keyword arguments are RequestArgs' (max_tokens, temperature, ...,
        sampling, and any other SamplingParams field). Raises ValueError for a setting
        out of range (before sending anything) and RequestError when the daemon refuses
        or fails the request."""
        submit = build_submit(self._new_id(), prompt, args, stream=False)
        accepted = self._submit(submit)
        builder = ResultBuilder(accepted, submit.sampling.n)
        with self._abandoned_on_error(accepted.id):
            while not builder.done:
                builder.add(self._next_output(accepted.id))
        return builder.result()

    def stream(self, prompt: str | None = None, **args: Unpack[RequestArgs]) -> Stream:
        """Submit a request and return an iterator of its Deltas (arguments as for
        generate). Returns once the daemon accepted it (`.request_id` is set); leaving
        the iteration early (break, close(), an exception, Ctrl-C) aborts the request."""
        submit = build_submit(self._new_id(), prompt, args, stream=True)
        return Stream(self, self._submit(submit))

    def chat(self, messages: Iterable[ChatMessage | Mapping[str, Any]], **kwargs: Any) -> Result:
        """generate() for a conversation: [{"role": "user", "content": "..."}, ...]."""
        return self.generate(messages=messages, **kwargs)

    @overload
    def embed(self, input: str | Sequence[int], *, normalize: bool = True, dimensions: int | None = None,
              truncate: bool = False, priority: int = 0,
              model: str | None = None, keep_alive: float | str | None = None) -> Embedding: ...

    @overload
    def embed(self, input: Sequence[str | Sequence[int]], *, normalize: bool = True, dimensions: int | None = None,
              truncate: bool = False, priority: int = 0,
              model: str | None = None, keep_alive: float | str | None = None) -> list[Embedding]: ...

    def embed(self, input: EmbedInput, *, normalize: bool = True, dimensions: int | None = None,
              truncate: bool = False, priority: int = 0,
              model: str | None = None, keep_alive: float | str | None = None) -> Embedding | list[Embedding]:
        """The model's pooled final hidden states for `input`: one text (or one list of
        token ids) gives one Embedding, a list of them a list, in order (sent together,
        batched by the daemon). `normalize`: unit vectors (default); `dimensions`: the
        first N components, for Matryoshka models; `truncate`: an input longer than the
        context keeps its first tokens that fit instead of being refused; `model`: which
        model embeds (None: the default), `keep_alive`: how long it stays loaded after. Raises
        RequestError when the daemon refuses or fails an input (the others are aborted)."""
        embeds, single = build_embeds(self._new_id, input, normalize=normalize, dimensions=dimensions,
                                      truncate=truncate, priority=priority, model=model, keep_alive=keep_alive)
        self.connect()
        try:
            for embed in embeds:
                self._inboxes[embed.id] = deque()
                self._send(embed)
            results = [embedding_from(self._accepted(e.id, self._next_message(e.id)), self._next_output(e.id))
                       for e in embeds]
        except BaseException:
            for embed in embeds:
                self._abandon(embed.id)
            raise
        return results[0] if single else results

    def abort(self, request_id: str) -> None:
        """Abort a request by its server id (Result.request_id, Stream.request_id, or
        one listed by status()). Raises RequestError "unknown_id" when there is no such
        request, "forbidden" when another user owns it."""
        self.connect()
        if not self._abort_own(request_id):
            with self._abort_other(request_id):
                self._control(Status(), StatusReply)

    def status(self) -> StatusReply:
        self.connect()
        return self._control(Status(), StatusReply)

    def metrics(self) -> str:
        """The daemon's metrics in Prometheus text format."""
        self.connect()
        return self._control(Metrics(), MetricsReply).text

    def models(self) -> list[ModelStatus]:
        """Every model the daemon can serve: loaded or not, memory, expiry (`llmctl ps`)."""
        self.connect()
        return self._control(Models(), ModelsReply).models

    def load(self, model: str | None = None, keep_alive: float | str | None = None) -> ModelStatus:
        """Load a model (None: the default) and keep it `keep_alive` (seconds or "5m";
        None: its own); returns once it serves. Raises RequestError "model_not_found"
        or "model_unavailable" (its load failed, or it cannot fit)."""
        self.connect()
        return self._control(Load(model=model, keep_alive=keep_alive), ModelsReply).models[0]

    def unload(self, model: str) -> ModelStatus:
        """Unload a model once its requests are done; returns once it is unloaded."""
        self.connect()
        return self._control(Unload(model=model), ModelsReply).models[0]

    def sleep(self, model: str | None = None, level: int = 1) -> ModelStatus:
        """Put a model (None: the default) to sleep once its requests are done: its KV
        cache freed, its weights kept in host memory (level 1) or dropped (level 2);
        returns once it is asleep (a model not loaded is left as it is). Its next request,
        or `wake`, wakes it."""
        self.connect()
        return self._control(Sleep(model=model, level=level), ModelsReply).models[0]

    def wake(self, model: str | None = None) -> ModelStatus:
        """Wake a sleeping model (one not loaded is loaded); returns once it serves."""
        self.connect()
        return self._control(Wake(model=model), ModelsReply).models[0]

    # -- internals ----------------------------------------------------------------------

    def _submit(self, submit: Submit) -> Accepted:
        self.connect()
        assert submit.id is not None
        self._inboxes[submit.id] = deque()
        with self._abandoned_on_error(submit.id):
            self._send(submit)
            reply = self._next_message(submit.id)
        return self._accepted(submit.id, reply)

    def _next_output(self, id: str) -> Output:
        """The request's next Output; raises RequestError for an Error about it."""
        return self._output(id, self._next_message(id))

    def _next_message(self, id: str) -> Accepted | Output | Error:
        while True:
            inbox = self._inboxes.get(id)
            if inbox is None:
                raise ConnectionLost(f"the connection to llmd at {self.socket_path} was lost")
            if inbox:
                return inbox.popleft()
            self._receive()

    def _control(self, message: Hello | Status | Metrics | Models | Load | Unload | Sleep | Wake, expect: type) -> Any:
        pending = _PendingReply(expect)
        self._pending.append(pending)
        try:
            self._send(message)
            while pending.reply is None:
                self._receive()
        except BaseException:
            pending.wanted = False  # its reply, when it comes, is dropped
            raise
        reply = pending.reply
        if isinstance(reply, Error):
            raise reply_error(reply)
        return reply

    def _send(self, message: Any) -> None:
        if self._sock is None:
            raise ConnectionLost(f"not connected to llmd at {self.socket_path}")
        try:
            self._sock.sendall(self._codec.encode(message))
        except OSError as exc:  # a timed-out sendall may have sent part of a frame
            self.close()
            raise ConnectionLost(f"lost the connection to llmd at {self.socket_path}: {exc}") from None
        except BaseException:  # Ctrl-C in the middle of a frame: the stream is unusable
            self.close()
            raise

    def _receive(self) -> None:
        """Read what the socket has and route every complete message."""
        if self._sock is None:
            raise ConnectionLost(f"not connected to llmd at {self.socket_path}")
        try:
            data = self._sock.recv(_RECV_BYTES)
        except TimeoutError:
            raise ClientTimeout(f"no reply from llmd within {self.timeout} s") from None
        except OSError as exc:
            self.close()
            raise ConnectionLost(f"lost the connection to llmd at {self.socket_path}: {exc}") from None
        if not data:
            self.close()
            raise ConnectionLost(f"llmd closed the connection ({self.socket_path})")
        try:
            messages = [self._codec.decode(body) for body in self._codec.feed(data)]
        except (FrameError, ValueError) as exc:  # msgspec.DecodeError is a ValueError
            self.close()
            raise ProtocolError(f"llmd sent a frame this client cannot read: {exc}") from None
        for message in messages:
            self._route(message)

    def _deliver(self, inbox: deque[Accepted | Output | Error], message: Accepted | Output | Error) -> None:
        inbox.append(message)


class Stream(RequestStream):
    """Iterator of one request's Deltas. Leaving it early aborts the request; it is
    also a context manager that does so on exit."""

    _client: Client

    def __init__(self, client: Client, accepted: Accepted) -> None:
        super().__init__(client, accepted.id)
        self._accept(accepted)

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        if self._done:
            raise StopIteration
        try:
            output = self._client._next_output(self._id)
        except BaseException:
            self.close()
            raise
        return self._delta(output)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
