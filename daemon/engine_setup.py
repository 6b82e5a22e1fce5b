"""What the engine settles before it serves: the model's config and tokenizer (with
clear refusals of what llmd cannot run), the device, dtype and length limits, the
settings the model runner gets, and how many KV cache blocks fit. No torch at import."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from llmd.builtin_model import builtin_model_path
from llmd.config import EngineConfig
from llmd.core.executor import Executor
from llmd.load_progress import LoadProgress
from llmd.pooling_config import PoolingConfig, resolve_pooling

CPU_KV_DEFAULT_CAP = 4 << 30
logger = logging.getLogger("llmd.engine")


@dataclass
class ModelSetup:
    """The model as the engine runs it. `runner_settings` is the runner's RunnerSettings."""

    model_dir: str
    tokenizer: Any
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    extra_stop_token_ids: set[int]
    runner_settings: Any
    pooling: PoolingConfig  # how embeddings pool its hidden states


def prepare_model(config: EngineConfig, progress: LoadProgress | None = None) -> ModelSetup:
    """Read the model's config and tokenizer, resolve device and dtype, check limits."""
    import torch

    from llmd.gpu.models.gguf_loader import is_gguf_path
    from llmd.gpu.models.gguf_summary import gguf_summary
    from llmd.gpu.models.loader import load_hf_config, load_tokenizer, resolve_dtype, stop_token_ids

    # An HF directory or a GGUF file; none given: the built-in model (fetched once).
    model_dir = str(config.model or builtin_model_path())
    hf_config = load_hf_config(model_dir)
    if config.tensor_parallel_size > 1:
        from llmd.gpu.layers.tp import check_tp_config
        check_tp_config(hf_config, config.tensor_parallel_size)
    if progress is not None:
        progress.begin("tokenizer")
    tokenizer = _tokenizer(load_tokenizer, config.tokenizer or model_dir)
    if is_gguf_path(model_dir):
        gguf_summary(model_dir)  # kept for the model listings; the file's reader is released after the load
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    device = torch.device(device)
    _check_quantized_device(hf_config, model_dir, device, config.dequantize)
    checkpoint_dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", "") or "")
    checkpoint_dtype = checkpoint_dtype.replace("torch.", "")
    dtype = resolve_dtype(config.dtype, device, checkpoint_dtype)
    if config.dtype == "auto" and device.type == "cpu" and checkpoint_dtype == "float16":
        logger.info("float16 weights run in float32 on CPU (twice their size: CPU float16 matmuls are slow and "
                    "lossy); --dtype bfloat16 halves them, each weight rounded to bfloat16")
    _check_kv_cache_dtype(config.kv_cache_dtype, dtype)
    max_pos = getattr(hf_config, "max_position_embeddings", 2048)
    max_model_len = config.max_model_len or max_pos
    if max_model_len > max_pos:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}")
    eos = tokenizer.eos_token_id
    pooling = _pooling(config, model_dir, hf_config)
    return ModelSetup(model_dir, tokenizer, device, dtype, max_model_len, hf_config.vocab_size, eos,
                      stop_token_ids(model_dir) - {eos},
                      _runner_settings(config, hf_config, tokenizer, max_model_len, pooling), pooling)


def _check_kv_cache_dtype(kv_cache_dtype: str, dtype: Any) -> None:
    """A float16 / bfloat16 cache is the model's own dtype or narrows a float32 model's
    K/V (what the CPU kernels read); one 16-bit float cache under another is refused."""
    import torch

    from llmd.config import KV_CACHE_FLOATS

    name = str(dtype).removeprefix("torch.")
    if kv_cache_dtype in KV_CACHE_FLOATS and dtype != torch.float32 and kv_cache_dtype != name:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} with dtype {name!r}: a float cache of another width "
                         "is for float32 models (use 'auto' to keep the model's dtype)")


def _pooling(config: EngineConfig, model_dir: str, hf_config: Any) -> PoolingConfig:
    """The model's pooling for embeddings. A sentence-transformers pipeline with modules
    llmd does not run (a Dense projection after the pooling) is refused when the model
    is served for embeddings; a generation model only says so in the log."""
    pooling = resolve_pooling(model_dir, hf_config, config.pooling_type, config.matryoshka_dimensions)
    if pooling.unsupported_modules:
        what = (f"the model's sentence-transformers pipeline has modules llmd does not run "
                f"({', '.join(pooling.unsupported_modules)}): its embeddings are the pooled hidden states "
                "without them")
        if config.task == "embed":
            raise ValueError(f"task embed: {what}")
        logger.warning("%s", what)
    logger.info("embeddings pool %s hidden states (%s)", pooling.pooling_type, pooling.source)
    return pooling


def _runner_settings(config: EngineConfig, hf_config: Any, tokenizer: Any, max_model_len: int,
                     pooling: PoolingConfig) -> Any:
    from llmd.gpu.worker.runner_types import RunnerSettings

    spec = config.speculative_config
    draft_model = spec.draft_model if spec is not None and spec.method == "draft_model" else None
    if draft_model is not None:
        _check_draft_model(draft_model, hf_config, tokenizer, max_model_len)
    return RunnerSettings(block_size=config.block_size, max_model_len=max_model_len,
                          valid_vocab_size=min(len(tokenizer), hf_config.vocab_size),
                          eos_token_id=tokenizer.eos_token_id, seed=config.seed,
                          cpu_threads=config.cpu_threads, attention_backend=config.attention_backend,
                          kv_cache_dtype=config.kv_cache_dtype,
                          dequantize=config.dequantize, cpu_int8_activations=config.cpu_int8_activations,
                          draft_model=draft_model,
                          num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                          max_num_batched_tokens=config.max_num_batched_tokens,
                          max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager,
                          pooling_type=pooling.pooling_type)


