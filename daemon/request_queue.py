"""Waiting queues: first come first served, or by priority (lower value first, then
earlier arrival). Preempted requests go back in at their old place."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from llmd.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        # A preempted request arrived before everything still waiting: put it in front.
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._removed: set[int] = set()
        self._counter = 0
        self._size = 0

    def add(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (*request.sort_key(), self._counter, request))
        self._size += 1

    add_preempted = add  # its key keeps it ahead of later arrivals of equal priority

    def _skip_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request:
        self._skip_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._skip_removed()
        self._size -= 1
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        if any(entry[3] is request for entry in self._heap) and id(request) not in self._removed:
            self._removed.add(id(request))
            self._size -= 1
        else:
            raise ValueError("request not in queue")

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if id(e[3]) not in self._removed)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling_policy {policy!r} (fcfs or priority)")
