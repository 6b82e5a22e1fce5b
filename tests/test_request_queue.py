"""The waiting queue takes turns between owners at equal priority, keeps arrival order
for one owner (and exactly FCFS / priority order without owners), and puts a preempted
request back at its old place."""
from __future__ import annotations

import pytest

from llmd.core.request import Request
from llmd.core.request_queue import make_queue
from llmd_client.protocol import SamplingParams


def req(name: str, owner=None, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(), priority=priority, arrival_time=arrival, max_tokens=4,
                   owner=owner)


def drain(queue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop().request_id)
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_owners_take_turns(policy):
    q = make_queue(policy)
    for i in range(5):
        q.add(req(f"a{i}", owner="alice", arrival=i))
    for i in range(2):
        q.add(req(f"b{i}", owner="bob", arrival=10 + i))
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


def test_a_late_owner_gets_no_credit_for_being_away():
    q = make_queue("fcfs")
    for i in range(4):
        q.add(req(f"a{i}", owner="alice"))
    assert [q.pop().request_id for _ in range(3)] == ["a0", "a1", "a2"]
    for i in range(3):
        q.add(req(f"b{i}", owner="bob"))
    # Bob starts level with the clock (his first request takes the current round), then
    # one turn each: not three in a row for having been away.
    assert drain(q) == ["b0", "a3", "b1", "b2"]


def test_without_owners_it_is_plain_fcfs_and_priority():
    q = make_queue("fcfs")
    for name in "abcd":
        q.add(req(name))
    assert drain(q) == list("abcd")
    q = make_queue("priority")
    q.add(req("late-urgent", priority=-1, arrival=5))
    q.add(req("early", arrival=1))
    q.add(req("earlier", arrival=0))
    assert drain(q) == ["late-urgent", "earlier", "early"]


def test_priority_beats_fairness():
    q = make_queue("priority")
    for i in range(3):
        q.add(req(f"a{i}", owner="alice", priority=0, arrival=i))
    q.add(req("b-low", owner="bob", priority=5, arrival=0))
    assert drain(q) == ["a0", "a1", "a2", "b-low"]


def test_preempted_request_returns_to_its_place_and_remove_works():
    q = make_queue("fcfs")
    first, second, third = req("a0", "alice"), req("b0", "bob"), req("a1", "alice")
    for r in (first, second, third):
        q.add(r)
    running = q.pop()
    assert running is first
    q.add(req("b1", "bob"))
    q.add_preempted(running)
    q.remove(third)
    with pytest.raises(ValueError):
        q.remove(third)
    assert len(q) == 3 and [r.request_id for r in q] == ["a0", "b0", "b1"]
    assert drain(q) == ["a0", "b0", "b1"]
