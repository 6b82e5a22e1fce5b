"""Engine settings. Names follow vLLM's so its users feel at home."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec


# The kv_cache_dtype values (llmd.gpu.layers.kv_quant reads them; this module imports no torch).
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "int8")
# Those that keep K/V as floats of another width than the model's (half a float32 model's bytes).
KV_CACHE_FLOATS = ("float16", "bfloat16")


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (vLLM's names). "ngram": drafts are the tokens that followed
    the most recent earlier occurrence of the last n tokens (prompt_lookup_max down to
    prompt_lookup_min) in the request's own prompt and output. "draft_model": a small
    model (`draft_model`, a local directory) sharing the target's tokenizer and
    vocabulary drafts num_speculative_tokens tokens per step in the worker."""

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("speculative_config.method \"draft_model\" needs draft_model: "
                             "the path of the draft model's directory")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("speculative_config.draft_model is only used with method \"draft_model\"")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # An HF directory or a GGUF file; "": the built-in model (llmd.builtin_model).
    model: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: chunk only by the step budget
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    num_gpu_blocks_override: int | None = None  # forces the KV pool size on any device
    kv_cache_memory_bytes: int | None = None  # KV pool size in bytes (any device)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory llmd may use
    cpu_kv_cache_fraction: float = 0.25  # CPU: fraction of available RAM for KV when no bytes given
    tensor_parallel_size: int = 1  # > 1: must divide the model's attention heads; implies "mp"
    # "uni": the model runs in this process; "mp": one spawned worker process per device.
    distributed_executor_backend: Literal["uni", "mp"] = "uni"
    enforce_eager: bool = False
    # Schedule step N+1 while step N runs (its sampled tokens are placeholders until they
    # arrive): hides scheduling and output processing behind the model's work.
    async_scheduling: bool = False
    # Paged attention kernels: "auto" (on CUDA flash_attn when installed and block_size
    # fits it, else triton when it imports, else torch).
    attention_backend: Literal["auto", "torch", "triton", "flash_attn"] = "auto"
    # KV cache elements (vLLM's name and values): "auto" the model's dtype; "fp8" (or
    # "fp8_e4m3") one float8 e4m3 byte, "int8" one int8, each scaled per layer (see
    # docs/models.md): twice (bf16) or four times (fp32) the tokens in the same memory.
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "int8"] = "auto"
    # CPU: torch intra-op threads for the model (per TP rank). None: all cores (split
    # between ranks). Fewer than the cores leaves room for other work: with OpenMP,
    # threads competing with other busy processes make every op wait a time slice.
    cpu_threads: int | None = None
    # GGUF, AWQ, GPTQ and FP8 checkpoints: dequantize every weight at load instead of
    # keeping the quantized weights packed (gguf_quant, layers/quant/); also what loads a
    # type or module llmd has no packed kernel for, and an AWQ/GPTQ/FP8 checkpoint on CUDA.
    dequantize: bool = False
    # CPU with AVX-512 VNNI or AVX2: multiply packed quantized weights (GGUF, AWQ, GPTQ) with the
    # activations rounded to int8 once per 32 columns (per 256 for the K-quants Q3_K-Q6_K, as
    # llama.cpp's Q8_K), as llama.cpp and vLLM's GGUF kernels do, instead of in two (~16 bits
    # of each block's largest value; gguf_quant.x16_passes).
    # Up to ~2x faster products where they are compute-bound (batches,
    # small models), at llama.cpp's precision: ~0.5% of a product's scale, so greedy output
    # can part from the float reference where two tokens are close.
    cpu_int8_activations: bool = False
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    max_logprobs: int = 20
    # What the model is served for (vLLM's `task`): "generate" (text; the embedding
    # endpoints pool its hidden states too, as Ollama does) or "embed" (embeddings only:
    # generation requests are refused).
    task: Literal["generate", "embed"] = "generate"
    # How embeddings pool the final hidden states: "LAST" token, "MEAN" over the prompt,
    # or "CLS" (the first token). None: the model's sentence-transformers pooling config
    # (1_Pooling/config.json) when it has one, else LAST (decoder models).
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = None
    # The embedding sizes a request's `dimensions` may ask for (Matryoshka models).
    # None: what the model's config.json declares (`matryoshka_dimensions`, or
    # `is_matryoshka` for any size), else `dimensions` is refused.
    matryoshka_dimensions: list[int] | None = None
    tokenizer: str | None = None  # defaults to the model directory
    # Guided decoding: a grammar compile running longer than this fails its requests.
    guided_decoding_compile_timeout_s: float = 10.0
    # A worker step with no reply after step_timeout_s + step_timeout_per_token_s per
    # scheduled token is a hung worker: it is killed and replaced ("mp"). Generous, so a
    # slow CPU or a first step that compiles kernels never trips it; 0: no deadline.
    step_timeout_s: float = 120.0
    step_timeout_per_token_s: float = 0.2

    def step_deadline_s(self, num_tokens: int) -> float | None:
        """How long a step of `num_tokens` tokens may run before its worker counts as
        hung; None: no deadline."""
        if self.step_timeout_s == 0:
            return None
        return self.step_timeout_s + self.step_timeout_per_token_s * num_tokens

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{field} {msg}")

        for name in self.__struct_fields__:  # no integer setting past 64 bits (an OverflowError later)
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                check(-2**63 <= value < 2**63, name, f"must fit a 64-bit integer ({len(str(value))} digits given)")
        check(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), "block_size",
              f"must be a power of two in [1, 512], got {self.block_size}")
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
              f"must be >= 1, got {self.max_num_batched_tokens}")
        check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
              f"must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_model_len is not None:
            check(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None:
            check(self.num_gpu_blocks_override >= 1, "num_gpu_blocks_override",
                  f"must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None:
            check(self.kv_cache_memory_bytes >= 1, "kv_cache_memory_bytes", "must be >= 1")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")
        check(0.0 < self.cpu_kv_cache_fraction <= 0.9, "cpu_kv_cache_fraction",
              f"must be in (0, 0.9], got {self.cpu_kv_cache_fraction}")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size",
              f"must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            # One worker process per rank: tensor parallelism always runs on "mp".
            self.distributed_executor_backend = "mp"
        spec = self.speculative_config
        check(spec is None or spec.method != "draft_model" or self.tensor_parallel_size == 1,
              "speculative_config", "method \"draft_model\" does not run with tensor_parallel_size > 1 yet")
        check(spec is None or not self.async_scheduling, "async_scheduling",
              "does not run with speculative_config yet (drafts need the previous step's tokens)")
        if self.cpu_threads is not None:
            check(self.cpu_threads >= 1, "cpu_threads", f"must be >= 1, got {self.cpu_threads}")
        check(self.attention_backend in ("auto", "torch", "triton", "flash_attn"), "attention_backend",
              f"must be 'auto', 'torch', 'triton' or 'flash_attn', got {self.attention_backend!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {', '.join(repr(d) for d in KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        check(self.kv_cache_dtype == "auto" or self.attention_backend != "flash_attn", "kv_cache_dtype",
              f"{self.kv_cache_dtype!r} is not read by attention_backend 'flash_attn' (flash-attn 2 takes K/V in the "
              "model's dtype only): use 'auto' or 'triton'")
        check(1 <= self.max_logprobs <= 20, "max_logprobs", "must be in [1, 20]")
        if self.matryoshka_dimensions is not None:
            check(bool(self.matryoshka_dimensions) and all(d >= 1 for d in self.matryoshka_dimensions),
                  "matryoshka_dimensions", "must list one or more sizes >= 1")
        check(self.guided_decoding_compile_timeout_s > 0, "guided_decoding_compile_timeout_s",
              f"must be > 0, got {self.guided_decoding_compile_timeout_s}")
        check(self.step_timeout_s >= 0, "step_timeout_s", f"must be >= 0 (0: no deadline), got {self.step_timeout_s}")
        check(self.step_timeout_per_token_s >= 0, "step_timeout_per_token_s",
              f"must be >= 0, got {self.step_timeout_per_token_s}")


# What each engine setting does, for `llmd serve --help` (and the benchmarks' options).
# A test keeps it complete.
SETTING_HELP: dict[str, str] = {
    "model": "A Hugging Face model directory or a .gguf file (default: the built-in model).",
    "dtype": "Weights and activations; auto: the model's own dtype (bfloat16 on CUDA).",
    "device": "auto: CUDA when available, else CPU.",
    "block_size": "Tokens per KV-cache block (a power of two, 1..512).",
    "max_model_len": "Longest sequence, prompt + output, in tokens (default: the model's maximum).",
    "max_num_seqs": "Most sequences in one batch.",
    "max_num_batched_tokens": "Token budget of one step: prefill chunks plus decode tokens.",
    "long_prefill_token_threshold": "Chunk prefills longer than this per step; 0: only by the step budget.",
    "enable_prefix_caching": "Reuse the KV cache of shared prompt prefixes.",
    "scheduling_policy": "fcfs, or priority (lower `priority` values first).",
    "num_gpu_blocks_override": "KV pool size in blocks, on any device (overrides the sizing).",
    "kv_cache_memory_bytes": "KV pool size in bytes, on any device.",
    "gpu_memory_utilization": "CUDA: fraction of device memory llmd may use (weights, activations, KV).",
    "cpu_kv_cache_fraction": "CPU: fraction of available RAM for the KV cache when no size is given.",
    "tensor_parallel_size": "GPUs (or CPU processes) to shard the model over; must divide its heads.",
    "distributed_executor_backend": "uni: the model runs in the daemon; mp: in a worker process per device.",
    "enforce_eager": "No CUDA graphs (slower; for debugging).",
    "async_scheduling": "Schedule the next step while the model runs this one.",
    "attention_backend": "Paged attention kernels; auto: flash-attn or Triton on CUDA, PyTorch on CPU.",
    "kv_cache_dtype": "KV cache elements: auto (the model's dtype), float16 / bfloat16 (half a float32 model's "
                      "bytes, as llama.cpp's f16 cache), fp8 / fp8_e4m3 or int8 (one byte each, scaled per layer: "
                      "2x-4x the tokens in the same memory).",
    "cpu_threads": "CPU: torch threads for the model per rank (default: all cores).",
    "dequantize": "GGUF, AWQ, GPTQ, FP8: dequantize every weight at load instead of running them packed (more "
                  "memory; loads what llmd has no packed kernel for, e.g. IQ2/IQ3 types, "
                  "quantized MoE experts).",
    "cpu_int8_activations": "CPU: multiply packed quantized weights with int8-rounded activations, as llama.cpp "
                            "(faster batches; greedy output may part from the float reference on close calls).",
    "speculative_config": "Speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'.",
    "seed": "Seed of the engine's random generator (a request's own seed overrides it).",
    "max_logprobs": "Largest number of logprobs a request may ask for (1..20).",
    "task": "generate: serve text generation (the embedding endpoints work too); embed: embeddings only.",
    "pooling_type": "Embeddings: LAST token, MEAN over the input, or CLS (first token) of the final hidden "
                    "states (default: the model's sentence-transformers config, else LAST).",
    "matryoshka_dimensions": "Embedding sizes a request's `dimensions` may ask for, e.g. 256,512 "
                             "(default: the model's config.json matryoshka_dimensions).",
    "tokenizer": "Tokenizer directory (default: the model's).",
    "guided_decoding_compile_timeout_s": "A grammar compiling longer than this fails its requests.",
    "step_timeout_s": "A worker step unanswered this long (plus the per-token time) is a hang: the "
                      "worker is killed and replaced (mp); 0: no deadline.",
    "step_timeout_per_token_s": "Extra step deadline per scheduled token (see step_timeout_s).",
}


def resolved_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """What a KV cache of setting `kv_cache_dtype` stores for a model in `model_dtype`
    (a name such as "bfloat16"): that dtype for "auto", "fp8_e4m3" for "fp8"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def load_engine_config(**settings: Any) -> EngineConfig:
    """Build an EngineConfig from keyword settings, with a readable error for unknown names."""
    known = set(EngineConfig.__struct_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}")
    return msgspec.convert(settings, EngineConfig)


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the engine needs from a model directory's config.json."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str | None = None


def read_model_info(model_dir: str | Path) -> ModelInfo:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or [""]
    num_heads = cfg["num_attention_heads"]
    return ModelInfo(
        architecture=archs[0],
        model_type=cfg.get("model_type", ""),
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
