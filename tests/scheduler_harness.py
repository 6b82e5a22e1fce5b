"""The scheduler's test harness (tests/test_scheduler.py, test_async_pipeline.py): a fake
model runner and the checks stepped against it. No torch, no model.

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