def num_kv_blocks(config: EngineConfig, max_model_len: int, device_type: str, executor: Executor) -> int:
    """num_gpu_blocks_override, else kv_cache_memory_bytes, else on CUDA what the
    workers' memory profile leaves (the tightest rank), on CPU a share of free RAM."""
    cfg = config
    bs = cfg.block_size
    bytes_per_block = executor.kv_cache_bytes_per_block()
    if cfg.num_gpu_blocks_override is not None:
        num_blocks = cfg.num_gpu_blocks_override
    else:
        if cfg.kv_cache_memory_bytes is not None:
            num_blocks = cfg.kv_cache_memory_bytes // bytes_per_block
        elif device_type == "cpu":
            num_blocks = _cpu_default_blocks(cfg, max_model_len, bytes_per_block)
        else:
            num_blocks = _profiled_cuda_blocks(cfg, executor)
        if num_blocks < 1:
            raise ValueError(f"not enough memory for one KV cache block ({bytes_per_block} bytes); "
                             "raise kv_cache_memory_bytes or gpu_memory_utilization")
        # Never more than every sequence slot at full length could use.
        num_blocks = min(num_blocks, cfg.max_num_seqs * (-(-max_model_len // bs)) + 1)
    if num_blocks * bs < max_model_len:
        raise ValueError(f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}), "
                         f"less than max_model_len {max_model_len}: lower max_model_len or give "
                         "the cache more memory")
    return num_blocks

def _cpu_default_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """What max_num_seqs sequences of max_model_len tokens need, capped by a share of
    the free RAM and CPU_KV_DEFAULT_CAP. The cache's pages become resident only as
    blocks are written, so the cap bounds growth rather than costing it at start."""
    cfg = config
    need = (cfg.max_num_seqs * (-(-max_model_len // cfg.block_size)) + 1) * bytes_per_block
    share = int(psutil.virtual_memory().available * cfg.cpu_kv_cache_fraction)
    budget = min(need, share, CPU_KV_DEFAULT_CAP)
    why = ("what max_num_seqs x max_model_len need" if budget == need else
           f"cpu_kv_cache_fraction {cfg.cpu_kv_cache_fraction:g} of the available RAM" if budget == share else
           f"the CPU default cap of {CPU_KV_DEFAULT_CAP >> 30} GiB")
    logger.info("CPU KV cache: %.0f MiB, %s (max_num_seqs %d x max_model_len %d would use %.0f MiB); "
                "kv_cache_memory_bytes or num_gpu_blocks_override set it", budget / 2**20, why,
                cfg.max_num_seqs, max_model_len, need / 2**20)
    return budget // bytes_per_block

def _profiled_cuda_blocks(config: EngineConfig, executor: Executor) -> int:
    """Every rank profiles the largest step on its own device (in the worker: this
    process makes no CUDA context for it in mp mode); the engine takes the rank with
    the fewest blocks, since all ranks' caches hold the same block ids."""
    breakdowns = executor.profile_kv_budget(config.gpu_memory_utilization)
    rank = min(range(len(breakdowns)), key=lambda r: breakdowns[r].num_blocks)
    where = f"rank {rank} of {len(breakdowns)}, the tightest" if len(breakdowns) > 1 else "profiled"
    logger.info("CUDA memory (%s): %s", where, breakdowns[rank].describe())
    # The runner allocates one block more than the pool's: the scratch block that
    # padded rows of CUDA-graph steps use (cuda_graphs). It comes out of the budget.
    return breakdowns[rank].num_blocks - 1


def _check_draft_model(draft_dir: str, target_config, target_tokenizer, max_model_len: int) -> None:
    """A draft model must share the target's vocabulary (the same logit width, the same
    tokens under the same ids, the same EOS) and reach max_model_len."""
    from llmd.gpu.models.loader import load_hf_config, load_tokenizer

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


def _check_quantized_device(hf_config: Any, model_dir: str, device: Any, dequantize: bool) -> None:
    """AWQ, GPTQ and FP8 checkpoints (and GGUF files) run packed on the CPU (C++ kernels)
    and on CUDA (Triton kernels, which need the triton package); elsewhere they load only
    with dequantize=True, never dequantized unasked."""
    import importlib.util

    from llmd.gpu.layers.quant.scheme import quant_scheme
    from llmd.gpu.models.gguf_loader import is_gguf_path

    scheme = quant_scheme(hf_config)
    if dequantize or (scheme is None and not is_gguf_path(model_dir)) or device.type == "cpu":
        return
    what = f"a {scheme.label} checkpoint" if scheme is not None else "a GGUF file"
    if device.type != "cuda":
        raise ValueError(f"{model_dir} is {what}: llmd runs it packed on cpu and cuda only (no {device.type} "
                         f"kernel); dequantize=True (--dequantize) loads it dense on {device.type}")
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{model_dir} is {what}: its CUDA kernels need the triton package (pip install triton); "
                         "dequantize=True (--dequantize) loads it dense")


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
