"""The offline engine: requests in, one scheduler step + one model step at a time,
outputs out. `LLM.generate` loops over `add_request / abort_request / step`.

The loop itself is EngineCore's (shared with the daemon's scheduler actor); this class
adds what the offline API needs around it: loading (engine_setup), token ids from
prompts (InputProcessor) and RequestOutputs from token updates (OutputProcessor), which
in the daemon the intake and detokenizer actors do.
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from llmd.config import EngineConfig, resolved_kv_cache_dtype
from llmd.detokenizer.output_processor import OutputProcessor
from llmd.core.engine_core import EngineCore, Idle
from llmd.engine_setup import num_kv_blocks, prepare_model
from llmd.core.executor import Executor, ExecutorError
from llmd.input_processor import InputProcessor
from llmd.load_progress import LoadProgress
from llmd.outputs import EmbeddingRequestOutput, RequestOutput
from llmd.core.request import RequestStatus
from llmd.structured_output import GrammarCompilerService, StructuredOutputManager
from llmd_client.protocol import PoolingParams, SamplingParams

logger = logging.getLogger("llmd.engine")


class _CoreAttribute:
    """An attribute of the engine's EngineCore, read through the engine."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: LLMEngine | None, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine.core, self.name)


@dataclass(frozen=True)
class ModelMemory:
    """LLMEngine.memory: bytes of the weights (by how they are kept, every rank), of the
    KV pool and of one block, and the worker processes' ids (none: in this process)."""

    weights: dict[str, int]
    kv_cache: int
    bytes_per_block: int
    worker_pids: list[int]
    # 1 or 2 while asleep: no KV pool; the weights at level 1 in host memory (pinned, for
    # a CUDA model), at level 2 none.
    sleep_level: int | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: LoadProgress | None = None) -> None:
        """`progress` follows the load (the daemon shows it in status and as a bar)."""
        setup = prepare_model(config, progress)
        # The settings as they run: the pooling type resolved from the model's files.
        self.config = config = msgspec.structs.replace(config, pooling_type=setup.pooling.pooling_type)
        self.pooling = setup.pooling
        self.model_dir, self.tokenizer = setup.model_dir, setup.tokenizer
        self.device, self.dtype, self.max_model_len = setup.device, setup.dtype, setup.max_model_len
        self.vocab_size, self.eos_token_id = setup.vocab_size, setup.eos_token_id
        self.extra_stop_token_ids = setup.extra_stop_token_ids
        self._runner_settings = setup.runner_settings
        self._progress = progress
        executor = self._make_executor()
        # What the KV cache stores per element: the model's dtype, or a quantized format.
        self.kv_cache_dtype = resolved_kv_cache_dtype(config.kv_cache_dtype, str(self.dtype).removeprefix("torch."))
        self.num_blocks = self._start_kv_cache(executor, progress)
        self._progress = None  # a restarted executor does not report a load
        structured = StructuredOutputManager(GrammarCompilerService(
            self.tokenizer, self.vocab_size, sorted({self.eos_token_id} - {None} | self.extra_stop_token_ids),
            timeout_s=config.guided_decoding_compile_timeout_s),
            fill_beside_forward=self.device.type != "cpu")  # a CPU model's threads hold the cores
        self.core = EngineCore(config, executor, self._make_executor, self.num_blocks, structured)
        from llmd.gpu.models.gguf_loader import release_gguf_readers

        release_gguf_readers()  # a GGUF's metadata was read (config, tokenizer, summary); the weights are loaded
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            max_logprobs=config.max_logprobs, eos_token_id=self.eos_token_id,
            extra_stop_token_ids=self.extra_stop_token_ids, task=config.task, pooling=setup.pooling)
        self._ids = itertools.count()
        if config.async_scheduling and self.device.type == "cpu":
            _warn_if_scheduler_competes_for_cores(config)

    def _make_executor(self) -> Executor:
        from llmd.gpu.worker.executor_factory import make_executor  # torch: loaded with the model, not with this module

        return make_executor(self.config, self.model_dir, self._runner_settings, self.device, self.dtype,
                             progress=self._progress)

    def _start_kv_cache(self, executor: Executor, progress: LoadProgress | None) -> int:
        """Size the KV cache and allocate it (on CUDA this also captures the decode
        graphs); no worker outlives a start that failed."""
        try:
            num_blocks = num_kv_blocks(self.config, self.max_model_len, self.device.type, executor)
            if progress is not None:
                progress.begin("cuda graphs" if self.device.type == "cuda" else "kv cache")
            executor.initialize_kv_cache(num_blocks)
        except BaseException:
            executor.shutdown()
            raise
        if progress is not None:
            progress.finish()
        bytes_per_block = executor.kv_cache_bytes_per_block()
        self.kv_cache_scales = scales = executor.kv_scale_source()  # "checkpoint", "calibrated" or "" (float)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s%s); max_model_len %d",
                    num_blocks, self.config.block_size, num_blocks * self.config.block_size,
                    num_blocks * bytes_per_block / 2**20, self.kv_cache_dtype,
                    f", {scales} scales" if scales else "", self.max_model_len)
        return num_blocks

    # What tests and tools look at; the core owns them.
    scheduler = _CoreAttribute()
    kv_cache_manager = _CoreAttribute()
    pipeline = _CoreAttribute()
    structured = _CoreAttribute()
    executor = _CoreAttribute()

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, truncate: bool = False) -> str:
        """Queue a prompt (text or token ids): to generate from (SamplingParams), or to
        embed (PoolingParams; `truncate`: keep the first tokens that fit the context).
        Raises ValueError on bad input, with nothing queued."""
        if request_id is None:
            request_id = str(next(self._ids))
        if self.output_processor.knows(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.core.sleep_level is not None:
            raise RuntimeError("the engine is asleep: call wake_up() before adding requests")
        if isinstance(params, PoolingParams):
            prepared = self.input_processor.prepare_pooling(request_id, prompt, params, truncate=truncate,
                                                            priority=priority, cache_salt=cache_salt)
        else:
            prepared = self.input_processor.prepare(request_id, prompt, params or SamplingParams(),
                                                    priority=priority, cache_salt=cache_salt)
        self.output_processor.add_request(request_id, prepared.prompt, prepared.token_ids,
                                          prepared.params, prepared.child_ids)
        self.core.add_requests(prepared.children)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput | EmbeddingRequestOutput]:
        return self._end_requests([request_ids] if isinstance(request_ids, str) else request_ids,
                                  RequestStatus.FINISHED_ABORTED)

    def _end_requests(self, request_ids: list[str], status: RequestStatus, error: str | None = None
                      ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """End client requests whole (all their samples), with their final outputs."""
        outputs = []
        for request_id in request_ids:
            self.core.finish(self.output_processor.child_ids(request_id), status)
            out = self.output_processor.abort(request_id, status.finish_reason, error=error)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        begun = self.core.begin_step()
        if isinstance(begun, Idle):
            if not begun.updates:
                self.core.wait_for_grammars(begun)
            return self.output_processor.process(begun.updates, {})[0]
        try:
            runner_output = begun.future.result()
        except ExecutorError as exc:
            failed = self.recover_from_executor_failure(str(exc))
            # A request fails whole: its samples that were still waiting end too.
            parents = {self.output_processor.parent_of.get(c) for c in failed} - {None}
            return self._end_requests(sorted(parents), RequestStatus.FINISHED_ERROR,
                                      error=f"{exc}; the request was lost")
        result = self.core.end_step(runner_output)
        outputs, stopped = self.output_processor.process(result.updates, result.step.num_cached)
        if stopped:
            self.core.finish(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def recover_from_executor_failure(self, cause: str) -> list[str]:
        """After the executor failed: fail what ran on it, start a fresh one. The offline
        engine's whole recovery; the daemon's scheduler actor calls the two halves
        itself, backing off between tries."""
        failed = self.core.fail_in_flight(cause)
        self.core.restart_executor()
        return failed

    def shutdown(self) -> None:
        """Stop the executor (worker processes exit) and drop the KV cache."""
        self.core.shutdown(ignore=ExecutorError)

    # -- sleep mode (vLLM's LLM.sleep / wake_up) ------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give the model's memory back until wake_up: level 1 frees the KV cache and
        keeps the weights (on CUDA copied to pinned host memory, the device's freed; on
        CPU where they are), level 2 drops the weights too (wake_up reads them from the
        files again). Only with no request unfinished (RuntimeError otherwise)."""
        self.core.sleep(level)

    def wake_up(self) -> None:
        """Restore what sleep freed: the weights, the KV cache (empty: the prefix cache
        starts afresh) and on CUDA the decode graphs, captured again."""
        self.core.wake_up()

    @property
    def sleep_level(self) -> int | None:
        """1 or 2 while asleep, None while awake."""
        return self.core.sleep_level

    def memory(self) -> ModelMemory:
        """The weights' bytes by how they are kept, the KV pool's, and the processes
        holding them (the executor's now: a restarted one has new workers); while
        asleep, what is still held (no KV pool; at level 2 no weights)."""
        executor = self.core.executor
        level = self.core.sleep_level
        return ModelMemory({} if level == 2 else executor.weight_bytes(),
                           0 if level is not None else self.num_blocks * executor.kv_cache_bytes_per_block(),
                           executor.kv_cache_bytes_per_block(), executor.worker_pids(), level)

    def get_stats(self) -> dict[str, Any]:
        stats = self.core.stats()
        prefix = self.kv_cache_manager.prefix_cache_stats
        return {
            "num_running": len(stats.running_ids),
            "num_waiting": stats.num_waiting,
            "num_preemptions": stats.num_preemptions_total,
            "kv_usage": self.kv_cache_manager.usage,
            "num_blocks": self.num_blocks,
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "prefix_cache_hit_rate": prefix.hit_rate,
        }


def _warn_if_scheduler_competes_for_cores(config: EngineConfig) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_rank = config.cpu_threads or cores // max(1, config.tensor_parallel_size)
    if per_rank * config.tensor_parallel_size >= cores:
        # Measured (docs/benchmarks.md): with every core in the model's OpenMP
        # teams, the overlapped scheduler work stalls their barriers.
        logger.warning("async_scheduling on CPU while the model uses all %d cores: the scheduler's "
                       "overlapped work competes with the model's threads and usually slows steps "
                       "down; set cpu_threads below the core count (or turn async_scheduling off)",
                       cores)
