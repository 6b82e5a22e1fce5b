"""What Client and AsyncClient share: the tables of one connection's requests and
pending control replies, and how each message from the daemon is routed through them.

The two differ only in how a message reaches a request's inbox (`_deliver`: a deque
read by the blocking client, an asyncio.Queue read by the coroutines) and in how a
pending control reply is resolved (`PendingReply.resolve`); both are left to them.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Generic, TypeVar

from llmd_client.errors import LlmdError
from llmd_client.protocol import Abort, Accepted, Error, MetricsReply, Output, StatusReply, Welcome

Inbox = TypeVar("Inbox")
Pending = TypeVar("Pending", bound="PendingReply")


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

    def _route(self, message: Any) -> None:
        match message:
            case Accepted(id=id) | Output(id=id) | Error(id=str() as id) if id in self._inboxes:
                self._deliver(self._inboxes[id], message)
            case Error(id=str() as id) if id in self._abort_errors:
                self._abort_errors[id] = message
            case Welcome() | StatusReply() | MetricsReply() | Error(id=None):
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
