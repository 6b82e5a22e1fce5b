"""What Client and AsyncClient share: the tables of one connection's requests and
pending control replies, how each message from the daemon is routed through them, and
what each reply means (an Accepted recorded, an Error raised as the client's exception).

The two differ only in how a message reaches a request's inbox (`_deliver`: a deque
read by the blocking client, an asyncio.Queue read by the coroutines), in how a
pending control reply is resolved (`PendingReply.resolve`), and in how they wait; all
of that is left to them.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from llmd_client.errors import LlmdError, ProtocolError, RequestError
from llmd_client.protocol import (MAX_ID_CHARS, Abort, Accepted, Error, MetricsReply, ModelsReply, Output, StatusReply,
                                  Welcome)
from llmd_client.results import is_last

Inbox = TypeVar("Inbox")
Pending = TypeVar("Pending", bound="PendingReply")


def reply_error(error: Error) -> LlmdError:
    """The exception for an Error that answers a control message (no request id): a
    refused protocol version is the client's ProtocolError, anything else a RequestError."""
    if error.code == "unsupported_version":
        return ProtocolError(error.message, error.code)
    return RequestError(error.code, error.message)


class PendingReply:
    """A control message (Hello, Status, Metrics) waiting for its reply; replies are
    matched by type, oldest first, and an Error without an id goes to the oldest."""

    __slots__ = ("expect",)

    def __init__(self, expect: type) -> None:
        self.expect = expect

    def resolve(self, reply: Any) -> None:
        """Hand over the reply (or the Error) matched to this entry, now off the queue."""
        raise NotImplementedError


class Router(Generic[Inbox, Pending]):
    """The routing state of one connection. `_inboxes`: local request id -> the inbox
    of a request being followed; `_local_ids`: server request id -> local id, for our
    own requests; `_pending`: control replies awaited, oldest first; `_abort_errors`:
    server id -> the Error of an Abort of another client's request (None until one)."""

    def __init__(self) -> None:
        self._inboxes: dict[str, Inbox] = {}
        self._local_ids: dict[str, str] = {}
        self._pending: deque[Pending] = deque()
        self._abort_errors: dict[str, Error | None] = {}
        self._ids = itertools.count(1)

    def _deliver(self, inbox: Inbox, message: Accepted | Output | Error) -> None:
        """Put a message about a request (or an Error about the connection) in its inbox."""
        raise NotImplementedError

    def _send(self, message: Any) -> None:
        raise NotImplementedError

    def _new_id(self) -> str:
        return f"c{next(self._ids)}"

    def _forget(self, id: str) -> None:
        self._inboxes.pop(id, None)
        for request_id, local_id in list(self._local_ids.items()):
            if local_id == id:
                del self._local_ids[request_id]

    def _abandon(self, id: str) -> None:
        """Stop following a request and abort it, unless it already ended (ids are never
        reused, and closing forgets every request, so a stale id is simply unknown).
        Synchronous (the async client's write is buffered), so it may run from __del__
        and from cancellation."""
        if id not in self._inboxes:
            return
        self._forget(id)
        try:
            self._send(Abort(id=id))
        except LlmdError:
            pass

    @contextmanager
    def _abandoned_on_error(self, id: str) -> Iterator[None]:
        """While following request `id`: any exception (a lost connection, a timeout,
        cancellation, Ctrl-C) stops following it and aborts it before it propagates."""
        try:
            yield
        except BaseException:
            self._abandon(id)
            raise

    def _accepted(self, id: str, reply: Accepted | Output | Error) -> Accepted:
        """The first reply to Submit `id`: Accepted is recorded (its server id now maps to
        `id`) and returned; an Error is raised as RequestError, anything else ProtocolError."""
        if isinstance(reply, Accepted):
            self._local_ids[reply.request_id] = id
            return reply
        self._forget(id)
        if isinstance(reply, Error):
            raise RequestError(reply.code, reply.message, id)
        raise ProtocolError(f"expected Accepted for request {id}, got {type(reply).__name__}")

    def _output(self, id: str, message: Accepted | Output | Error) -> Output:
        """A later message about request `id`: an Output is returned (after the last one
        the request is forgotten); an Error is raised as RequestError, anything else
        ProtocolError."""
        if isinstance(message, Output):
            if is_last(message):
                self._forget(id)
            return message
        self._forget(id)
        if isinstance(message, Error):
            raise RequestError(message.code, message.message, id)
        raise ProtocolError(f"unexpected {type(message).__name__} for request {id}")

    def _abort_own(self, request_id: str) -> bool:
        """Abort a request of this connection by its server id (its stream sees
        finish_reason "abort"); False, sending nothing, when it is not one of ours."""
        local_id = self._local_ids.get(request_id)
        if local_id is None:
            return False
        self._send(Abort(id=local_id))
        return True

    @contextmanager
    def _abort_other(self, request_id: str) -> Iterator[None]:
        """Abort another connection's request by its server id. The daemon answers only
        a failed Abort, so the caller makes a Status round trip inside the block: an Error
        not routed by then never comes. Raises RequestError "unknown_id" (no such request,
        or another user's). An id longer than any request's is refused here: the daemon's
        answer would name it cut short, and never reach this caller."""
        if len(request_id) > MAX_ID_CHARS:
            raise RequestError("unknown_id", f"no request id has more than {MAX_ID_CHARS} characters",
                               request_id[:MAX_ID_CHARS])
        self._abort_errors[request_id] = None
        try:
            self._send(Abort(id=request_id))
            yield
            error = self._abort_errors[request_id]
        finally:
            del self._abort_errors[request_id]
        if error is not None:
            raise RequestError(error.code, error.message, request_id)

    def _route(self, message: Any) -> None:
        match message:
            case Accepted(id=id) | Output(id=id) | Error(id=str() as id) if id in self._inboxes:
                self._deliver(self._inboxes[id], message)
            case Error(id=str() as id) if id in self._abort_errors:
                self._abort_errors[id] = message
            case Welcome() | StatusReply() | MetricsReply() | ModelsReply() | Error(id=None):
                self._route_reply(message)
            case _:
                pass  # a late message about a request this client stopped following

    def _route_reply(self, reply: Any) -> None:
        for pending in self._pending:
            if isinstance(reply, pending.expect) or isinstance(reply, Error):
                self._pending.remove(pending)
                pending.resolve(reply)
                return
        if isinstance(reply, Error):  # about the connection itself: every request fails with it
            for inbox in self._inboxes.values():
                self._deliver(inbox, reply)
