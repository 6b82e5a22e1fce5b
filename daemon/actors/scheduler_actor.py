"""The scheduler actor: drives the engine loop (EngineCore: scheduler, KV cache,
grammars, executor) one step at a time, through the calls the offline engine makes too. The model step runs in a worker thread (torch releases the GIL), so
the event loop keeps answering clients while a long prefill runs; scheduler state is
only touched on the loop.

A failed executor (a worker that died, hung past its step deadline, or exited while
idle) costs only the requests that ran on it: they end with finish_reason "error" and
the cause, requests still waiting stay queued, and new workers are started, backing off
as the failures add up (RestartPolicy); meanwhile messages are still handled (new
requests wait, aborts end). Too many failures in the policy's window declare the engine
dead: every request gets its final message, new ones are failed at once, and `dead` is
set for the server to exit."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable

import msgspec

from llmd.actors.messages import (AbortRequest, AddRequest, ChangeSleep, EngineState, GrammarCompiled, RequestEvent,
                                  RequestsAborted, StepStats, StepTokens, StopSamples, WorkerExited)
from llmd.actors.runtime import Actor
from llmd.core.engine_core import EngineCore, Idle, StepResult
from llmd.core.executor import ExecutorError
from llmd.core.request import RequestStatus
from llmd.core.restart_policy import RestartPolicy
from llmd.core.scheduler import StepShape

logger = logging.getLogger("llmd.scheduler")
# The executor kills a hung worker at the step's deadline; only a step that outlives it
# by this much (one the executor cannot kill: the in-process one) stops the watchdog.
WATCHDOG_GRACE_S = 10.0


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, engine, detokenizer: Actor, metrics: Actor,
                 model_thread: ThreadPoolExecutor | None = None,
                 restart_policy: RestartPolicy | None = None, *, model: str = "") -> None:
        """`model`: the name its figures carry (one scheduler per loaded model)."""
        super().__init__()
        self.model = model
        self.restart_policy = restart_policy or RestartPolicy()
        self.engine_state = "serving"  # "restarting", "dead"
        self.dead = asyncio.Event()
        self._dead_error = ""
        self._failure: str | None = None  # an executor failure seen and not yet recovered from
        self._generation = 0  # bumped at each failure: exits of older executors' workers are stale
        self._watched_fds: list[int] = []
        self._step_deadline: float | None = None  # monotonic, while a step with a deadline runs
        self.core: EngineCore = engine.core
        self.detokenizer = detokenizer
        self.metrics = metrics
        self.children: dict[str, list[str]] = {}
        self._sleep_changes: list[ChangeSleep] = []  # asked for, run between steps in order
        # All torch work stays on one thread (the one that loaded the model): a second
        # thread would start a second OpenMP team competing for the same cores.
        self._pool = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
        self.core.use_model_thread(self._pool)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.core.on_grammar_compiled(lambda: loop.call_soon_threadsafe(self.inbox.put_nowait, GrammarCompiled()))
        self._watch_workers(loop)
        try:
            while True:
                if self._failure is not None:
                    await self._recover(loop)
                    continue
                if not self._can_step() and not self._sleep_change_ready():
                    self._handle(await self.inbox.get())
                while not self.inbox.empty():
                    self._handle(self.inbox.get_nowait())
                if self._failure is not None:
                    continue
                if self._sleep_change_ready():
                    await self._change_sleep(loop, self._sleep_changes.pop(0))
                    continue
                if self._can_step():
                    await self._step(loop)
                else:
                    self._publish(time.monotonic(), None)  # e.g. after aborts: blocks are free
        finally:
            self._unwatch_workers(loop)
            self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def dead_error(self) -> str:
        """Why the engine was declared dead ("" while it is not)."""
        return self._dead_error

    def _can_step(self) -> bool:
        return self.engine_state == "serving" and self.core.has_unfinished_requests()

    def making_progress(self, now: float) -> bool:
        """For the systemd watchdog: idle, restarting (bounded by the backoff and the
        workers' start timeout) and a step within its deadline are progress."""
        return self._step_deadline is None or now < self._step_deadline + WATCHDOG_GRACE_S

    def _handle(self, message: object) -> None:
        match message:
            case AddRequest(request_id=rid) if self.engine_state == "dead":
                self.detokenizer.send(RequestsAborted([rid], reason="error", error=self._dead_error))
            case AddRequest(request_id=rid, children=children):
                self.children[rid] = [c.request_id for c in children]
                try:
                    self.core.add_requests(children)
                except Exception as exc:  # this request's own fault (a gap in intake's checks): it alone fails
                    logger.error("request %s could not be queued (%s); it ends with an error", rid,
                                 type(exc).__name__)
                    self._fail_requests([c.request_id for c in children],
                                        f"the request could not be queued ({type(exc).__name__})")
            case AbortRequest(request_ids=ids):
                aborted = []
                for rid in ids:
                    children = self.children.pop(rid, None)
                    if children is not None:
                        self.core.finish(children, RequestStatus.FINISHED_ABORTED)
                        aborted.append(rid)
                if aborted:
                    self.detokenizer.send(RequestsAborted(aborted))
            case StopSamples(child_ids=ids):
                self.core.finish(ids, RequestStatus.FINISHED_STOPPED)
                self._forget_finished()
            case GrammarCompiled():
                pass  # the next step admits (or fails) the requests that waited for it
            case ChangeSleep():
                self._sleep_changes.append(message)
            case WorkerExited(generation=generation):
                if generation == self._generation and self._failure is None:
                    self._failure = self.core.exit_cause() or "a worker process exited"
            case _:
                raise TypeError(f"scheduler actor got {type(message).__name__}")

    async def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        start = time.monotonic()
        try:
            begun = self.core.begin_step()
        except Exception as exc:
            self._step_failed(exc)
            return
        if isinstance(begun, Idle):
            await self._idle_step(begun, start)
            return
        self._step_deadline = self.core.step_deadline(begun)
        try:
            runner_output = await asyncio.wrap_future(begun.future)
        except ExecutorError as exc:
            self._failure = str(exc)  # run() recovers before anything else
            return
        except Exception as exc:
            self._step_failed(exc)
            return
        finally:
            self._step_deadline = None
        try:
            result = self.core.end_step(runner_output)
        except Exception as exc:
            self._step_failed(exc)
            return
        for parent in result.newly_scheduled:
            # Its queue time ends here (the metrics actor keeps only the first, not a resume).
            self.metrics.send(RequestEvent(parent, "scheduled", result.step.scheduled_at))
        self.detokenizer.send(StepTokens(result.updates, result.step.num_cached))
        if result.any_finished:
            self._forget_finished()
        self._publish(result.step.launched_at, result)

    async def _idle_step(self, idle: Idle, start: float) -> None:
        """Nothing could run: report grammars that failed, then (if every request is
        waiting for its grammar) sleep until a compile ends, a message arrives, or the
        first waiting request's time limit."""
        if idle.updates:
            self.detokenizer.send(StepTokens(idle.updates, {}))
            self._forget_finished()
            self._publish(start, None)
            return
        deadline = idle.grammar_deadline
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + 0.001
        try:
            self._handle(await asyncio.wait_for(self.inbox.get(), timeout))
        except TimeoutError:
            pass

    def _step_failed(self, exc: Exception) -> None:
        """A step raised outside the executor's own failure path (a bug, or a request's
        value no check caught): the daemon goes on. The step's requests fail and the
        worker restarts from a clean state, as after a worker crash (run() recovers). The
        log names the exception's type; its message may quote request data, so it and
        the traceback go to the debug log only."""
        logger.error("a step failed (%s); failing the requests in flight and restarting the worker",
                     type(exc).__name__)
        logger.debug("the failed step's traceback", exc_info=exc)
        self._failure = f"a step failed ({type(exc).__name__})"

    def _sleep_change_ready(self) -> bool:
        """A sleep or wake was asked for and can run now: a sleep once no request is left
        (one whose final output went out may still be finishing here, e.g. an abort of a
        client that left), a wake at once."""
        if not self._sleep_changes:
            return False
        return self._sleep_changes[0].level is None or not self.core.has_unfinished_requests()

    async def _change_sleep(self, loop: asyncio.AbstractEventLoop, change: ChangeSleep) -> None:
        """Put the engine to sleep or wake it, on the model thread, between steps (the
        pool asks only when the model has no request); messages are handled meanwhile.
        A failure (a worker that died) goes back to the asker, which tears the model down."""
        if change.done.done():  # the asker went away
            return
        core = self.core
        work = core.wake_up if change.level is None else (lambda: core.sleep(change.level))
        try:
            await self._serve_inbox_while(loop.run_in_executor(self._pool, work))
        except Exception as exc:
            logger.error("%s failed: %s", "waking the engine" if change.level is None else "sleep", exc)
            if not change.done.done():
                change.done.set_exception(exc)
            return
        if not change.done.done():
            change.done.set_result(None)
        self._publish(time.monotonic(), None)

    # -- executor failures ------------------------------------------------------------
    async def _recover(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the requests that ran on the failed executor, then start new workers,
        backing off between tries, until they serve or the engine is declared dead."""
        cause, self._failure = self._failure, None
        self._generation += 1
        self._unwatch_workers(loop)  # before the failed executor closes its descriptors
        failed = await loop.run_in_executor(self._pool, self.core.fail_in_flight, cause)
        self._fail_requests(failed, f"{cause}; the request was lost")
        while True:
            delay = self.restart_policy.record_failure(time.monotonic())
            if delay is None:
                self._declare_dead(cause)
                return
            self._set_state("restarting", cause)
            logger.warning("restarting the worker in %.1f s (%s)", delay, self.restart_policy.describe_window())
            await self._serve_inbox_while(asyncio.sleep(delay))
            started = time.monotonic()
            try:
                await self._serve_inbox_while(loop.run_in_executor(self._pool, self.core.restart_executor))
                break
            except Exception as exc:  # counted as a failure like any other: the window bounds the tries
                cause = f"worker restart failed: {exc}"
                logger.error("%s", cause)
        logger.info("worker restarted in %.1f s; serving", time.monotonic() - started)
        self._set_state("serving", cause)
        self._watch_workers(loop)
        self._publish(time.monotonic(), None)

    def _fail_requests(self, failed_children: list[str], error: str) -> None:
        """End the requests whose samples failed, whole (samples still waiting too)."""
        parent_of = {kid: rid for rid, kids in self.children.items() for kid in kids}
        parents = sorted({parent_of[kid] for kid in failed_children if kid in parent_of})
        for rid in parents:
            self.core.finish(self.children.pop(rid), RequestStatus.FINISHED_ERROR)
        if parents:
            self.detokenizer.send(RequestsAborted(parents, reason="error", error=error))

    def _declare_dead(self, cause: str) -> None:
        """Too many failures: every request ends with the reason, later ones fail at once."""
        self._dead_error = f"the engine is dead after {self.restart_policy.describe_window()}; the last: {cause}"
        logger.critical("%s", self._dead_error)
        self.core.finish(self.core.live_request_ids(), RequestStatus.FINISHED_ERROR)
        parents = list(self.children)
        self.children.clear()
        if parents:
            self.detokenizer.send(RequestsAborted(parents, reason="error", error=self._dead_error))
        self._set_state("dead", cause)
        self._publish(time.monotonic(), None)
        self.dead.set()

    def _set_state(self, state: str, error: str | None) -> None:
        self.engine_state = state
        self.metrics.send(EngineState(state, self.restart_policy.total_failures, error, model=self.model))

    async def _serve_inbox_while(self, awaitable: Awaitable) -> Any:
        """Await `awaitable`, handling messages as they come (new requests queue for the
        next executor, aborts end at once); returns its result or raises its error."""
        task = asyncio.ensure_future(awaitable)
        while True:
            getter = asyncio.ensure_future(self.inbox.get())
            try:
                await asyncio.wait([task, getter], return_when=asyncio.FIRST_COMPLETED)
            finally:
                got = getter.done()
                if not got:
                    getter.cancel()  # a message it had not taken yet stays in the inbox
            if got:
                self._handle(getter.result())
            if task.done():
                return task.result()

    def _watch_workers(self, loop: asyncio.AbstractEventLoop) -> None:
        """Notice a worker that exits between steps (a step in flight notices by itself)."""
        generation = self._generation
        for fd in self.core.exit_fds():
            loop.add_reader(fd, self._on_worker_exit, loop, generation)
            self._watched_fds.append(fd)

    def _on_worker_exit(self, loop: asyncio.AbstractEventLoop, generation: int) -> None:
        self._unwatch_workers(loop)  # an exited process's descriptor stays readable
        self.send(WorkerExited(generation))

    def _unwatch_workers(self, loop: asyncio.AbstractEventLoop) -> None:
        for fd in self._watched_fds:
            loop.remove_reader(fd)
        self._watched_fds = []

    def _publish(self, start: float, result: StepResult | None) -> None:
        """Step figures and the current queue/KV state for the metrics actor."""
        now = time.monotonic()
        shape = result.step.shape if result is not None else StepShape(0, 0, 0, 0)
        generated = result.generated if result is not None else {}
        self.metrics.send(StepStats(
            time=now, duration_s=now - start if result is not None else 0.0,
            num_reqs=shape.num_reqs, num_tokens=shape.num_tokens,
            num_prefill_tokens=shape.num_prefill_tokens, num_decode_reqs=shape.num_decode_reqs,
            num_generated=sum(generated.values()), generated=generated,
            device_memory_bytes=result.device_memory_bytes if result is not None else None, model=self.model,
            **msgspec.structs.asdict(self.core.stats(drain_compile_times=True)),
        ))

    def _forget_finished(self) -> None:
        done = [rid for rid, kids in self.children.items() if not any(self.core.is_live(k) for k in kids)]
        for rid in done:
            del self.children[rid]
