"""Waiting queues: first come first served, or by priority (lower value first, then
earlier arrival), and in both fair between users: at equal priority, requests of
different owners take turns (round robin), so one user's thousand queued requests do
not make everyone else wait behind them. Preempted requests go back in at their old
place.

Fairness is a virtual clock (start-time fair queuing): each owner's next request gets
the round after that owner's previous one, but never a round before the clock, which
is the round of the last request taken. An owner who was away gets no credit for it;
with one owner the order is plain arrival order. Requests without an owner (the offline
engine) all share round 0: the queue is then exactly FCFS or priority order."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from llmd.core.request import Request


class WaitingQueue:
    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._heap: list[tuple[tuple, Request]] = []
        self._live: dict[int, tuple] = {}  # id(request) -> the key of its valid heap entry
        self._seq = itertools.count()
        self._clock = 0
        self._last_round: dict[object, int] = {}

    def _new_key(self, request: Request) -> tuple:
        owner = request.owner
        if owner is None:
            fair_round = 0
        else:
            fair_round = max(self._clock, self._last_round.get(owner, -1) + 1)
            self._last_round[owner] = fair_round
        order = (request.priority, fair_round, request.arrival_time) if self.by_priority else (fair_round,)
        return (*order, next(self._seq))

    def add(self, request: Request) -> None:
        self._push(request, self._new_key(request))

    def add_preempted(self, request: Request) -> None:
        """Back at its old place: ahead of everything that arrived after it was admitted."""
        self._push(request, request.queue_key or self._new_key(request))

    def _push(self, request: Request, key: tuple) -> None:
        request.queue_key = key
        self._live[id(request)] = key
        heapq.heappush(self._heap, (key, request))

    def _top(self) -> tuple[tuple, Request]:
        while self._live.get(id(self._heap[0][1])) != self._heap[0][0]:
            heapq.heappop(self._heap)  # an entry of a removed request
        return self._heap[0]

    def peek(self) -> Request:
        return self._top()[1]

    def pop(self) -> Request:
        key, request = self._top()
        heapq.heappop(self._heap)
        del self._live[id(request)]
        if request.owner is not None:
            self._clock = max(self._clock, key[1] if self.by_priority else key[0])
        return request

    def remove(self, request: Request) -> None:
        if self._live.pop(id(request), None) is None:
            raise ValueError("request not in queue")

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (r for key, r in sorted(self._heap, key=lambda e: e[0]) if self._live.get(id(r)) == key)


def make_queue(policy: str) -> WaitingQueue:
    if policy in ("fcfs", "priority"):
        return WaitingQueue(by_priority=policy == "priority")
    raise ValueError(f"unknown scheduling_policy {policy!r} (fcfs or priority)")
