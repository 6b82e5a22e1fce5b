"""The scheduler actor: owns the scheduler, KV cache manager and executor, and drives
one step at a time. The model step runs in a worker thread (torch releases the GIL), so
the event loop keeps answering clients while a long prefill runs; scheduler state is
only touched on the loop."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from llmd.actors.messages import (AbortRequest, AddRequest, GrammarCompiled, RequestEvent, RequestsAborted,
                                  StepStats, StepTokens, StopSamples)
from llmd.actors.runtime import Actor
from llmd.executor_error import ExecutorError
from llmd.request import RequestStatus
from llmd.scheduler import StepShape
from llmd.step_pipeline import Step

logger = logging.getLogger("llmd.scheduler")


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, engine, detokenizer: Actor, metrics: Actor,
                 model_thread: ThreadPoolExecutor | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.scheduler = engine.scheduler
        self.kv = engine.kv_cache_manager
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.children: dict[str, list[str]] = {}
        # All torch work stays on one thread (the one that loaded the model): a second
        # thread would start a second OpenMP team competing for the same cores.
        self._pool = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
        engine.use_model_thread(self._pool)
        self.pipeline = engine.pipeline

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine.structured.service.on_done = \
            lambda: loop.call_soon_threadsafe(self.inbox.put_nowait, GrammarCompiled())
        try:
            while True:
                if not self.scheduler.has_unfinished_requests():
                    self._handle(await self.inbox.get())
                while not self.inbox.empty():
                    self._handle(self.inbox.get_nowait())
                if self.scheduler.has_unfinished_requests():
                    await self._step(loop)
                else:
                    self._publish(time.monotonic(), None)  # e.g. after aborts: blocks are free
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _handle(self, message: object) -> None:
        match message:
            case AddRequest(request_id=rid, children=children):
                self.children[rid] = [c.request_id for c in children]
                for child in children:
                    self.scheduler.add_request(child)
            case AbortRequest(request_ids=ids):
                aborted = []
                for rid in ids:
                    children = self.children.pop(rid, None)
                    if children is not None:
                        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
                        aborted.append(rid)
                if aborted:
                    self.detokenizer.send(RequestsAborted(aborted))
            case StopSamples(child_ids=ids):
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED)
                self._forget_finished()
            case GrammarCompiled():
                pass  # the next step admits (or fails) the requests that waited for it
            case _:
                raise TypeError(f"scheduler actor got {type(message).__name__}")

    async def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        start = time.monotonic()
        step = self.pipeline.start()
        if step is None:
            await self._idle_step(start)
            return
        try:
            runner_output = await asyncio.wrap_future(step.future)
        except ExecutorError as exc:
            # Every in-flight request ends with an error naming the cause; then serve on.
            await loop.run_in_executor(self._pool, self.engine.recover_from_executor_failure, str(exc))
            failed = list(self.children)
            self.children.clear()
            self.detokenizer.send(RequestsAborted(failed, reason="error"))
            self._publish(start, None)
            return
        step, updates = self.pipeline.finish(runner_output)
        for parent in {r.req_id.split("\x00", 1)[0] for r in step.output.scheduled_new_reqs}:
            # Its queue time ends here (the metrics actor keeps only the first, not a resume).
            self.metrics.send(RequestEvent(parent, "scheduled", step.scheduled_at))
        self.detokenizer.send(StepTokens(updates, step.num_cached))
        if any(u.finish_reason is not None for u in updates):
            self._forget_finished()
        self._publish(step.launched_at, step, {u.req_id: len(u.new_token_ids) for u in updates if u.new_token_ids},
                      runner_output.device_memory_bytes)

    async def _idle_step(self, start: float) -> None:
        """Nothing could run: report grammars that failed, then (if every request is
        waiting for its grammar) sleep until a compile ends, a message arrives, or the
        first waiting request's time limit."""
        failed = self.scheduler.take_pending_updates()
        if failed:
            self.detokenizer.send(StepTokens(failed, {}))
            self._forget_finished()
            self._publish(start, None)
            return
        if self.scheduler.has_schedulable_requests():
            raise RuntimeError("scheduler made no progress with requests pending")
        deadline = self.scheduler.grammar_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + 0.001
        try:
            self._handle(await asyncio.wait_for(self.inbox.get(), timeout))
        except TimeoutError:
            pass

    def _publish(self, start: float, step: Step | None, generated: dict[str, int] | None = None,
                 device_memory_bytes: int | None = None) -> None:
        """Step figures and the current queue/KV state for the metrics actor."""
        stats = self.kv.prefix_cache_stats
        spec = None
        if self.engine.config.speculative_config is not None:
            spec = msgspec.structs.replace(self.scheduler.spec_stats, accepted_per_position=list(
                self.scheduler.spec_stats.accepted_per_position))
        now = time.monotonic()
        shape = step.shape if step is not None else StepShape(0, 0, 0, 0)
        self.metrics.send(StepStats(
            time=now, duration_s=now - start if step is not None else 0.0,
            num_reqs=shape.num_reqs, num_tokens=shape.num_tokens,
            num_prefill_tokens=shape.num_prefill_tokens, num_decode_reqs=shape.num_decode_reqs,
            num_generated=sum(generated.values()) if generated else 0,
            generated=generated or {},
            running_ids=[r.request_id for r in self.scheduler.running],
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.num_blocks - self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_blocks,
            prefix_queries=stats.queries, prefix_hits=stats.hits,
            num_preemptions_total=self.scheduler.stats.num_preemptions_total,
            grammar_compile_times=self.engine.structured.service.drain_compile_times(),
            spec=spec, device_memory_bytes=device_memory_bytes,
        ))

    def _forget_finished(self) -> None:
        live = self.scheduler.requests
        done = [rid for rid, kids in self.children.items() if not any(k in live for k in kids)]
        for rid in done:
            del self.children[rid]
