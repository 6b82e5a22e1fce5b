"""The scheduler: which requests run this step, and how many tokens each.

Every step is `{request_id: num_tokens}` under one token budget. Running requests go
first (so a long prompt never starves decodes), then waiting ones are admitted while
budget, sequence slots and KV blocks last. Prefill and decode share a step; a prompt
longer than the budget (or `long_prefill_token_threshold`) is computed in chunks. When
KV blocks run out, the lowest-priority (FCFS: latest-arrived) running request is
preempted: its blocks are freed and it is recomputed later from its tokens. schedule()
runs these as phases (running, waiting, finalize) over one StepBuilder (step_builder.py),
which drops a request preempted within the step whole.

Guided requests wait in WAITING_FOR_GRAMMAR while their grammar compiles (other
requests run meanwhile); each step fills one bitmask row for every guided request that
samples, and each sampled token advances that request's matcher.

Async scheduling (`async_scheduling`): step N+1 is scheduled while step N runs. A request
sampling in step N then has a placeholder for that token: step N+1 computes it (the
worker appended it when step N ended), and the scheduler learns its value in
update_from_output(N). A request whose placeholder will be its last token (max_tokens)
is not scheduled past it; one that step N finishes by EOS or a stop has run one step
for nothing, whose token is dropped. Grammar rows of step N+1 need N's tokens in the
matchers: they are filled after update_from_output(N) (fill_deferred_bitmask).
"""
from __future__ import annotations

import time

import msgspec

from llmd.config import EngineConfig
from llmd.core.kv_cache_manager import KVCacheManager
from llmd.core.step_builder import StepBuilder, StepShape
from llmd.core.step_messages import GrammarRows, Logprobs, PromptLogprobs, RunnerOutput, SchedulerOutput
from llmd.core.request import Request, RequestStatus
from llmd.core.request_queue import make_queue
from llmd.core.draft_planning import DraftPlanner
from llmd.core.spec_decode import SpecDecodeStats
from llmd.core.stop_checks import append_sampled_tokens


