"""Steps in flight: schedule, launch on the executor, apply the result.

Every step is launched the same way (Executor.execute_model, with the step's grammar
rows when it has guided requests, returns its handle) and its output is read from the
handle (StepHandle.output). Without async scheduling a step's
output is asked for as soon as it is launched: scheduled, run and applied before the
next is scheduled. With it (overlap), while step N runs the pipeline schedules step N+1
and launches it at once, and only then asks for N's output: the executor starts N+1 as
soon as N ends, and N+1's decode rows take N's tokens on the device (the runner keeps
them there until N's output is read), so the device never waits for the host in
between. N's tokens are applied while N+1 runs (see the scheduler's docstring for the
placeholder rules). A step whose grammar rows need N's tokens is held back until they
are applied: its rows could not be filled from tokens the host does not have. Like
every step's, its rows are then filled while its own forward runs: the scheduler starts
the fill, the step is launched at once, and sampling waits for the rows
(bitmask_filler.py). The depth of overlap is this pipeline's alone: the executors have
one code path. The offline engine waits on the futures; the daemon's scheduler actor
awaits them. No torch here.
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from llmd.core.step_messages import GrammarRows, RunnerOutput, SchedulerOutput
from llmd.core.scheduler import RequestUpdate, Scheduler, StepShape


@dataclass
class Step:
    """One scheduled step and what the callers need of it after it ran."""

    output: SchedulerOutput
    shape: StepShape
    num_cached: dict[str, int]  # prompt tokens from the prefix cache, by newly admitted request
    scheduled_at: float
    grammar_rows: GrammarRows | None = None  # its guided requests' rows, once their fill started
    handle: Future | None = None  # of the executor's StepHandle, once launched
    future: Future | None = None  # of its RunnerOutput, once asked for
    launched_at: float = 0.0


@dataclass
class PipelineStats:
    steps: int = 0
    tokens: int = 0  # tokens computed by the launched steps
    overlapped: int = 0  # steps launched before the previous step's tokens were applied
    deferred: int = 0  # steps whose grammar rows had to wait for the previous step's tokens


class StepPipeline:
    def __init__(self, scheduler: Scheduler, launch: Callable[[SchedulerOutput, GrammarRows | None], Future],
                 collect: Callable[[Future], Future], overlap: bool) -> None:
        """`launch(output, grammar_rows)` starts the step on the executor and returns a
        future of its StepHandle (it may run the step before returning); `collect(handle_future)` a
        future of the handle's RunnerOutput. Both keep the order they are called in."""
        self.scheduler = scheduler
        self.launch = launch
        self.collect = collect
        self.overlap = overlap
        self._tasks: list[Future] = []  # every launch and collect not known to be done
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
        if head.future is None:  # nothing launched after it: its output now
            head.future = self._track(self.collect(head.handle))
        return head

    def finish(self, runner_output: RunnerOutput) -> tuple[Step, list[RequestUpdate]]:
        """The oldest step ended with `runner_output`: apply its tokens, then launch a
        step that was waiting for them."""
        assert self.launched, "no step in flight"
        done = self.launched.popleft()
        updates = self.scheduler.update_from_output(done.output, runner_output)
        if self.deferred is not None:
            upcoming, self.deferred = self.deferred, None
            upcoming.grammar_rows = self.scheduler.fill_deferred_bitmask(upcoming.output)
            self.stats.deferred += 1
            self._launch(upcoming)
        return done, updates

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
                    time.monotonic(), self.scheduler.last_grammar_rows)

    def _launch(self, step: Step) -> None:
        step.launched_at = time.monotonic()
        step.handle = self._track(self.launch(step.output, step.grammar_rows))
        if self.launched and self.launched[-1].future is None:
            # The step before's output, asked for after this one launched: the executor
            # went on to this step without waiting for that read.
            self.launched[-1].future = self._track(self.collect(self.launched[-1].handle))
        if not self.overlap:
            step.future = self._track(self.collect(step.handle))
        self.launched.append(step)
        self.stats.steps += 1
        self.stats.tokens += step.shape.num_tokens


def run_now(fn: Callable[..., object]) -> Callable[..., Future]:
    """A function that runs `fn` at once, in the caller's thread, its result (or error)
    in the future it returns."""
    def submit(*args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # the caller sees it from future.result()
            future.set_exception(exc)
        return future
    return submit


def output_of(handle: Future) -> RunnerOutput:
    """The RunnerOutput of a launched step (raises what its launch raised)."""
    return handle.result().output()

