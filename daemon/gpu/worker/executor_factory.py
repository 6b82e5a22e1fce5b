"""The executor the engine settings ask for (see llmd.core.executor for the protocol)."""
from __future__ import annotations

import torch

from llmd.config import EngineConfig
from llmd.core.executor import Executor
from llmd.gpu.worker.inprocess_executor import InProcessExecutor
from llmd.gpu.worker.mp_executor import MultiprocExecutor
from llmd.gpu.worker.runner_types import RunnerSettings
from llmd.load_progress import LoadProgress


def make_executor(config: EngineConfig, model_dir: str, settings: RunnerSettings, device: torch.device,
                  dtype: torch.dtype, progress: LoadProgress | None = None) -> Executor:
    """The executor the settings ask for: worker processes ("mp", one per TP rank) or
    the model in this process."""
    if config.distributed_executor_backend == "mp":
        if progress is not None:  # the workers load the weights, unseen from here
            progress.begin("workers")
        return MultiprocExecutor(model_dir, settings, device, dtype, world_size=config.tensor_parallel_size,
                                 step_deadline=config.step_deadline_s,
                                 cancelled=progress.cancelled if progress is not None else None)
    return InProcessExecutor(model_dir, settings, device, dtype, progress=progress)
