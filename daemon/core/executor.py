"""What the engine asks of whatever runs the model, and how it gets one.

An executor runs SchedulerOutputs on the model and returns RunnerOutputs. Two exist,
both in daemon/gpu (they hold torch): `InProcessExecutor` calls the model runner in this
process (offline engine, tests, debugging); `MultiprocExecutor` drives one worker
process per device (tensor parallelism; the daemon's default). `make_executor` picks
one from the engine settings (gpu/worker/executors.py); the engine sees only the `Executor`
protocol. This module imports no torch, so the scheduler side can catch ExecutorError
without it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llmd.core.step_messages import RunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """An executor could not run a step (a worker failed or died). The message names
    the cause (which worker, its exit code or exception)."""


class Executor(Protocol):
    """Steps run in the order they are submitted, one at a time."""

    supports_chaining: bool
    """True when execute_model_chained/flush may be used: the executor launches step
    N+1 before it reads step N's tokens back (see ModelRunner.execute_model_chained)."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes on every rank (all layers, K and V)."""

    def profile_kv_budget(self, gpu_memory_utilization: float) -> list[Any]:
        """CUDA: one MemoryBreakdown per rank from profiling the largest step."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache (and on CUDA capture the decode graphs)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step; raises ExecutorError when the executor failed."""

    def execute_model_chained(self, scheduler_output: SchedulerOutput) -> RunnerOutput | None:
        """Launch this step; return the output of the one launched before (None first)."""

    def flush(self) -> RunnerOutput | None:
        """The output of the last chained step, when nothing follows it."""

    def exit_fds(self) -> list[int]:
        """Descriptors that become readable when a worker process exits (none in process)."""

    def exit_cause(self) -> str | None:
        """Why a worker exited, once one has."""

    def shutdown(self) -> None:
        """Stop the workers and free the KV cache. Safe on a failed executor."""