class RequestUpdate(msgspec.Struct):
    """What one step did to one request, for the detokenizer and the caller."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong, for people
    logprobs: Logprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    pooled: list[float] | None = None  # a pooling request's result, with finish_reason "stop"


class SchedulerStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 structured=None) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.policy = config.scheduling_policy
        self.enable_prefix_caching = config.enable_prefix_caching
        # The engine's pooling for embeddings (resolved from the model at load; None: not
        # known, so no pooling request looks up the prefix cache).
        self.pooling_type = config.pooling_type
        self.kv = kv_cache_manager
        self.waiting = make_queue(self.policy)
        # Guided decoding (a llmd.structured_output.StructuredOutputManager, or None).
        self.structured = structured
        self.waiting_for_grammar: list[Request] = []
        # Results decided outside a model step (a grammar that failed), for the next caller.
        self._pending_updates: list[RequestUpdate] = []
        self.drafts = DraftPlanner(config.speculative_config, structured)
        self.spec_stats = SpecDecodeStats()
        self.async_scheduling = config.async_scheduling
        # The step whose grammar rows wait for the tokens of the step in flight.
        self._deferred_bitmask: tuple[SchedulerOutput, list[Request]] | None = None
        self.last_shape = StepShape(0, 0, 0, 0)
        # The grammar rows of the step schedule() returned last, being filled (None: it
        # has no guided request, or its rows wait for fill_deferred_bitmask).
        self.last_grammar_rows: GrammarRows | None = None
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Ids the worker must forget at the next step (finished, aborted, preempted).
        self._worker_forget: set[str] = set()
        self.stats = SchedulerStats()

    # -- requests in and out ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.grammar is not None:
            if self.structured is None:
                raise ValueError("guided decoding is not available in this engine")
            self.structured.start(request.grammar)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.requests[request.request_id] = request
            self.waiting_for_grammar.append(request)
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside a step (abort, stop string). Unknown ids are ignored."""
        done = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            done.append(request)
        return done

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self._worker_forget.add(request.request_id)
        self.drafts.forget(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether a step can run now (not everything is waiting for a grammar)."""
        return bool(self.running) or bool(self.waiting)

    def take_pending_updates(self) -> list[RequestUpdate]:
        """Requests finished outside a step (a grammar that failed to compile)."""
        updates, self._pending_updates = self._pending_updates, []
        return updates

    # -- grammars ---------------------------------------------------------------------
    def grammar_deadline(self) -> float | None:
        """When the earliest running compile hits its time limit (monotonic), if any."""
        if not self.waiting_for_grammar:
            return None
        return self.structured.next_deadline([r.grammar for r in self.waiting_for_grammar])

    def _poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose
        compile failed or ran past its time limit."""
        now = time.monotonic()
        still: list[Request] = []
        for request in self.waiting_for_grammar:
            try:
                ready = self.structured.poll(request.grammar, request.matcher_stop_token_ids, now)
            except ValueError as exc:  # poll turns a failure of any type into a GrammarError
                request.status = RequestStatus.FINISHED_ERROR
                self._release(request)
                self._pending_updates.append(RequestUpdate(request.request_id, [], finish_reason="error",
                                                           error=str(exc)))
                continue
            if ready:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
            else:
                still.append(request)
        self.waiting_for_grammar = still

    def bitmask_deferred(self, output: SchedulerOutput) -> bool:
        """Whether `output`'s grammar rows wait for update_from_output of the step in flight."""
        return self._deferred_bitmask is not None and self._deferred_bitmask[0] is output

    def drop_deferred_bitmask(self) -> None:
        self._deferred_bitmask = None

    def fill_deferred_bitmask(self, output: SchedulerOutput) -> GrammarRows:
        """Start filling `output`'s grammar rows now that the matchers have every sampled
        token. A request finished meanwhile keeps its row (its token will be dropped)."""
        deferred, self._deferred_bitmask = self._deferred_bitmask, None
        assert deferred is not None and deferred[0] is output, "no deferred bitmask for this step"
        guided = deferred[1]
        return self.structured.fill_bitmask([None if r.is_finished else r.grammar for r in guided],
                                            [[] for _ in guided])

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._poll_grammars()
        step = StepBuilder(self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted_any:  # a step that had to preempt has no room to grow
            self._schedule_waiting(step)
        return self._finalize(step)

    def _schedule_running(self, step: StepBuilder) -> None:
        """Running requests first, in order, so a long prompt never starves decodes. A
        request preempted earlier in this loop (as a victim) is skipped."""
        for request in list(self.running):
            if step.budget <= 0:
                break
            if request.status == RequestStatus.RUNNING:
                self._schedule_running_request(request, step)

    def _schedule_running_request(self, request: Request, step: StepBuilder) -> None:
        """Its next tokens (and drafts to verify) with KV slots for them. When blocks run
        out, its speculation is dropped first; then the lowest-priority running request is
        preempted, until the slots fit or the victim is this request itself."""
        num_new = self._num_tokens_to_schedule(request, step.budget)
        if num_new == 0:
            return
        drafts = self.drafts.drafts_to_verify(request, num_new, step.budget)
        drafting = self.drafts.drafts_for(request, request.num_computed_tokens + num_new)
        num_new += len(drafts)
        lookahead = self.drafts.lookahead(request, request.num_computed_tokens + num_new) if drafting else 0
        while (new_blocks := self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)) is None:
            if drafts or drafting:
                # Drop the speculation before preempting anyone for it.
                num_new -= len(drafts)
                drafts, drafting, lookahead = [], False, 0
                continue
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return
        draft_limit = request.num_computed_tokens + num_new + lookahead + 1 if drafting else None
        step.add_running(request, num_new, [b.block_id for b in new_blocks], drafts, draft_limit)

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        if request.num_output_placeholders and \
                request.num_output_tokens + request.num_output_placeholders >= request.max_tokens:
            return 0  # the token in flight is its last
        num_new = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return min(num_new, budget)

    def _pick_victim(self) -> Request:
        """The request to preempt: the lowest priority (latest arrival on ties), or under
        FCFS the latest admitted."""
        if self.policy == "priority":
            # Among equals, the latest admitted (max returns the first maximum it meets).
            return max(reversed(self.running), key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        """Free the request's blocks and queue it to be recomputed from its tokens. Only
        the priority policy can pick one already scheduled in this step: it is dropped."""
        self.running.remove(request)
        step.drop(request)
        step.preempted_any = True
        # num_computed_tokens still counts only what earlier steps computed.
        self.kv.free(request, num_valid_tokens=request.num_computed_tokens)
        self._worker_forget.add(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is dropped and recomputed
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.waiting.add_preempted(request)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Admit waiting requests in queue order while budget, sequence slots and KV
        blocks last; a request whose blocks do not fit stops admission (no overtaking)."""
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if self.enable_prefix_caching and self._may_skip_cached_prefix(request):
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            else:
                hit_blocks, num_hit = [], 0
            num_new = min(request.num_tokens - num_hit, step.budget)
            if self.long_prefill_token_threshold:
                num_new = min(num_new, self.long_prefill_token_threshold)
            drafting = self.drafts.drafts_for(request, num_hit + num_new)
            lookahead = self.drafts.lookahead(request, num_hit + num_new) if drafting else 0
            if self.kv.allocate_slots(request, num_new, hit_blocks, num_hit, num_lookahead_tokens=lookahead) is None:
                if not drafting or self.kv.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                    return
                drafting, lookahead = False, 0  # admitted without speculation
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            request.num_cached_tokens = num_hit
            self.running.append(request)
            draft_limit = num_hit + num_new + lookahead + 1 if drafting else None
            step.add_new(request, num_new, self.kv.get_block_ids(request.request_id), draft_limit)

    def _may_skip_cached_prefix(self, request: Request) -> bool:
        """Whether a request being admitted may take its prompt's cached prefix instead
        of computing it: not when it needs an output at every prompt position. That is
        prompt logprobs, and a pooling request unless it pools the LAST token (a hit
        never covers the last token; MEAN reads every position's hidden state, CLS the
        first). A pooling request's own full blocks are cached as any others: their K/V
        are what any request with that prefix computes."""
        if request.pooling_params is not None:
            return self.pooling_type == "LAST"
        return request.sampling_params.prompt_logprobs is None

    def _finalize(self, step: StepBuilder) -> SchedulerOutput:
        """Count the step's tokens as computed, start filling the grammar rows of the
        guided requests that sample (they are filled while the step runs; or deferred: a
        matcher lacks a token still being sampled), and name the requests the worker must
        forget."""
        sampling, self.last_shape = step.commit()
        guided = [r for r in sampling if r.grammar is not None]
        deferred = any(r.num_output_placeholders for r in guided)
        if self.async_scheduling:
            for request in sampling:
                request.num_output_placeholders += 1
        forget = []
        if step.total_tokens:  # an empty step is not sent to the workers: they hear of these next time
            forget = sorted(self._worker_forget)
            self._worker_forget.clear()
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        output = step.build(forget, [r.request_id for r in guided])
        for request in step.pooled:
            request.pooled_by = output
        self.last_grammar_rows = None
        if deferred:
            self._deferred_bitmask = (output, guided)
        elif guided:
            self.last_grammar_rows = self.structured.fill_bitmask(
                [r.grammar for r in guided], [step.spec_tokens.get(r.request_id, []) for r in guided])
        return output

    # -- results ----------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestUpdate]:
        updates = self.take_pending_updates()
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted while the step ran
            if request.is_pooling:
                if (update := self._finish_pooling(request, output, runner_output.pooled.get(req_id))) is not None:
                    updates.append(update)
                continue
            if token_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            num_drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            if num_drafts:
                # Rejected drafts' KV slots are overwritten later: computed no more.
                num_accepted = len(token_ids) - 1
                request.num_computed_tokens -= num_drafts - num_accepted
                self.spec_stats.record(num_drafts, num_accepted)
            if not token_ids and req_id not in prompt_logprobs:
                continue  # a prefill chunk that produced nothing to report
            new_tokens, status, error = append_sampled_tokens(request, token_ids, self.structured)
            update = RequestUpdate(req_id, new_tokens, error=error,
                                   logprobs=logprobs.get(req_id),
                                   prompt_logprobs=prompt_logprobs.get(req_id))
            if status is not None:
                request.status = status
                self.running.remove(request)
                self._release(request)
                update.finish_reason = status.finish_reason
                update.stop_reason = request.stop_reason
            elif new_tokens and request.speculative:
                self.drafts.take_drafts(request, runner_output.draft_token_ids.get(req_id, []))
            updates.append(update)
        return updates

    def _finish_pooling(self, request: Request, output: SchedulerOutput,
                        pooled: list[float] | None) -> RequestUpdate | None:
        """A pooling request ends with the step that computed its last prompt token
        (`pooled_by`), which returns its pooled state. Such a step returning none is a
        worker bug: the request fails rather than waiting for ever. Earlier steps were
        chunks of its prompt: nothing to report."""
        if pooled is None and request.pooled_by is not output:
            return None
        status = RequestStatus.FINISHED_STOPPED if pooled is not None else RequestStatus.FINISHED_ERROR
        request.status = status
        self.running.remove(request)
        self._release(request)
        error = None if pooled is not None else "internal error: the step returned no pooled hidden state"
        return RequestUpdate(request.request_id, [], finish_reason=status.finish_reason, error=error, pooled=pooled)
