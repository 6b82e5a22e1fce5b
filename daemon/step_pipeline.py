"""Steps in flight: schedule, launch on the executor, apply the result.

Without async scheduling a step is scheduled, run and applied before the next is
scheduled. With it, the pipeline holds one step in flight and schedules the next while
it runs; when the step ends, the next is launched first and the finished one's tokens
are applied while it runs (see the scheduler's docstring for the placeholder rules).
The offline engine waits on the futures; the daemon's scheduler actor awaits them.
No torch here.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from llmd.messages import RunnerOutput, SchedulerOutput
from llmd.scheduler import RequestUpdate, Scheduler, StepShape


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
                 overlap: bool) -> None:
        """`submit(output)` starts the step on the executor and returns its future (it
        may run the step before returning)."""
        self.scheduler = scheduler
        self.submit = submit
        self.overlap = overlap
        self.in_flight: Step | None = None
        self.next: Step | None = None
        self.stats = PipelineStats()

    def start(self) -> Step | None:
        """Make sure a step is in flight (schedule and launch one if none is) and, with
        overlap, schedule the one after it. Returns the step in flight, or None when
        nothing could be scheduled."""
        if self.in_flight is None:
            step = self._schedule()
            if step is None:
                return None
            self._launch(step)
        if self.overlap and self.next is None:
            self.next = self._schedule()
        return self.in_flight

    def finish(self, runner_output: RunnerOutput) -> tuple[Step, list[RequestUpdate]]:
        """The step in flight ended with `runner_output`: launch the next one (before
        applying these tokens, unless its grammar rows need them), then apply them."""
        done, self.in_flight = self.in_flight, None
        assert done is not None, "no step in flight"
        upcoming, self.next = self.next, None
        if upcoming is not None and not self.scheduler.bitmask_deferred(upcoming.output):
            self._launch(upcoming)
            self.stats.overlapped += 1
            upcoming = None
        updates = self.scheduler.update_from_output(done.output, runner_output)
        if upcoming is not None:
            self.scheduler.fill_deferred_bitmask(upcoming.output)
            self.stats.deferred += 1
            self._launch(upcoming)
        return done, updates

    def reset(self) -> None:
        """Forget every step (after the executor failed: its requests are failed)."""
        self.in_flight = self.next = None
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
        step.future = self.submit(step.output)
        self.in_flight = step
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
