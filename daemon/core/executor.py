"""What the engine asks of whatever runs the model, and how it gets one.

An executor runs SchedulerOutputs on the model: `execute_model` returns a StepHandle per
step, whose `output()` is the step's RunnerOutput. Two exist,
both in daemon/gpu (they hold torch): `InProcessExecutor` calls the model runner in this
process (offline engine, tests, debugging); `MultiprocExecutor` drives one worker
process per device (tensor parallelism; the daemon's default). `make_executor` picks
one from the engine settings (gpu/worker/executor_factory.py); the engine sees only the `Executor`
protocol. This module imports no torch, so the scheduler side can catch ExecutorError
without it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llmd.core.step_messages import GrammarRows, RunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """An executor could not run a step (a worker failed or died). The message names
    the cause (which worker, its exit code or exception)."""


class StepHandle(Protocol):
    """A launched step (vLLM's AsyncModelRunnerOutput): its output is read when asked
    for, which may wait for the device. Outputs are asked for in launch order."""

    def output(self) -> RunnerOutput:
        """The step's RunnerOutput; raises ExecutorError when the executor failed."""


class Executor(Protocol):
    """Steps run in the order they are launched, one at a time. One step contract:
    execute_model launches a step and returns its handle at once or after the step ran
    (whichever the executor can do); a step launched before the output of the one before
    was read takes that one's tokens on the device. How many steps are in flight is the
    engine's choice (StepPipeline), not the executor's."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes on every rank (all layers, K and V)."""

    def weight_bytes(self) -> dict[str, int]:
        """The weights' bytes on all ranks, by how they are kept: a packed GGUF type,
        a dense dtype, "onednn" for CPU linears' reordered copies."""

    def kv_scale_source(self) -> str:
        """Where a quantized KV cache's scales come from: "checkpoint" or "calibrated";
        "" for a float cache."""

    def worker_pids(self) -> list[int]:
        """The worker processes holding the model (none when it is in this process)."""

    def profile_kv_budget(self, gpu_memory_utilization: float) -> list[Any]:
        """CUDA: one MemoryBreakdown per rank from profiling the largest step."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache (and on CUDA capture the decode graphs)."""

    def sleep(self, level: int) -> None:
        """Free the KV cache (and the decode graphs); level 1 keeps the weights (on CUDA
        in pinned host memory), level 2 drops them. No step runs until wake_up."""

    def wake_up(self) -> None:
        """Restore the weights (level 2: from the files) and the KV cache at its size,
        capturing the decode graphs again."""

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_rows: GrammarRows | None = None) -> StepHandle:
        """Launch one step; `grammar_rows` (required when the step has grammar_req_ids)
        are waited for just before sampling. Raises ExecutorError when the executor
        failed."""

    def exit_fds(self) -> list[int]:
        """Descriptors that become readable when a worker process exits (none in process)."""

    def exit_cause(self) -> str | None:
        """Why a worker exited, once one has."""

    def shutdown(self) -> None:
        """Stop the workers and free the KV cache. Safe on a failed executor."""
