"""The engine: requests in, one scheduler step + one model step at a time, outputs out.

`add_request / abort_request / step` is the step-wise interface the daemon's scheduler
actor drives; `LLM.generate` loops over it for offline use.
"""
from __future__ import annotations

import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from llmd.builtin_model import builtin_model_path
from llmd.config import EngineConfig
from llmd.executor import Executor, ExecutorError, make_executor
from llmd.input_processor import InputProcessor
from llmd.kv_cache_manager import KVCacheManager
from llmd.load_progress import LoadProgress
from llmd.detokenizer.output_processor import OutputProcessor
from llmd.outputs import RequestOutput
from llmd.request import RequestStatus
from llmd.scheduler import Scheduler
from llmd.step_pipeline import StepPipeline, run_now
from llmd.structured_output import GrammarCompilerService, StructuredOutputManager
from llmd_client.protocol import SamplingParams

CPU_KV_DEFAULT_CAP = 4 << 30
logger = logging.getLogger("llmd.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: LoadProgress | None = None) -> None:
        """`progress` follows the load (the daemon shows it in status and as a bar)."""
        import torch

        from llmd.gpu.loader import load_hf_config, load_tokenizer, resolve_dtype, stop_token_ids
        from llmd.gpu.model_runner import RunnerSettings

        self.config = config
        # An HF directory or a GGUF file; none given: the built-in model (fetched once).
        model_dir = config.model or builtin_model_path()
        self.model_dir = str(model_dir)
        hf_config = load_hf_config(model_dir)
        _refuse_quantized(hf_config, self.model_dir)
        if config.tensor_parallel_size > 1:
            from llmd.gpu.tp import check_tp_config
            check_tp_config(hf_config, config.tensor_parallel_size)
        self._progress = progress
        if progress is not None:
            progress.begin("tokenizer")
        self.tokenizer = _tokenizer(load_tokenizer, config.tokenizer or self.model_dir)

        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA device is available")
        self.device = torch.device(device)
        checkpoint_dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", "") or "")
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype.replace("torch.", ""))

        max_pos = getattr(hf_config, "max_position_embeddings", 2048)
        self.max_model_len = config.max_model_len or max_pos
        if self.max_model_len > max_pos:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_pos}")
        self.vocab_size = hf_config.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        self.extra_stop_token_ids = stop_token_ids(self.model_dir) - {self.eos_token_id}

        spec = config.speculative_config
        draft_model = spec.draft_model if spec is not None and spec.method == "draft_model" else None
        if draft_model is not None:
            _check_draft_model(draft_model, hf_config, self.tokenizer, self.max_model_len)
        settings = RunnerSettings(block_size=config.block_size, max_model_len=self.max_model_len,
                                  valid_vocab_size=min(len(self.tokenizer), self.vocab_size),
                                  eos_token_id=self.eos_token_id, seed=config.seed,
                                  cpu_threads=config.cpu_threads, attention_backend=config.attention_backend,
                                  draft_model=draft_model,
                                  num_speculative_tokens=spec.num_speculative_tokens if draft_model else 0,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager)
        self._runner_settings = settings
        self.executor = self._make_executor()
        try:
            bytes_per_block = self.executor.kv_cache_bytes_per_block()
            self.num_blocks = self._num_kv_blocks(bytes_per_block)
            if progress is not None:  # on CUDA this also captures the decode graphs
                progress.begin("cuda graphs" if self.device.type == "cuda" else "kv cache")
            self.executor.initialize_kv_cache(self.num_blocks)
        except BaseException:  # no worker outlives a start that failed
            self.executor.shutdown()
            raise
        if progress is not None:
            progress.finish()
            self._progress = None  # a restarted executor does not report a load
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s); max_model_len %d",
                    self.num_blocks, config.block_size, self.num_blocks * config.block_size,
                    self.num_blocks * bytes_per_block / 2**20, self.dtype, self.max_model_len)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.structured = StructuredOutputManager(GrammarCompilerService(
            self.tokenizer, self.vocab_size, sorted({self.eos_token_id} - {None} | self.extra_stop_token_ids),
            timeout_s=config.guided_decoding_compile_timeout_s), max_rows=config.max_num_seqs)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.structured)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            max_logprobs=config.max_logprobs, eos_token_id=self.eos_token_id,
            extra_stop_token_ids=self.extra_stop_token_ids)
        self._ids = itertools.count()
        self._model_thread: ThreadPoolExecutor | None = None
        self._owns_model_thread = False
        submit = self._submit_step if config.async_scheduling else run_now(
            lambda so: self.executor.execute_model(so))
        # Chained steps: the executor launches step N+1 before reading N's tokens back.
        self._chained = config.async_scheduling and self.executor.supports_chaining
        self.pipeline = StepPipeline(self.scheduler, submit, overlap=config.async_scheduling,
                                     flush=self._submit_flush if self._chained else None)
        if config.async_scheduling and self.device.type == "cpu":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            per_rank = config.cpu_threads or cores // max(1, config.tensor_parallel_size)
            if per_rank * config.tensor_parallel_size >= cores:
                # Measured (docs/benchmarks.md): with every core in the model's OpenMP
                # teams, the overlapped scheduler work stalls their barriers.
                logger.warning("async_scheduling on CPU while the model uses all %d cores: the scheduler's "
                               "overlapped work competes with the model's threads and usually slows steps "
                               "down; set cpu_threads below the core count (or turn async_scheduling off)",
                               cores)

    def _make_executor(self) -> Executor:
        return make_executor(self.config, self.model_dir, self._runner_settings, self.device, self.dtype,
                             progress=self._progress)

    def recover_from_executor_failure(self, cause: str) -> list[str]:
        """After the executor failed: fail what ran on it, start a fresh one (see
        fail_in_flight and restart_executor). The offline engine's whole recovery; the
        daemon's scheduler actor calls the two halves itself, backing off between tries."""
        failed = self.fail_in_flight(cause)
        self.restart_executor()
        return failed

    def fail_in_flight(self, cause: str) -> list[str]:
        """After the executor failed (a worker died or hung): finish the requests that
        ran on it with finish_reason "error" (waiting ones never reached it and stay
        queued for the next executor), forget the prefix cache (new workers start with
        an empty KV cache) and shut the failed executor down. Returns the scheduler ids
        of the failed requests."""
        logger.error("executor failed: %s; failing %d running request(s)", cause, len(self.scheduler.running))
        # A step launched behind the failed one runs (and fails) on the old executor
        # before the new one exists: no step may reach the new workers mid-start.
        self.pipeline.drain(ignore=Exception)
        failed = [r.request_id for r in self.scheduler.running]
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        self.kv_cache_manager.reset_prefix_cache()
        try:
            self.executor.shutdown()
        except Exception:  # the old one is broken; what matters is the new one
            logger.exception("shutting down the failed executor")
        return failed

    def restart_executor(self) -> None:
        """Start a fresh executor with a KV cache of the same size. Raises (an
        ExecutorError when a worker fails to start or dies meanwhile) leaving no new
        worker running and the failed executor in place."""
        executor = self._make_executor()
        try:
            executor.initialize_kv_cache(self.num_blocks)
        except BaseException:
            executor.shutdown()
            raise
        self.executor = executor

    # -- sizing ---------------------------------------------------------------------
    def _num_kv_blocks(self, bytes_per_block: int) -> int:
        """num_gpu_blocks_override, else kv_cache_memory_bytes, else on CUDA what the
        workers' memory profile leaves (the tightest rank), on CPU a share of free RAM."""
        cfg = self.config
        bs = cfg.block_size
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        else:
            if cfg.kv_cache_memory_bytes is not None:
                num_blocks = cfg.kv_cache_memory_bytes // bytes_per_block
            elif self.device.type == "cpu":
                num_blocks = self._cpu_default_blocks(bytes_per_block)
            else:
                num_blocks = self._profiled_cuda_blocks()
            if num_blocks < 1:
                raise ValueError(f"not enough memory for one KV cache block ({bytes_per_block} bytes); "
                                 "raise kv_cache_memory_bytes or gpu_memory_utilization")
            # Never more than every sequence slot at full length could use.
            num_blocks = min(num_blocks, cfg.max_num_seqs * (-(-self.max_model_len // bs)) + 1)
        if num_blocks * bs < self.max_model_len:
            raise ValueError(f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}), "
                             f"less than max_model_len {self.max_model_len}: lower max_model_len or give "
                             "the cache more memory")
        return num_blocks

    def _cpu_default_blocks(self, bytes_per_block: int) -> int:
        """What max_num_seqs sequences of max_model_len tokens need, capped by a share of
        the free RAM and CPU_KV_DEFAULT_CAP. The cache's pages become resident only as
        blocks are written, so the cap bounds growth rather than costing it at start."""
        cfg = self.config
        need = (cfg.max_num_seqs * (-(-self.max_model_len // cfg.block_size)) + 1) * bytes_per_block
        share = int(psutil.virtual_memory().available * cfg.cpu_kv_cache_fraction)
        budget = min(need, share, CPU_KV_DEFAULT_CAP)
        why = ("what max_num_seqs x max_model_len need" if budget == need else
               f"cpu_kv_cache_fraction {cfg.cpu_kv_cache_fraction:g} of the available RAM" if budget == share else
               f"the CPU default cap of {CPU_KV_DEFAULT_CAP >> 30} GiB")
        logger.info("CPU KV cache: %.0f MiB, %s (max_num_seqs %d x max_model_len %d would use %.0f MiB); "
                    "kv_cache_memory_bytes or num_gpu_blocks_override set it", budget / 2**20, why,
                    cfg.max_num_seqs, self.max_model_len, need / 2**20)
        return budget // bytes_per_block

    def _profiled_cuda_blocks(self) -> int:
        """Every rank profiles the largest step on its own device (in the worker: this
        process makes no CUDA context for it in mp mode); the engine takes the rank with
        the fewest blocks, since all ranks' caches hold the same block ids."""
        breakdowns = self.executor.profile_kv_budget(self.config.gpu_memory_utilization)
        rank = min(range(len(breakdowns)), key=lambda r: breakdowns[r].num_blocks)
        where = f"rank {rank} of {len(breakdowns)}, the tightest" if len(breakdowns) > 1 else "profiled"
        logger.info("CUDA memory (%s): %s", where, breakdowns[rank].describe())
        # The runner allocates one block more than the pool's: the scratch block that
        # padded rows of CUDA-graph steps use (cuda_graphs). It comes out of the budget.
        return breakdowns[rank].num_blocks - 1

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises ValueError on bad input, with nothing queued."""
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prepared = self.input_processor.prepare(request_id, prompt, params or SamplingParams(),
                                                priority=priority, cache_salt=cache_salt)
        self.output_processor.add_request(request_id, prepared.prompt, prepared.token_ids,
                                          prepared.params, prepared.child_ids)
        for child in prepared.children:
            self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            children = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.abort(request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step = self.pipeline.start()
        if step is None:
            failed = self.scheduler.take_pending_updates()
            if failed:
                return self.output_processor.process(failed, {})[0]
            if self.scheduler.has_schedulable_requests():
                raise RuntimeError("scheduler made no progress with requests pending")
            if self.scheduler.waiting_for_grammar:
                self.structured.wait([r.grammar for r in self.scheduler.waiting_for_grammar],
                                     self.scheduler.grammar_deadline())
            return []
        try:
            runner_output = step.future.result()
        except ExecutorError as exc:
            failed = self.recover_from_executor_failure(str(exc))
            # A request fails whole: its samples that were still waiting end too.
            parents = {self.output_processor.parent_of.get(c) for c in failed} - {None}
            outputs = []
            for rid in sorted(parents):
                self.scheduler.finish_requests(self.output_processor.child_ids(rid), RequestStatus.FINISHED_ERROR)
                out = self.output_processor.abort(rid, "error", error=f"{exc}; the request was lost")
                if out is not None:
                    outputs.append(out)
            return outputs
        step, updates = self.pipeline.finish(runner_output)
        outputs, stopped = self.output_processor.process(updates, step.num_cached)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def use_model_thread(self, pool: ThreadPoolExecutor) -> None:
        """Run every step on `pool`, whatever the scheduling (the daemon's model thread,
        which loaded the model: one OpenMP team for all torch work)."""
        self._model_thread, self._owns_model_thread = pool, False
        self.pipeline.submit = self._submit_step

    def _on_model_thread(self, fn):
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
            self._owns_model_thread = True
        return self._model_thread.submit(fn)

    def _submit_step(self, scheduler_output):
        """Run the step on the model thread. The executor is looked up when the step
        starts: a failed one is replaced."""
        if self._chained:
            return self._on_model_thread(lambda: self.executor.execute_model_chained(scheduler_output))
        return self._on_model_thread(lambda: self.executor.execute_model(scheduler_output))

    def _submit_flush(self):
        return self._on_model_thread(lambda: self.executor.flush())

    def shutdown(self) -> None:
        """Stop the executor (worker processes exit) and drop the KV cache."""
        self.pipeline.drain(ignore=ExecutorError)  # a step whose requests all finished may still run
        if self._model_thread is not None and self._owns_model_thread:
            self._model_thread.shutdown(wait=True)
        self._model_thread = None
        self.executor.shutdown()
        self.structured.shutdown()

    def get_stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        stats = kv.prefix_cache_stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.stats.num_preemptions_total,
            "kv_usage": kv.usage,
            "num_blocks": self.num_blocks,
            "prefix_cache_queries": stats.queries,
            "prefix_cache_hits": stats.hits,
            "prefix_cache_hit_rate": stats.hit_rate,
        }


def _check_draft_model(draft_dir: str, target_config, target_tokenizer, max_model_len: int) -> None:
    """A draft model must share the target's vocabulary (the same logit width, the same
    tokens under the same ids, the same EOS) and reach max_model_len."""
    from llmd.gpu.loader import load_hf_config, load_tokenizer

    what = f"speculative_config.draft_model {draft_dir!r}"
    if not Path(draft_dir).is_dir():
        raise ValueError(f"{what} is not a directory")
    try:
        draft_config = load_hf_config(draft_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: {exc}") from None
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{what} has vocab size {draft_config.vocab_size}, the target model "
                         f"{target_config.vocab_size}: a draft model must share the target's vocabulary")
    draft_max_pos = getattr(draft_config, "max_position_embeddings", 2048)
    if draft_max_pos < max_model_len:
        raise ValueError(f"{what} has max_position_embeddings {draft_max_pos}, less than max_model_len "
                         f"{max_model_len}")
    try:
        tokenizer = load_tokenizer(draft_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot load its tokenizer ({exc})") from None
    for name, draft_value, target_value in (("tokenizer size", len(tokenizer), len(target_tokenizer)),
                                            ("eos token id", tokenizer.eos_token_id, target_tokenizer.eos_token_id)):
        if draft_value != target_value:
            raise ValueError(f"{what} has {name} {draft_value}, the target model {target_value}: "
                             "a draft model must share the target's tokenizer")
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"{what}: its tokenizer maps tokens to other ids than the target's: "
                         "a draft model must share the target's tokenizer")


def _refuse_quantized(hf_config: Any, model_dir: str) -> None:
    """A checkpoint quantized for another engine (FP8, GPTQ, AWQ, bitsandbytes...) has
    scale tensors llmd's loader does not know: say what it is, not which tensor surprised us."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", None)
        raise ValueError(f"{model_dir} is a {method or 'quantized'} checkpoint (quantization_config."
                         "quant_method); llmd loads unquantized safetensors (float32, bfloat16, float16) "
                         "and GGUF files")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _tokenizer(load, path: str):
    """The tokenizer, or an error that says where it was looked for and what to do."""
    if Path(path).is_dir() and not any((Path(path) / name).exists() for name in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {path} (none of {', '.join(_TOKENIZER_FILES)}); "
                         "copy the model's tokenizer files there or give --tokenizer DIR")
    try:
        return load(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load the tokenizer in {path}: {first_line[:200]}") from None
