"""Steps in flight: schedule, launch on the executor, apply the result.

Without async scheduling a step is scheduled, run and applied before the next is
scheduled. With it, while step N runs the pipeline schedules step N+1 and submits it at
once (the executor runs steps in order, so it starts N+1 as soon as N ends, without a
round trip through this side); N's tokens are applied while N+1 runs (see the
scheduler's docstring for the placeholder rules). A step whose grammar rows need N's
tokens is held back until they are applied: a chained worker samples N+1 before it hands
N's tokens back, so N+1 could not wait there for rows filled from them. Like every
step's, its rows are then filled while its own forward runs: the scheduler starts the
fill, the step is launched at once, and sampling waits for the rows (bitmask_filler.py).
With a chained executor the worker even
launches N+1 before reading N's tokens back: N+1's decode rows take them on the device
(ModelRunner.execute_model_chained), so the device never waits for the host in between.
The offline engine waits on the futures; the daemon's scheduler actor awaits them.
No torch here.
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from llmd.core.step_messages import RunnerOutput, SchedulerOutput
from llmd.core.scheduler import RequestUpdate, Scheduler, StepShape


@dataclass
class Step:
    """One scheduled step and what the callers need of it after it ran."""

    output: SchedulerOutput
    shape: StepShape
    num_cached: dict[str, int]  # prompt tokens from the prefix cache, by newly admitted request
    scheduled_at: float
    future: Future | None = None
    launched_at: float = 0.0


@dataclass
class PipelineStats:
    steps: int = 0
    tokens: int = 0  # tokens computed by the launched steps
    overlapped: int = 0  # steps launched before the previous step's tokens were applied
    deferred: int = 0  # steps whose grammar rows had to wait for the previous step's tokens


class StepPipeline:
    def __init__(self, scheduler: Scheduler, submit: Callable[[SchedulerOutput], Future],
                 overlap: bool, flush: Callable[[], Future] | None = None) -> None:
        """`submit(output)` starts the step on the executor and returns its future (it
        may run the step before returning). Steps run in the order submitted.

        Chained executors (`flush` given; with overlap only): the future of submit(N+1)
        holds step N's output (None for the first step), since the executor reads N's
        tokens back only after launching N+1; `flush()` returns a future of the last
        step's output when nothing follows it."""
        self.scheduler = scheduler
        self.submit = submit
        self.flush = flush
        self.overlap = overlap
        self._tasks: list[Future] = []  # every submit and flush not known to be done
        self.launched: collections.deque[Step] = collections.deque()  # oldest first, at most 2
        self.deferred: Step | None = None  # scheduled; its grammar rows wait for the oldest's tokens
        self.stats = PipelineStats()

    @property
    def in_flight(self) -> Step | None:
        """The oldest launched step: the one whose tokens are applied next."""
        return self.launched[0] if self.launched else None

    def start(self) -> Step | None:
        """Make sure a step is in flight (schedule and launch one if none is) and, with
        overlap, schedule the one after it and launch it at once, so the executor goes
        from one step to the next without waiting for this side to apply the first one's
        tokens (unless the next one's grammar rows need them). Returns the oldest step in
        flight, or None when nothing could be scheduled."""
        if not self.launched:
            step = self._schedule()
            if step is None:
                return None
            self._launch(step)
        if self.overlap and len(self.launched) == 1 and self.deferred is None:
            upcoming = self._schedule()
            if upcoming is not None:
                if self.scheduler.bitmask_deferred(upcoming.output):
                    self.deferred = upcoming
                else:
                    self._launch(upcoming)
                    self.stats.overlapped += 1
        head = self.launched[0]
        if head.future is None:  # chained, and nothing launched after it
            head.future = self._track(self.flush())
        return head

    def finish(self, runner_output: RunnerOutput) -> tuple[Step, list[RequestUpdate]]:
        """The oldest step ended with `runner_output`: apply its tokens, then launch a
        step that was waiting for them."""
        assert self.launched, "no step in flight"
        done = self.launched.popleft()
        updates = self.scheduler.update_from_output(done.output, runner_output)
        if self.deferred is not None:
            upcoming, self.deferred = self.deferred, None
            self.scheduler.fill_deferred_bitmask(upcoming.output)
            self.stats.deferred += 1
            self._launch(upcoming)
        return done, updates

    @property
    def chained(self) -> bool:
        return self.overlap and self.flush is not None

    def _track(self, future: Future) -> Future:
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(future)
        return future

    def drain(self, ignore: type[BaseException] | tuple[type[BaseException], ...]) -> None:
        """Wait for every task given to the executor (their errors of type `ignore` are
        not raised: their requests are failed or finished), then reset."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                task.result()
            except ignore:
                pass
        self.reset()

    def reset(self) -> None:
        """Forget every step (after the executor failed: its requests are failed)."""
        self.launched.clear()
        self.deferred = None
        self.scheduler.drop_deferred_bitmask()

    def _schedule(self) -> Step | None:
        output = self.scheduler.schedule()
        if output.total_num_scheduled_tokens == 0:
            return None
        requests = self.scheduler.requests
        return Step(output, self.scheduler.last_shape,
                    {r.req_id: requests[r.req_id].num_cached_tokens for r in output.scheduled_new_reqs},
                    time.monotonic())

    def _launch(self, step: Step) -> None:
        step.launched_at = time.monotonic()
        future = self._track(self.submit(step.output))
        if self.chained:
            if self.launched and self.launched[-1].future is None:
                self.launched[-1].future = future  # the step before's output
        else:
            step.future = future
        self.launched.append(step)
        self.stats.steps += 1
        self.stats.tokens += step.shape.num_tokens


def run_now(execute: Callable[[SchedulerOutput], RunnerOutput]) -> Callable[[SchedulerOutput], Future]:
    """A submit function that runs the step at once, in the caller's thread."""
    def submit(output: SchedulerOutput) -> Future:
        future: Future = Future()
        try:
            future.set_result(execute(output))
        except BaseException as exc:  # the caller sees it from future.result()
            future.set_exception(exc)
        return future
    return submit
