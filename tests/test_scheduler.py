"""The scheduler, stepped against a fake model runner. No torch, no model.

The fake runner keeps its own copy of every request the way the real one does: new
requests arrive once with their tokens, scheduled-again ones as block-id deltas, and
`finished_req_ids` are forgotten. It also keeps a fake paged KV cache: each step writes
the scheduled tokens into their slots through the block table, then every scheduled row
reads its whole context back through the block table (writes first, as each layer of
the real model does). A wrong block table, a bad prefix-cache hit, a gap in chunked
prefill or a lost token reads back the wrong context and fails on the spot.

A sampled token is a function of the context read back, so every request's expected
output comes from a direct decode loop written from the stop rules (`reference_decode`),
with no scheduler involved. The harness also follows the scheduler's state only from
the messages it sends (who was admitted, who the worker was told to forget) and checks
that view against the policy after every step.
"""
from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest

from llmd.config import EngineConfig
from llmd.core.kv_cache_manager import KVCacheManager
from llmd.core.step_messages import NewRequestData, RunnerOutput, SchedulerOutput
from llmd.core.request import Request, RequestStatus
from llmd.core.scheduler import Scheduler
from llmd_client.protocol import SamplingParams

BS = 4  # small blocks: a few tokens cross a block boundary
VOCAB = 1000

# sample(req_id, context, num_prompt_tokens) -> the next token
Sampler = Callable[[str, list[int], int], int]


def hash_sample(req_id: str, context: list[int], num_prompt_tokens: int) -> int:
    # Tuples of ints hash the same in every run (PYTHONHASHSEED only salts str/bytes).
    return hash(tuple(context)) % VOCAB


def scripted_sample(scripts: dict[str, list[int]]) -> Sampler:
    def sample(req_id: str, context: list[int], num_prompt_tokens: int) -> int:
        return scripts[req_id][len(context) - num_prompt_tokens]
    return sample


def reference_decode(req_id: str, prompt: list[int], params: SamplingParams, eos: int | None,
                     max_tokens: int, sample: Sampler) -> tuple[list[int], str, int | None]:
    """Output tokens, finish reason and stop reason of one request decoded on its own."""
    context, out = list(prompt), []
    while True:
        token = sample(req_id, context, len(prompt))
        context.append(token)
        out.append(token)
        if len(out) >= params.min_tokens:
            if token == eos and not params.ignore_eos:
                return out, "stop", None
            if token in params.stop_token_ids:
                return out, "stop", token
        if len(out) >= max_tokens:
            return out, "length", None


