"""The blocking Python client: one Unix-socket connection to llmd, many requests on it.

    from llmd_client import Client
    with Client() as llm:
        print(llm.generate("The capital of France is", max_tokens=8).text)
        for delta in llm.stream("Once upon a time", max_tokens=64):
            print(delta.text, end="", flush=True)

A Client is meant for one thread (several of its streams may be interleaved there);
use AsyncClient, or one Client per thread, for concurrency.
"""
from __future__ import annotations

import errno
import socket as socketlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from llmd_client.async_client import AsyncClient, AsyncStream
from llmd_client.errors import ClientTimeout, ConnectionLost, LlmdError, ProtocolError, RequestError
from llmd_client.framing import FrameError, MsgpackCodec
from llmd_client.protocol import (Abort, Accepted, ChatMessage, Error, Hello, Metrics, MetricsReply, Output,
                                  SamplingParams, ServerMessage, Status, StatusReply, Submit, Welcome)
from llmd_client.results import Delta, Result, ResultBuilder, build_submit, delta_from, is_last, sampling_params
from llmd_client.routing import PendingReply, Router
from llmd_client.socket_path import connect_error, default_socket_path

__all__ = ["AsyncClient", "AsyncStream", "Client", "Stream", "default_socket_path"]

CLIENT_NAME = "llmd_client"
BUSY_RETRY_S = 2.0  # how long a full listen queue is retried before "busy"
_RECV_BYTES = 1 << 16


def hello_error(error: Error) -> LlmdError:
    if error.code == "unsupported_version":
        return ProtocolError(error.message, error.code)
    return RequestError(error.code, error.message)


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
            reply = self._control(Hello(client=CLIENT_NAME), Welcome, error=hello_error)
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

    def generate(self, prompt: str | None = None, *, messages: Iterable[ChatMessage | Mapping[str, Any]] | None = None,
                 token_ids: Iterable[int] | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop: str | list[str] | None = None, n: int | None = None,
                 logprobs: int | None = None, priority: int = 0, sampling: SamplingParams | None = None,
                 **sampling_kwargs: Any) -> Result:
        """Run one request to the end. Exactly one of prompt, messages or token_ids.
        Sampling settings not given (None) come from `sampling`, else SamplingParams'
        defaults; `sampling_kwargs` takes any other SamplingParams field (min_p, ...).
        Raises ValueError for a setting out of range (before sending anything) and
        RequestError when the daemon refuses or fails the request."""
        params = sampling_params(sampling, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=stop, n=n, logprobs=logprobs, **sampling_kwargs))
        submit = build_submit(self._new_id(), prompt, messages, token_ids, params, False, priority)
        accepted = self._submit(submit)
        builder = ResultBuilder(accepted, params.n)
        try:
            while True:
                output = self._next_output(submit.id)
                builder.add(output)
                if is_last(output):
                    return builder.result()
        except BaseException:
            self._abandon(submit.id)
            raise

    def stream(self, prompt: str | None = None, *, messages: Iterable[ChatMessage | Mapping[str, Any]] | None = None,
               token_ids: Iterable[int] | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               seed: int | None = None, stop: str | list[str] | None = None, n: int | None = None,
               logprobs: int | None = None, priority: int = 0, sampling: SamplingParams | None = None,
               **sampling_kwargs: Any) -> Stream:
        """Submit a request and return an iterator of its Deltas (arguments as for
        generate). Returns once the daemon accepted it (`.request_id` is set); leaving
        the iteration early (break, close(), an exception, Ctrl-C) aborts the request."""
        params = sampling_params(sampling, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=stop, n=n, logprobs=logprobs, **sampling_kwargs))
        submit = build_submit(self._new_id(), prompt, messages, token_ids, params, True, priority)
        return Stream(self, submit.id, self._submit(submit))

    def chat(self, messages: Iterable[ChatMessage | Mapping[str, Any]], **kwargs: Any) -> Result:
        """generate() for a conversation: [{"role": "user", "content": "..."}, ...]."""
        return self.generate(messages=messages, **kwargs)

    def abort(self, request_id: str) -> None:
        """Abort a request by its server id (Result.request_id, Stream.request_id, or
        one listed by status()). Raises RequestError "unknown_id" when there is no such
        request, "forbidden" when another user owns it."""
        self.connect()
        local_id = self._local_ids.get(request_id)
        if local_id is not None:  # ours: its stream sees finish_reason "abort"
            self._send(Abort(id=local_id))
            return
        # The daemon acknowledges only a failed Abort, so a Status round trip after it
        # tells "no error" from "error not here yet".
        self._abort_errors[request_id] = None
        try:
            self._send(Abort(id=request_id))
            self._control(Status(), StatusReply)
            error = self._abort_errors[request_id]
        finally:
            del self._abort_errors[request_id]
        if error is not None:
            raise RequestError(error.code, error.message, request_id)

    def status(self) -> StatusReply:
        self.connect()
        return self._control(Status(), StatusReply)

    def metrics(self) -> str:
        """The daemon's metrics in Prometheus text format."""
        self.connect()
        return self._control(Metrics(), MetricsReply).text

    # -- internals ----------------------------------------------------------------------

    def _submit(self, submit: Submit) -> Accepted:
        self.connect()
        assert submit.id is not None
        self._inboxes[submit.id] = deque()
        try:
            self._send(submit)
            reply = self._next_message(submit.id)
        except BaseException:
            self._abandon(submit.id)
            raise
        if isinstance(reply, Accepted):
            self._local_ids[reply.request_id] = submit.id
            return reply
        self._forget(submit.id)
        if isinstance(reply, Error):
            raise RequestError(reply.code, reply.message, submit.id)
        raise ProtocolError(f"expected Accepted for request {submit.id}, got {type(reply).__name__}")

    def _next_output(self, id: str) -> Output:
        """The request's next Output; raises RequestError for an Error about it."""
        message = self._next_message(id)
        if isinstance(message, Output):
            if is_last(message):
                self._forget(id)
            return message
        self._forget(id)
        if isinstance(message, Error):
            raise RequestError(message.code, message.message, id)
        raise ProtocolError(f"unexpected {type(message).__name__} for request {id}")

    def _next_message(self, id: str) -> Accepted | Output | Error:
        while True:
            inbox = self._inboxes.get(id)
            if inbox is None:
                raise ConnectionLost(f"the connection to llmd at {self.socket_path} was lost")
            if inbox:
                return inbox.popleft()
            self._receive()

    def _control(self, message: Hello | Status | Metrics, expect: type, error: Any = None) -> Any:
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
            raise (error or (lambda e: RequestError(e.code, e.message)))(reply)
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


class Stream:
    """Iterator of one request's Deltas. Leaving it early aborts the request; it is
    also a context manager that does so on exit."""

    def __init__(self, client: Client, id: str, accepted: Accepted) -> None:
        self.request_id = accepted.request_id
        self.prompt_tokens = accepted.prompt_tokens
        self._client = client
        self._id = id
        self._done = False

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
        if is_last(output):
            self._done = True
        return delta_from(output)

    def close(self) -> None:
        """Abort the request if it is still running."""
        if not self._done:
            self._done = True
            self._client._abandon(self._id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
