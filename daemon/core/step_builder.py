"""The step being scheduled: what each request gets in it, under one token budget.

The scheduler fills a StepBuilder in two phases (running requests, then waiting ones).
A request preempted later in the same step is dropped from it whole: its tokens go back
to the budget and it leaves every per-request entry, so no half-scheduled request can
reach the workers. Then `commit` counts the scheduled tokens as computed and `build`
writes the SchedulerOutput, in the order the requests were scheduled.
"""
from __future__ import annotations

import msgspec

from llmd.core.request import Request
from llmd.core.step_messages import CachedRequestData, NewRequestData, SchedulerOutput


class StepShape(msgspec.Struct, frozen=True):
    """The make-up of one scheduled step, for metrics."""

    num_reqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_reqs: int


class _CachedEntry(msgspec.Struct):
    """A running request scheduled again: the blocks it gained, and the tokens it had
    computed before this step (the worker checks its own count against it)."""

    new_block_ids: list[int]
    num_computed_tokens: int


class StepBuilder:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        # Set when the step preempted a request: there is no room to admit waiting ones.
        self.preempted_any = False
        self._requests: dict[str, Request] = {}
        self.num_scheduled: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self._cached: dict[str, _CachedEntry] = {}
        self.spec_tokens: dict[str, list[int]] = {}
        self.draft_limits: dict[str, int] = {}
        # Pooling requests whose last prompt token this step computes (set by commit).
        self.pooled: list[Request] = []

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled.values())

    def _schedule(self, request: Request, num_new: int, draft_limit: int | None) -> None:
        self._requests[request.request_id] = request
        self.num_scheduled[request.request_id] = num_new
        self.budget -= num_new
        if draft_limit is not None:
            self.draft_limits[request.request_id] = draft_limit

    def add_running(self, request: Request, num_new: int, new_block_ids: list[int], drafts: list[int],
                    draft_limit: int | None) -> None:
        """A running request computes `num_new` tokens (its drafts to verify included);
        `draft_limit`: the most tokens the worker's drafts for it may reach, if it drafts."""
        self._schedule(request, num_new, draft_limit)
        if drafts:
            self.spec_tokens[request.request_id] = drafts
        self._cached[request.request_id] = _CachedEntry(new_block_ids, request.num_computed_tokens)

    def add_new(self, request: Request, num_new: int, block_ids: list[int], draft_limit: int | None) -> None:
        """A request admitted from the waiting queue: the worker gets its tokens whole
        (its output too, after a preemption) and all its block ids."""
        self._schedule(request, num_new, draft_limit)
        self.new_reqs.append(NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
        ))

    def drop(self, request: Request) -> None:
        """Take back everything this step gave the request (it was preempted after being
        scheduled): its tokens return to the budget. A request not in the step is ignored."""
        req_id = request.request_id
        if self._requests.pop(req_id, None) is None:
            return
        self.budget += self.num_scheduled.pop(req_id)
        self.spec_tokens.pop(req_id, None)
        self.draft_limits.pop(req_id, None)
        self._cached.pop(req_id, None)
        self.new_reqs = [new for new in self.new_reqs if new.req_id != req_id]

    def commit(self) -> tuple[list[Request], StepShape]:
        """Count the scheduled tokens as computed, so the next schedule() sees them (they
        are in the cache before anyone reads them). Returns the requests that sample in
        this step (all their known tokens, placeholders and drafts computed), in order,
        and the step's shape: a decode is one known token (plus drafts) after an output.
        A pooling request never samples: the one whose prompt this step completes goes
        to `pooled` instead."""
        sampling: list[Request] = []
        num_prefill_tokens = 0
        num_decode_reqs = 0
        for req_id, n in self.num_scheduled.items():
            request = self._requests[req_id]
            num_drafts = len(self.spec_tokens.get(req_id, ()))
            known = request.num_tokens + request.num_output_placeholders
            if request.num_computed_tokens + n == known + num_drafts and n == 1 + num_drafts \
                    and (request.num_output_tokens or request.num_output_placeholders):
                num_decode_reqs += 1
            else:
                num_prefill_tokens += n
            request.num_computed_tokens += n
            if request.num_computed_tokens == known + num_drafts:
                (self.pooled if request.is_pooling else sampling).append(request)
        shape = StepShape(len(self.num_scheduled), self.total_tokens, num_prefill_tokens, num_decode_reqs)
        return sampling, shape

    def build(self, finished_req_ids: list[str], grammar_req_ids: list[str]) -> SchedulerOutput:
        cached = CachedRequestData(list(self._cached), [e.new_block_ids for e in self._cached.values()],
                                   [e.num_computed_tokens for e in self._cached.values()])
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=self.total_tokens,
            finished_req_ids=finished_req_ids,
            grammar_req_ids=grammar_req_ids,
            scheduled_spec_decode_tokens=self.spec_tokens,
            draft_max_num_tokens=self.draft_limits,
        )