def roundtrip(message, cls):
    """Through the wire format, as a multi-process executor would: no shared lists."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=cls)


# -- the fake worker ------------------------------------------------------------------
@dataclass
class WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    def __init__(self, num_blocks: int, sample: Sampler) -> None:
        self.sample = sample
        self.kv_slots: list[int | None] = [None] * (num_blocks * BS)
        self.requests: dict[str, WorkerRequest] = {}
        # Every (num_computed_tokens, num_scheduled) a request was run with, in order.
        self.chunks: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def _slot(self, req: WorkerRequest, pos: int) -> int:
        return req.block_ids[pos // BS] * BS + pos % BS

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent as new while the worker holds it"
            self.requests[new.req_id] = WorkerRequest(
                new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                list(new.block_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            assert req_id in self.requests, f"{req_id} scheduled as cached but never sent"
            req = self.requests[req_id]
            assert num_computed == req.num_computed_tokens, \
                f"{req_id}: scheduler says {num_computed} computed, worker computed {req.num_computed_tokens}"
            req.block_ids.extend(new_blocks)
        new_ids = [new.req_id for new in so.scheduled_new_reqs]
        assert len(set(new_ids)) == len(new_ids) and not set(new_ids) & set(cached.req_ids)
        assert set(so.num_scheduled_tokens) == set(new_ids) | set(cached.req_ids)

        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            s = req.num_computed_tokens
            assert n >= 1 and s + n <= len(req.token_ids), \
                f"{req_id}: {n} tokens from {s} of {len(req.token_ids)}"
            assert len(req.block_ids) == -(-(s + n) // BS), \
                f"{req_id}: {len(req.block_ids)} blocks for {s + n} tokens"
            assert len(set(req.block_ids)) == len(req.block_ids), f"{req_id}: a block twice in its table"
            for pos in range(s, s + n):
                self.kv_slots[self._slot(req, pos)] = req.token_ids[pos]

        out = RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs={}, prompt_logprobs={})
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            s = req.num_computed_tokens
            end = s + n
            context = [self.kv_slots[self._slot(req, pos)] for pos in range(end)]
            assert context == req.token_ids[:end], f"{req_id} read other tokens from its KV blocks"
            req.num_computed_tokens = end
            self.chunks[req_id].append((s, n))
            out.req_ids.append(req_id)
            if end >= len(req.token_ids):
                token = self.sample(req_id, context, req.num_prompt_tokens)
                req.token_ids.append(token)
                out.sampled_token_ids.append([token])
            else:
                out.sampled_token_ids.append([])
        return out


# -- the harness ----------------------------------------------------------------------
@dataclass
class Step:
    output: SchedulerOutput
    admitted: list[str]
    preempted: list[str]
    sampled: dict[str, int]
    num_waiting: int  # after schedule(), as the harness counts them
    num_running: int

    @property
    def scheduled(self) -> dict[str, int]:
        return self.output.num_scheduled_tokens

    def new_req(self, req_id: str) -> NewRequestData:
        return next(new for new in self.output.scheduled_new_reqs if new.req_id == req_id)


@dataclass
class Harness:
    num_blocks: int = 256
    policy: str = "fcfs"
    prefix_caching: bool = True
    budget: int = 64
    max_num_seqs: int = 16
    threshold: int = 0
    sample: Sampler = hash_sample
    eos: int | None = None

    requests: dict[str, Request] = field(default_factory=dict)
    add_order: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish_reasons: dict[str, str] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    # The scheduler's state as told to the worker: running ids by admission order.
    running: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    expect_forget: set[str] = field(default_factory=set)
    steps: list[Step] = field(default_factory=list)
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        config = EngineConfig(block_size=BS, max_num_batched_tokens=self.budget,
                              max_num_seqs=self.max_num_seqs,
                              long_prefill_token_threshold=self.threshold,
                              enable_prefix_caching=self.prefix_caching,
                              scheduling_policy=self.policy)
        self.kv = KVCacheManager(self.num_blocks, BS, self.prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = FakeRunner(self.num_blocks, self.sample)
        self._admissions = itertools.count()

    def add(self, req_id: str, prompt: list[int], *, max_tokens: int = 8, priority: int = 0,
            arrival_time: float | None = None, **params) -> Request:
        sampling_params = SamplingParams(max_tokens=max_tokens, **params)
        self.add_order[req_id] = len(self.add_order)
        if arrival_time is None:
            arrival_time = float(self.add_order[req_id])
        request = Request(req_id, list(prompt), sampling_params, eos_token_id=self.eos,
                          priority=priority, arrival_time=arrival_time, max_tokens=max_tokens)
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def _admission_key(self, req_id: str) -> tuple:
        request = self.requests[req_id]
        if self.policy == "priority":
            return (request.priority, request.arrival_time, self.add_order[req_id])
        return (self.add_order[req_id],)

    def step(self) -> Step:
        had_work = self.scheduler.has_unfinished_requests()
        running_before = dict(self.running)
        waiting_before = [r for r in self.requests if r not in self.done and r not in self.running]

        so = roundtrip(self.scheduler.schedule(), SchedulerOutput)
        scheduled = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(scheduled.values()) <= self.budget
        assert all(n >= 1 for n in scheduled.values())
        assert len(scheduled) <= self.max_num_seqs
        if had_work:
            assert so.total_num_scheduled_tokens > 0, "no progress with requests pending"
        if so.total_num_scheduled_tokens:
            # An empty step never reaches the workers: what they must forget waits for the next.
            assert self.expect_forget <= set(so.finished_req_ids), \
                f"worker not told to forget {sorted(self.expect_forget - set(so.finished_req_ids))}"
            self.expect_forget.clear()
        else:
            assert not so.finished_req_ids

        # Preempted: running as far as the worker knows, now to be forgotten.
        preempted = [r for r in so.finished_req_ids if r in self.running]
        for req_id in preempted:
            del self.running[req_id]
        self.num_preemptions += len(preempted)
        if preempted:
            if self.policy == "priority":
                worst = sorted(running_before, key=self._admission_key)[-len(preempted):]
            else:
                worst = sorted(running_before, key=running_before.__getitem__)[-len(preempted):]
            assert sorted(preempted) == sorted(worst), f"preempted {preempted}, expected {worst}"
            assert not set(preempted) & set(scheduled)

        admitted = [new.req_id for new in so.scheduled_new_reqs]
        if preempted:
            assert not admitted, f"admitted {admitted} in a step that preempted {preempted}"
        assert admitted == sorted(waiting_before, key=self._admission_key)[:len(admitted)], \
            f"admitted {admitted} out of order from {waiting_before}"
        for new in so.scheduled_new_reqs:
            request = self.requests[new.req_id]
            assert new.prompt_token_ids == request.prompt_token_ids
            assert new.output_token_ids == self.outputs[new.req_id]
            self.running[new.req_id] = next(self._admissions)
        assert set(scheduled) <= set(self.running)
        assert set(self.running) == {r.request_id for r in self.scheduler.running}
        assert len(self.running) <= self.max_num_seqs
        num_waiting = len(self.requests) - len(self.done) - len(self.running)
        num_running = len(self.running)

        runner_output = roundtrip(self.runner.execute(so), RunnerOutput)
        sampled = {r: t[0] for r, t in zip(runner_output.req_ids, runner_output.sampled_token_ids) if t}
        updates = self.scheduler.update_from_output(so, runner_output)
        assert {u.req_id: u.new_token_ids for u in updates} == {r: [t] for r, t in sampled.items()}
        for update in updates:
            self.outputs[update.req_id].extend(update.new_token_ids)
            if update.finish_reason is not None:
                self._mark_done(update.req_id, update.finish_reason, update.stop_reason)
        self._check_consistency()
        step = Step(so, admitted, preempted, sampled, num_waiting, num_running)
        self.steps.append(step)
        return step

    def _mark_done(self, req_id: str, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reasons[req_id] = reason
        self.stop_reasons[req_id] = stop_reason
        self.done.add(req_id)
        self.running.pop(req_id, None)
        assert self.kv.get_block_ids(req_id) == [], f"finished {req_id} still holds blocks"
        assert req_id not in self.scheduler.requests
        if req_id in self.runner.requests:
            self.expect_forget.add(req_id)

    def abort(self, req_ids: list[str]) -> list[str]:
        expected = [r for r in dict.fromkeys(req_ids) if r in self.requests and r not in self.done]
        aborted = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        assert [r.request_id for r in aborted] == expected
        for request in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            self._mark_done(request.request_id, "abort", None)
        self._check_consistency()
        return expected

    def _check_consistency(self) -> None:
        self.kv.check_integrity()
        # Whatever the prefix cache offers must really be in the KV blocks it names.
        for block in self.kv.block_pool.cached_block_map.values():
            start = block.block_id * BS
            assert tuple(self.runner.kv_slots[start:start + BS]) == block.token_ids, \
                f"cached block {block.block_id} does not hold the tokens of its key"
        assert set(self.running) == {r.request_id for r in self.scheduler.running}
        owners: dict[int, tuple[str, int]] = {}
        for req_id in self.running:
            request, worker = self.requests[req_id], self.runner.requests[req_id]
            assert worker.token_ids == request.all_token_ids, f"{req_id}: worker and scheduler disagree"
            assert worker.num_computed_tokens == request.num_computed_tokens
            assert worker.block_ids == self.kv.get_block_ids(req_id)
            for i, block_id in enumerate(worker.block_ids):
                if block_id in owners:
                    # Only a full, computed block at the same position may be shared.
                    other, j = owners[block_id]
                    assert i == j, f"block {block_id} at {j} of {other} and {i} of {req_id}"
                    assert (i + 1) * BS <= min(worker.num_computed_tokens,
                                               self.runner.requests[other].num_computed_tokens)
                owners[block_id] = (req_id, i)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {list(self.scheduler.requests.values())}")

    def check_drained(self) -> None:
        """Nothing left: no requests, no held blocks, and the worker forgot everyone."""
        assert not self.scheduler.has_unfinished_requests()
        assert not self.scheduler.running and len(self.scheduler.waiting) == 0
        assert self.done == set(self.requests)
        last = self.step()
        assert last.output.total_num_scheduled_tokens == 0
        # An empty step is never sent: the worker hears of the last finished ids with
        # the next real step, so it holds exactly those until then.
        assert set(self.runner.requests) == self.scheduler._worker_forget
        self.kv.check_integrity()
        self.kv.assert_all_free()

    def expected(self, req_id: str) -> tuple[list[int], str, int | None]:
        request = self.requests[req_id]
        return reference_decode(req_id, request.prompt_token_ids, request.sampling_params,
                                self.eos, request.max_tokens, self.sample)

    def check_outputs(self) -> None:
        for req_id in self.requests:
            tokens, reason, stop_reason = self.expected(req_id)
            if self.finish_reasons[req_id] == "abort":
                assert self.outputs[req_id] == tokens[:len(self.outputs[req_id])], req_id
            else:
                assert (self.outputs[req_id], self.finish_reasons[req_id], self.stop_reasons[req_id]) \
                    == (tokens, reason, stop_reason), req_id

    def preemptions_of(self, req_id: str) -> list[int]:
        return [i for i, s in enumerate(self.steps) if req_id in s.preempted]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


# -- budget and sequence cap ----------------------------------------------------------
def test_token_budget_and_max_num_seqs_are_respected_and_used():
    h = Harness(budget=16, max_num_seqs=3)
    rng = random.Random(1)
    for i in range(12):
        h.add(f"r{i}", random_tokens(rng, rng.randint(1, 30)), max_tokens=rng.randint(1, 8))
    h.run()
    for step in h.steps:
        assert step.output.total_num_scheduled_tokens <= 16
        assert step.num_running <= 3
        # The pool is huge, so a step leaves budget unused only for lack of work or slots.
        assert (step.output.total_num_scheduled_tokens == 16 or step.num_waiting == 0
                or step.num_running == 3)
    assert any(s.num_running == 3 for s in h.steps)
    assert any(s.output.total_num_scheduled_tokens == 16 for s in h.steps)
    h.check_outputs()
    h.check_drained()


# -- mixed prefill and decode ---------------------------------------------------------
@pytest.mark.parametrize("threshold", [0, 5])
def test_decodes_run_every_step_while_a_long_prompt_is_chunked(threshold):
    budget = 16
    h = Harness(budget=budget, threshold=threshold)
    rng = random.Random(2)
    decoders = ["a", "b", "c"]
    for req_id in decoders:
        h.add(req_id, random_tokens(rng, 3), max_tokens=40)
    h.step()
    assert all(len(h.outputs[r]) == 1 for r in decoders)

    h.add("long", random_tokens(rng, 100), max_tokens=3)
    expected_chunks, remaining = [], 100
    while remaining:
        chunk = min(remaining, budget - len(decoders), threshold or remaining)
        expected_chunks.append(chunk)
        remaining -= chunk
    for i, chunk in enumerate(expected_chunks):
        step = h.step()
        assert step.scheduled == {"a": 1, "b": 1, "c": 1, "long": chunk}
        last = i == len(expected_chunks) - 1
        assert set(step.sampled) == set(decoders) | ({"long"} if last else set())
    assert h.runner.chunks["long"][:len(expected_chunks)] == \
        [(sum(expected_chunks[:i]), c) for i, c in enumerate(expected_chunks)]
    h.run()
    h.check_outputs()
    h.check_drained()


# -- chunked prefill ------------------------------------------------------------------
@pytest.mark.parametrize("threshold, expected_prefill", [
    (5, [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]),  # the threshold binds
    (0, [(0, 7), (7, 7), (14, 7), (21, 2)]),  # the budget binds
])
def test_chunks_of_one_request_follow_threshold_and_budget(threshold, expected_prefill):
    h = Harness(budget=7, threshold=threshold, prefix_caching=False)
    h.add("a", list(range(1, 24)), max_tokens=4)  # 23 prompt tokens
    h.run()
    assert h.runner.chunks["a"] == expected_prefill + [(23, 1), (24, 1), (25, 1)]
    h.check_outputs()
    h.check_drained()


@pytest.mark.parametrize("threshold", [0, 3])
def test_chunked_prefill_covers_every_position_once(threshold):
    h = Harness(budget=12, threshold=threshold, max_num_seqs=4, prefix_caching=False)
    rng = random.Random(3)
    for i in range(8):
        h.add(f"r{i}", random_tokens(rng, rng.randint(5, 40)), max_tokens=rng.randint(1, 6))
    h.run()
    for req_id, request in h.requests.items():
        chunks = h.runner.chunks[req_id]
        covered = [pos for s, n in chunks for pos in range(s, s + n)]
        # Every known token but the last sampled one is computed exactly once, in order.
        assert covered == list(range(request.num_prompt_tokens + len(h.outputs[req_id]) - 1))
        prefill = [n for s, n in chunks if s < request.num_prompt_tokens]
        assert sum(prefill) == request.num_prompt_tokens
        assert all(n <= (threshold or 12) for n in prefill)
    assert any(len([c for c in h.runner.chunks[r] if c[0] < h.requests[r].num_prompt_tokens]) > 1
               for r in h.requests), "no prompt was chunked"
    h.check_outputs()
    h.check_drained()


# -- admission order ------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order():
    h = Harness(max_num_seqs=1)
    order = ["e", "a", "d", "b", "c"]
    for req_id in order:
        h.add(req_id, [7, 8, 9], max_tokens=2)
    h.run()
    assert [r for s in h.steps for r in s.admitted] == order
    h.check_drained()


def test_priority_admits_lower_value_first_then_earlier_arrival():
    h = Harness(policy="priority", max_num_seqs=1)
    h.add("p3", [1, 2], priority=3, arrival_time=0.0)
    h.add("p1-late", [1, 2], priority=1, arrival_time=5.0)
    h.add("p2", [1, 2], priority=2, arrival_time=1.0)
    h.add("p1-early", [1, 2], priority=1, arrival_time=2.0)
    h.add("p0", [1, 2], priority=0, arrival_time=9.0)
    h.run()
    assert [r for s in h.steps for r in s.admitted] == ["p0", "p1-early", "p1-late", "p2", "p3"]
    h.check_drained()


# -- preemption -----------------------------------------------------------------------
def three_growing_requests(num_blocks: int, prefix_caching: bool) -> Harness:
    h = Harness(num_blocks=num_blocks, prefix_caching=prefix_caching)
    for i, req_id in enumerate(["A", "B", "C"]):
        h.add(req_id, [10 * i + j for j in range(1, 9)], max_tokens=12)  # 2 blocks each
    h.run()
    return h


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fcfs_preempts_the_latest_admitted_and_loses_no_tokens(prefix_caching):
    h = three_growing_requests(8, prefix_caching)
    # Step 0 admits A, B, C (6 of 8 blocks); at step 1 each needs a third block: A and B
    # take the last two and C, the latest admitted, is preempted rather than crashing.
    assert h.steps[0].admitted == ["A", "B", "C"]
    assert h.steps[1].preempted == ["C"] and set(h.steps[1].scheduled) == {"A", "B"}
    assert "C" in h.steps[1].output.finished_req_ids
    assert h.num_preemptions >= 2 and h.scheduler.stats.num_preemptions_total == h.num_preemptions
    for req_id in {r for s in h.steps for r in s.preempted}:
        first = h.preemptions_of(req_id)[0]
        resumed = next(s for s in h.steps[first + 1:] if req_id in s.admitted)
        assert resumed.new_req(req_id).output_token_ids, f"{req_id} resumed without its outputs"
    h.check_outputs()
    h.check_drained()

    roomy = three_growing_requests(1000, prefix_caching)
    assert roomy.num_preemptions == 0
    assert h.outputs == roomy.outputs


@pytest.mark.parametrize("case", ["lower-priority", "later-arrival"])
def test_priority_preempts_the_worst_not_the_latest_admitted(case):
    h = Harness(num_blocks=8, policy="priority", prefix_caching=False)
    if case == "lower-priority":
        h.add("victim", list(range(1, 9)), priority=5, max_tokens=12)
        h.step()
        h.add("x", list(range(11, 19)), priority=0, max_tokens=12)
        h.add("y", list(range(21, 29)), priority=1, max_tokens=12)
    else:
        h.add("victim", list(range(1, 9)), priority=2, arrival_time=10.0, max_tokens=12)
        h.step()
        h.add("x", list(range(11, 19)), priority=2, arrival_time=1.0, max_tokens=12)
        h.add("y", list(range(21, 29)), priority=2, arrival_time=2.0, max_tokens=12)
    step = h.step()
    assert step.admitted == ["x", "y"]
    # Next step "y" (latest admitted) has no block to grow into; FCFS would preempt it,
    # priority preempts "victim" although it was already scheduled in that step.
    step = h.step()
    assert step.preempted == ["victim"]
    assert set(step.scheduled) == {"x", "y"}
    assert "victim" not in step.output.scheduled_cached_reqs.req_ids
    assert step.output.total_num_scheduled_tokens == 2
    h.run()
    assert sum("victim" in s.admitted for s in h.steps) >= 2  # admitted, then resumed
    h.check_outputs()
    h.check_drained()


def test_priority_victim_already_scheduled_gives_its_budget_back():
    h = Harness(num_blocks=12, policy="priority", budget=16, threshold=8, prefix_caching=False)
    h.add("victim", list(range(1, 41)), priority=9, max_tokens=2)
    assert h.step().scheduled == {"victim": 8}
    h.add("x", [101, 102, 103], priority=0, max_tokens=4)
    h.add("y", list(range(201, 241)), priority=1, max_tokens=2)
    assert h.step().scheduled == {"victim": 8, "x": 3, "y": 5}
    assert h.step().scheduled == {"victim": 8, "x": 1, "y": 7}  # 10 of 12 blocks held
    # "victim" takes 2 more blocks, then "x" needs its second: "victim" is preempted and
    # its 8 tokens return to the budget, so "y" runs a full threshold chunk, not 7.
    step = h.step()
    assert step.preempted == ["victim"]
    assert step.scheduled == {"x": 1, "y": 8}
    h.run()
    h.check_outputs()
    h.check_drained()


# Regression: a priority victim already scheduled in the step must not leave the blocks
# allocate_slots cached for its never-computed tokens findable (a hit would read garbage).
def test_priority_victim_scheduled_this_step_leaves_no_uncomputed_cached_blocks():
    # "v" (priority 9) prefills 24 tokens in chunks of 8. At step 2 it allocates blocks
    # 4-5 for tokens 16-23 (cached at once, being full), then "h" cannot grow and "v" is
    # preempted before those tokens are computed. "h" takes one freed block and finishes;
    # "v" is readmitted and hits its own block 4, whose KV was never written.
    h = Harness(num_blocks=7, policy="priority", threshold=8)
    h.add("v", list(range(1, 25)), priority=9, max_tokens=2)
    h.step()
    h.add("h", list(range(101, 105)), priority=0, max_tokens=2)
    h.step()
    step = h.step()  # fails here: "cached block 5 does not hold the tokens of its key"
    assert step.preempted == ["v"]
    h.run()  # and, without that check, here: "v read other tokens from its KV blocks"
    h.check_outputs()
    h.check_drained()


def test_priority_ties_preempt_the_latest_admitted():
    h = Harness(num_blocks=6, policy="priority", prefix_caching=False)
    h.add("first", list(range(1, 9)), arrival_time=1.0, max_tokens=12)
    h.add("second", list(range(11, 19)), arrival_time=1.0, max_tokens=12)
    h.add("third", list(range(21, 29)), arrival_time=1.0, max_tokens=12)
    h.step()
    step = h.step()
    assert step.preempted == ["third"]


# -- stops ----------------------------------------------------------------------------
SCRIPT = [5, 6, 2, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("params, eos, script, expected", [
    (dict(max_tokens=8), 2, SCRIPT, ([5, 6, 2], "stop", None)),
    (dict(max_tokens=5, ignore_eos=True), 2, SCRIPT, ([5, 6, 2, 7, 8], "length", None)),
    (dict(max_tokens=8, stop_token_ids=[40, 6]), None, SCRIPT, ([5, 6], "stop", 6)),
    (dict(max_tokens=2), 2, SCRIPT, ([5, 6], "length", None)),
    # EOS before min_tokens is generated does not stop; the first one after does.
    (dict(max_tokens=8, min_tokens=4), 2, [5, 2, 2, 2, 9, 2, 2, 2], ([5, 2, 2, 2], "stop", None)),
    (dict(max_tokens=8, min_tokens=3, stop_token_ids=[6]), None, [6] * 8, ([6, 6, 6], "stop", 6)),
], ids=["eos", "ignore_eos", "stop_token_ids", "max_tokens", "min_tokens_eos", "min_tokens_stop_id"])
def test_stop_conditions(params, eos, script, expected):
    h = Harness(eos=eos, sample=scripted_sample({"r": script, "other": [1] * 20}))
    h.add("other", [3, 3, 3, 3, 3], max_tokens=20)
    h.add("r", [4, 4, 4, 4, 4, 4], **params)
    while "r" not in h.done:
        h.step()
    assert (h.outputs["r"], h.finish_reasons["r"], h.stop_reasons["r"]) == expected
    assert h.kv.get_block_ids("r") == [] and h.kv.get_block_ids("other") != []
    step = h.step()
    assert "r" in step.output.finished_req_ids and "r" not in h.runner.requests
    assert "other" in step.scheduled
    h.abort(["other"])
    h.kv.assert_all_free()
    h.check_outputs()
    h.check_drained()


# -- abort ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_waiting_running_finished_and_unknown(policy):
    h = Harness(budget=8, max_num_seqs=2, num_blocks=64, policy=policy)
    h.add("done", [1, 2], max_tokens=1)
    h.step()
    assert h.finish_reasons["done"] == "length"
    h.add("dec", [3, 4, 5], max_tokens=50)
    h.add("pre", list(range(100, 130)), max_tokens=50)
    h.add("wait", [6, 7, 8, 9, 10], max_tokens=50)
    h.add("wait2", [11, 12], max_tokens=3)
    step = h.step()
    assert step.admitted == ["dec", "pre"] and step.scheduled == {"dec": 3, "pre": 5}
    step = h.step()
    assert step.scheduled == {"dec": 1, "pre": 7}
    requests = {r: h.requests[r] for r in ("pre", "wait")}

    assert h.abort(["pre", "wait", "done", "never-added", "pre"]) == ["pre", "wait"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in requests.values())
    assert h.kv.get_block_ids("pre") == [] and h.kv.get_block_ids("dec") != []
    assert h.abort(["pre", "wait"]) == []
    step = h.step()
    assert "pre" in step.output.finished_req_ids
    assert step.admitted == ["wait2"] and set(step.scheduled) == {"dec", "wait2"}

    h.abort(["dec"])
    step = h.step()
    assert "dec" in step.output.finished_req_ids and "dec" not in h.runner.requests
    h.run()
    assert h.finish_reasons == {"done": "length", "pre": "abort", "wait": "abort", "dec": "abort",
                                "wait2": "length"}
    h.check_outputs()
    h.check_drained()


# -- prefix caching -------------------------------------------------------------------
PREFIX = list(range(500, 512))  # 12 tokens: 3 full blocks


@pytest.mark.parametrize("threshold, prefix_caching, prompt_logprobs, expected_hit", [
    (0, True, None, 12),  # all 3 shared blocks, cached by "a" earlier in the same step
    (8, True, None, 8),  # "a" runs only 8 tokens this step: only its first 2 blocks are known
    (0, True, 1, 0),  # prompt logprobs need every prompt position computed
    (0, False, None, 0),
])
def test_prefix_hit_in_the_same_step(threshold, prefix_caching, prompt_logprobs, expected_hit):
    h = Harness(threshold=threshold, prefix_caching=prefix_caching)
    h.add("a", PREFIX + [1, 2, 3])
    h.add("b", PREFIX + [4, 5, 6], prompt_logprobs=prompt_logprobs)
    step = h.step()
    assert step.admitted == ["a", "b"]
    new_a, new_b = step.new_req("a"), step.new_req("b")
    assert new_a.num_computed_tokens == 0
    assert new_b.num_computed_tokens == expected_hit
    assert step.scheduled["b"] == min(15 - expected_hit, threshold or 15)
    num_hit_blocks = expected_hit // BS
    assert new_b.block_ids[:num_hit_blocks] == new_a.block_ids[:num_hit_blocks]
    assert not set(new_b.block_ids[num_hit_blocks:]) & set(new_a.block_ids)
    assert h.requests["b"].num_cached_tokens == expected_hit
    h.run()
    h.check_outputs()
    h.check_drained()


# -- randomized -----------------------------------------------------------------------
@pytest.mark.parametrize("seed, policy", [
    *((seed, policy) for policy in ("fcfs", "priority") for seed in range(16)
      if (seed, policy) != (12, "priority")),
    # This seed runs into the bug above: a scheduled priority victim leaves a cached block
    # whose KV was never written.
    (12, "priority"),
])
def test_randomized_small_pool(seed, policy):
    rng = random.Random(seed)
    max_prompt, max_out = 30, 12
    prefix_caching = seed % 2 == 0
    h = Harness(
        num_blocks=-(-(max_prompt + max_out) // BS) + rng.randint(0, 6),
        policy=policy,
        prefix_caching=prefix_caching,
        budget=rng.choice([4, 8, 16, 32]),
        max_num_seqs=rng.randint(1, 6),
        threshold=rng.choice([0, 0, 3, 8]),
        eos=rng.choice([None, 0]),
        sample=lambda req_id, context, num_prompt: hash(tuple(context)) % 50,
    )
    prefixes = [random_tokens(rng, rng.randint(4, 16)) for _ in range(3)]
    pending = []
    for i in range(30):
        prompt = rng.choice(prefixes) if rng.random() < 0.5 else []
        prompt = (prompt + random_tokens(rng, rng.randint(1, max_prompt)))[:max_prompt]
        max_tokens = rng.randint(1, max_out)
        params = dict(max_tokens=max_tokens, priority=rng.randint(0, 3),
                      min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]),
                      stop_token_ids=rng.sample(range(50), rng.choice([0, 0, 1, 2])),
                      ignore_eos=rng.random() < 0.2)
        pending.append((rng.randint(0, 80), f"r{i}", prompt, params))
    pending.sort(key=lambda p: p[0])

    for step_index in range(3000):
        while pending and pending[0][0] <= step_index:
            _, req_id, prompt, params = pending.pop(0)
            h.add(req_id, prompt, **params)
        if rng.random() < 0.05 and h.requests:
            h.abort([rng.choice(list(h.requests) + ["unknown"])])
        if not pending and not h.scheduler.has_unfinished_requests():
            break
        h.step()
    else:
        raise AssertionError("requests did not finish")
    assert len(h.requests) == 30
    h.check_outputs()
    h.check_drained()

