"""Executors run SchedulerOutputs on the model. The in-process one calls the runner
directly (offline engine, tests, debugging); worker processes are behind the same methods
(mp_executor.py). Here the runner waits for a step's grammar rows on the thread that
fills them (GrammarRows.wait)."""
from __future__ import annotations

import torch

from llmd.gpu.worker.kv_budget import MemoryBreakdown
from llmd.gpu.worker.model_runner import ModelRunner
from llmd.gpu.worker.runner_types import RunnerSettings, StepHandle
from llmd.load_progress import LoadProgress
from llmd.core.step_messages import GrammarRows, SchedulerOutput


class InProcessExecutor:
    def __init__(self, model_dir: str, settings: RunnerSettings, device: torch.device,
                 dtype: torch.dtype, progress: LoadProgress | None = None) -> None:
        self.runner = ModelRunner(model_dir, settings, device, dtype, progress=progress)
        self._weight_bytes = self.runner.weight_bytes()  # fixed once loaded; status asks often
        self._bytes_per_block = self.runner.kv_cache_bytes_per_block()  # asked while asleep too

    def kv_cache_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def weight_bytes(self) -> dict[str, int]:
        return dict(self._weight_bytes)

    def kv_scale_source(self) -> str:
        return self.runner.kv_scale_source()

    def worker_pids(self) -> list[int]:
        """None: the model is in this process (its memory is this process's)."""
        return []

    def profile_kv_budget(self, gpu_memory_utilization: float,
                          extra_reserved_bytes: int = 0) -> list[MemoryBreakdown]:
        """CUDA: one breakdown (one rank), as MultiprocExecutor gives one per rank."""
        return [self.runner.profile_kv_budget(gpu_memory_utilization, extra_reserved_bytes)]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self) -> None:
        self.runner.wake_up()

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_rows: GrammarRows | None = None) -> StepHandle:
        """Launch the step; its output from the handle (see ModelRunner.execute_model)."""
        return self.runner.execute_model(scheduler_output, grammar_rows)

    def exit_fds(self) -> list[int]:
        """No worker process to watch: the model runs in this one."""
        return []

    def exit_cause(self) -> str | None:
        return None

    def shutdown(self) -> None:
        self.runner.release_kv_cache()
