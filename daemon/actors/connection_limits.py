"""The daemon's open connections, counted against its limits (in all and per user) and
closed together at a stop: the protocol socket's (llmd.actors.connection.Connection)
and, counted only, the HTTP faces' (llmd.http.malformed.QuietRequestHandler)."""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Protocol

from llmd_client.protocol import Error

logger = logging.getLogger("llmd.intake")
CLOSE_TIMEOUT_S = 2.0  # a closing connection's last bytes: how long its peer has to take them


class Connection(Protocol):
    """What is counted of a protocol-socket connection (llmd.actors.connection.Connection)."""

    uid: int
    writer: asyncio.StreamWriter


class OpenConnections:
    """The connections being served, counted in all and per user against their limits
    (each holds a file descriptor; one user's flood of connections meets its own limit):
    the protocol socket's, and the HTTP faces' (`admit_http` / `release_http`; uid -1
    where the peer is not told at connect, a TCP one: the limit in all only)."""

    def __init__(self, max_connections: int, max_connections_per_user: int) -> None:
        self.max_connections = max_connections
        self.max_connections_per_user = max_connections_per_user
        self._open: set[Connection] = set()
        self._http = 0
        self._by_uid: collections.Counter[int] = collections.Counter()
        self._last_refusal_log = -math.inf

    def __len__(self) -> int:
        return len(self._open) + self._http

    def admit_http(self, uid: int) -> Error | None:
        """Count an HTTP connection (None: it may stay; `release_http(uid)` when it
        closes), or say why it cannot be served."""
        refusal = self.refusal(uid)
        if refusal is None:
            self._http += 1
            self._by_uid[uid] += 1
        return refusal

    def release_http(self, uid: int) -> None:
        self._http -= 1
        self._by_uid[uid] -= 1

    def refusal(self, uid: int) -> Error | None:
        """Why a new connection cannot be served (too many in all, or from its user), or None."""
        if len(self) >= self.max_connections:
            reason = f"too many connections (limit {self.max_connections})"
        elif uid >= 0 and self._by_uid[uid] >= self.max_connections_per_user:
            reason = f"too many connections from this user (limit {self.max_connections_per_user})"
        else:
            return None
        now = time.monotonic()
        if now - self._last_refusal_log >= 10.0:  # a storm of refusals logs one line per 10 s
            self._last_refusal_log = now
            logger.warning("refusing connections: %s (uid %d)", reason, uid)
        return Error(code="overloaded", message=reason)

    def add(self, conn: Connection) -> None:
        self._open.add(conn)
        self._by_uid[conn.uid] += 1

    def discard(self, conn: Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._by_uid[conn.uid] -= 1

    async def flush(self, timeout: float) -> None:
        """Write out what every connection still has buffered, under one deadline for all
        (so a stop stays within bounds); a peer that went away is not an error here."""
        flushes = [asyncio.ensure_future(conn.writer.drain()) for conn in list(self._open)]
        if not flushes:
            return
        done, pending = await asyncio.wait(flushes, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in done:
            task.exception()

    async def close_all(self) -> None:
        """Close every connection gracefully (what was written still goes out to a slow
        reader); one whose peer has not taken its last replies within CLOSE_TIMEOUT_S is
        cut off: a graceful close waits for the peer to read, and a client that sends and
        never reads would hold the connection's task, and the daemon's stop with it,
        forever. Returns once their tasks have ended (before the loop's teardown would
        cancel them)."""
        for conn in list(self._open):
            conn.writer.close()
        if not await self._until_closed(CLOSE_TIMEOUT_S):
            for conn in list(self._open):
                conn.writer.transport.abort()
            await self._until_closed(1.0)

    async def _until_closed(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while self._open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return not self._open
