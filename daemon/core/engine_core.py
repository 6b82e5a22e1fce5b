"""The engine loop, written once: the scheduler, the KV cache manager, the grammars,
the steps in flight and the executor, behind the few calls both drivers make.

Two drivers run it: the offline `LLMEngine.step` (blocking on the step's future, output
processing in process) and the daemon's scheduler actor (awaiting the future on the event
loop, output processing in the detokenizer actor). Each turn of either is

    begun = core.begin_step()          # a Step in flight, or Idle
    output = <wait for begun.future>   # ExecutorError: core.fail_in_flight / restart_executor
    result = core.end_step(output)     # the token updates, for the output side

and stop strings found by the output side come back as `core.finish(ids, STOPPED)`.
What the drivers may read is `stats()`, one struct. No torch here.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from llmd.config import EngineConfig
from llmd.core.executor import Executor
from llmd.core.kv_cache_manager import KVCacheManager
from llmd.core.request import Request, RequestStatus, parent_request_id
from llmd.core.scheduler import RequestUpdate, Scheduler
from llmd.core.spec_decode import SpecDecodeStats
from llmd.core.step_messages import GrammarRows, RunnerOutput, SchedulerOutput
from llmd.core.step_pipeline import Step, StepPipeline, output_of, run_now
from llmd.structured_output import StructuredOutputManager

logger = logging.getLogger("llmd.engine")


@dataclass
class Idle:
    """Nothing could be scheduled. `updates`: requests that ended without a step (their
    grammar failed to compile); when there are none, every request is waiting for its
    grammar, until one compiles or `grammar_deadline` (monotonic) passes."""

    updates: list[RequestUpdate] = field(default_factory=list)
    grammar_deadline: float | None = None


@dataclass
class StepResult:
    """A step that ran: what it did to each request, and what the callers report of it."""

    step: Step
    updates: list[RequestUpdate]
    device_memory_bytes: int | None = None

    @property
    def generated(self) -> dict[str, int]:
        """Tokens each request (scheduler id) gained."""
        return {u.req_id: len(u.new_token_ids) for u in self.updates if u.new_token_ids}

    @property
    def newly_scheduled(self) -> set[str]:
        """Client request ids whose samples ran for the first time (or again after preemption)."""
        return {parent_request_id(r.req_id) for r in self.step.output.scheduled_new_reqs}

    @property
    def any_finished(self) -> bool:
        return any(u.finish_reason is not None for u in self.updates)


class EngineStats(msgspec.Struct):
    """Queue, KV cache and counter figures at one moment (totals since start)."""

    running_ids: list[str]
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions_total: int
    # Grammar compiles that ended since the previous stats(drain_compile_times=True).
    grammar_compile_times: list[float] = []
    spec: SpecDecodeStats | None = None  # a copy; None when speculative decoding is off


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, make_executor: Callable[[], Executor],
                 num_blocks: int, structured: StructuredOutputManager) -> None:
        """`executor` runs the model with a KV cache of `num_blocks`; `make_executor()`
        starts a fresh one (without its KV cache) after a failure."""
        self.config = config
        self.executor = executor
        self._make_executor = make_executor
        self.num_blocks = num_blocks
        self.structured = structured
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager, structured)
        self.sleep_level: int | None = None  # 1 or 2 while asleep (see sleep)
        self._model_thread: ThreadPoolExecutor | None = None
        self._owns_model_thread = False
        self.pipeline = StepPipeline(self.scheduler, self._launch, self._collect, overlap=config.async_scheduling)

    # -- requests -------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def finish(self, request_ids: list[str], status: RequestStatus) -> None:
        """End these scheduler requests (unknown or finished ids are ignored)."""
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def is_live(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def live_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    # -- the loop -------------------------------------------------------------------
    def begin_step(self) -> Step | Idle:
        """The oldest step in flight (scheduling and launching one, and with async
        scheduling the one after it), or Idle when nothing could be scheduled. Raises
        RuntimeError when requests could run and the scheduler made no progress."""
        step = self.pipeline.start()
        if step is not None:
            return step
        failed = self.scheduler.take_pending_updates()
        if failed:
            return Idle(failed)
        if self.scheduler.has_schedulable_requests():
            raise RuntimeError("scheduler made no progress with requests pending")
        return Idle([], self.scheduler.grammar_deadline())

    def step_deadline(self, step: Step) -> float | None:
        """When the step in flight is overdue (monotonic): the configured limit for the
        tokens of every launched step, from its launch. None: no limit."""
        limit = self.config.step_deadline_s(sum(s.shape.num_tokens for s in self.pipeline.launched))
        return None if limit is None else step.launched_at + limit

    def end_step(self, runner_output: RunnerOutput) -> StepResult:
        """Apply the oldest step's output: tokens appended, token-level stops checked,
        blocks of finished requests freed."""
        step, updates = self.pipeline.finish(runner_output)
        return StepResult(step, updates, runner_output.device_memory_bytes)

    def wait_for_grammars(self, idle: Idle) -> None:
        """Block until a waiting request's grammar compiles or the first one's deadline."""
        waiting = self.scheduler.waiting_for_grammar
        if waiting:
            self.structured.wait([r.grammar for r in waiting], idle.grammar_deadline)

    def on_grammar_compiled(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the compiling thread) whenever a grammar compile ends."""
        self.structured.service.on_done = callback

    # -- executor failures ----------------------------------------------------------
    def fail_in_flight(self, cause: str) -> list[str]:
        """After the executor failed (a worker died or hung): finish the requests that
        ran on it with finish_reason "error" (waiting ones never reached it and stay
        queued for the next executor), forget the prefix cache (new workers start with
        an empty KV cache) and shut the failed executor down. Returns the scheduler ids
        of the failed requests."""
        logger.error("executor failed: %s; failing %d running request(s)", cause, len(self.scheduler.running))
        # A step launched behind the failed one runs (and fails) on the old executor
        # before the new one exists: no step may reach the new workers mid-start.
        self.pipeline.drain(ignore=Exception)
        failed = [r.request_id for r in self.scheduler.running]
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        self.kv_cache_manager.reset_prefix_cache()
        try:
            self.executor.shutdown()
        except Exception:  # the old one is broken; what matters is the new one
            logger.exception("shutting down the failed executor")
        return failed

    def restart_executor(self) -> None:
        """Start a fresh executor with a KV cache of the same size. Raises (an
        ExecutorError when a worker fails to start or dies meanwhile) leaving no new
        worker running and the failed executor in place."""
        executor = self._make_executor()
        try:
            executor.initialize_kv_cache(self.num_blocks)
            if self.sleep_level is not None:  # a worker that died while the model slept: it sleeps on
                executor.sleep(self.sleep_level)
        except BaseException:
            executor.shutdown()
            raise
        self.executor = executor

    # -- sleep mode -----------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Give the model's memory back while it has no request: the executor frees the
        KV cache and keeps (level 1: on CUDA in pinned host memory) or drops (level 2)
        the weights. The prefix cache is forgotten (its blocks' contents are gone).
        Raises RuntimeError while requests are unfinished, ValueError for a level other
        than 1 or 2; ExecutorError when a worker fails."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished_requests():
            raise RuntimeError("the engine has unfinished requests: finish or abort them before it sleeps")
        self.pipeline.drain(ignore=())  # a step whose requests all finished may still run
        if self.sleep_level is not None and self.sleep_level >= level:
            return
        self.kv_cache_manager.reset_prefix_cache()
        self.executor.sleep(level)
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restore what sleep freed (the KV cache at its size, empty); no-op when awake."""
        if self.sleep_level is None:
            return
        self.executor.wake_up()
        self.sleep_level = None

    def exit_fds(self) -> list[int]:
        """Descriptors that become readable when a worker of the current executor exits."""
        return self.executor.exit_fds()

    def exit_cause(self) -> str | None:
        return self.executor.exit_cause()

    # -- figures --------------------------------------------------------------------
    def stats(self, drain_compile_times: bool = False) -> EngineStats:
        kv = self.kv_cache_manager
        prefix = kv.prefix_cache_stats
        spec = None
        if self.config.speculative_config is not None:
            spec = msgspec.structs.replace(self.scheduler.spec_stats, accepted_per_position=list(
                self.scheduler.spec_stats.accepted_per_position))
        return EngineStats(
            running_ids=[r.request_id for r in self.scheduler.running], num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks, kv_blocks_total=kv.num_blocks,
            prefix_queries=prefix.queries, prefix_hits=prefix.hits,
            num_preemptions_total=self.scheduler.stats.num_preemptions_total,
            grammar_compile_times=self.structured.service.drain_compile_times() if drain_compile_times else [],
            spec=spec)

    # -- threads --------------------------------------------------------------------
    def use_model_thread(self, pool: ThreadPoolExecutor) -> None:
        """Run every step on `pool`, whatever the scheduling (the daemon's model thread,
        which loaded the model: one OpenMP team for all torch work)."""
        self._model_thread, self._owns_model_thread = pool, False

    def _run(self, fn: Callable[[], object]) -> Future:
        """`fn` on the model thread: with async scheduling (the caller schedules the next
        step meanwhile) or once a model thread was given; else at once, on this thread."""
        if self._model_thread is None and not self.config.async_scheduling:
            return run_now(fn)()
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
            self._owns_model_thread = True
        return self._model_thread.submit(fn)

    def _launch(self, scheduler_output: SchedulerOutput, grammar_rows: GrammarRows | None) -> Future:
        """Launch the step; the executor is looked up when it starts (a failed one is
        replaced)."""
        return self._run(lambda: self.executor.execute_model(scheduler_output, grammar_rows))

    def _collect(self, handle: Future) -> Future:
        return self._run(lambda: output_of(handle))

    def shutdown(self, ignore: type[BaseException] | tuple = ()) -> None:
        """Stop the executor (worker processes exit) and drop the KV cache."""
        self.pipeline.drain(ignore=ignore)  # a step whose requests all finished may still run
        if self._model_thread is not None and self._owns_model_thread:
            self._model_thread.shutdown(wait=True)
        self._model_thread = None
        self.executor.shutdown()
        self.structured.shutdown()
