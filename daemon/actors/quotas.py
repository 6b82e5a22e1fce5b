"""Per-user and per-connection limits on requests in flight and their tokens, so one
user pipelining thousands of requests meets their own limit while others are still
served; the daemon-wide limit (max_pending_requests) stands behind them."""
from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class QuotaLimits:
    requests_per_user: int = 1024
    requests_per_connection: int = 512
    tokens_per_user: int = 1 << 20  # prompt tokens (times samples) of one user's requests in flight


class Quotas:
    def __init__(self, limits: QuotaLimits) -> None:
        self.limits = limits
        self.requests_by_user: collections.Counter[int] = collections.Counter()
        self.tokens_by_user: collections.Counter[int] = collections.Counter()
        self.requests_by_connection: collections.Counter[object] = collections.Counter()

    def reserve(self, uid: int, connection: object | None) -> str | None:
        """Count one more request for `uid` (and its connection), or say which limit it
        would pass (nothing is counted then)."""
        limits = self.limits
        if self.requests_by_user[uid] >= limits.requests_per_user:
            return f"too many requests in flight from this user (limit {limits.requests_per_user})"
        if connection is not None and self.requests_by_connection[connection] >= limits.requests_per_connection:
            return f"too many requests in flight on this connection (limit {limits.requests_per_connection})"
        self.requests_by_user[uid] += 1
        if connection is not None:
            self.requests_by_connection[connection] += 1
        return None

    def charge_tokens(self, uid: int, tokens: int) -> str | None:
        """Add a reserved request's tokens, or say that they pass the user's limit."""
        if self.tokens_by_user[uid] + tokens > self.limits.tokens_per_user:
            return (f"too many prompt tokens in flight from this user (limit {self.limits.tokens_per_user}; "
                    f"this request has {tokens})")
        self.tokens_by_user[uid] += tokens
        return None

    def release(self, uid: int, connection: object | None, tokens: int = 0) -> None:
        _decrement(self.requests_by_user, uid)
        if connection is not None:
            _decrement(self.requests_by_connection, connection)
        if tokens:
            _decrement(self.tokens_by_user, uid, tokens)


def _decrement(counter: collections.Counter, key: object, amount: int = 1) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]  # idle users and closed connections leave nothing behind
