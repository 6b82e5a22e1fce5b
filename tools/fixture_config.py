"""The fixture models' configs (tools/make_model.py builds them): size presets, the
architectures, and the transformers config of (arch, preset, overrides) — every
architecture's own config class, llama3 RoPE on llama, a padded vocabulary where asked,
a mixture of experts' defaults."""
from __future__ import annotations

import math
from typing import Any

from llmd_tools.fixture_tokenizer import BOS, EOS, PAD, special_token_ids

PRESETS: dict[str, dict[str, Any]] = {
    # unit tests: builds in ~1 s, a forward step takes well under a millisecond
    "tiny": dict(
        tokenizer_vocab=1024,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=172,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        llama3_original_max_position_embeddings=64,
    ),
    # CPU benchmarks / demo: ~44M parameters (untied llama), fp32 ~175 MB
    "small": dict(
        tokenizer_vocab=8192,
        hidden_size=512,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1408,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        llama3_original_max_position_embeddings=256,
    ),
    # GPU benchmarks: TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads,
    # intermediate 5632, vocab 32000: the tokenizer's 8192 tokens, the rest padding), so
    # the weights read per decode step match the real model's. Not a named fixture (4.4 GB
    # in fp32): `python -m llmd_tools.make_model --arch llama --preset tinyllama --out DIR`.
    "tinyllama": dict(
        tokenizer_vocab=8192,
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=5632,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        llama3_original_max_position_embeddings=2048,
    ),
    # CPU GGUF benchmarks (llmd_tools.make_gguf): Llama 3.2 1B's shape (16 layers, hidden
    # 2048, 32 heads, 8 KV heads, intermediate 8192, vocab 128256: the tokenizer's 8192
    # tokens, the rest padding; use it tied, as the real model is), so a decode step reads
    # and computes what the real model's does. Not a named fixture (5 GB in fp32).
    "llama3.2-1b": dict(
        tokenizer_vocab=8192,
        vocab_size=128256,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        llama3_original_max_position_embeddings=8192,
    ),
}

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "qwen2_moe", "mixtral",
         "smollm3", "granite")


def padded_vocab_size(tokenizer_vocab: int) -> int:
    """Round up to a multiple of 64, plus 64 (real Qwen2 checkpoints pad like this)."""
    return int(math.ceil(tokenizer_vocab / 64) * 64 + 64)


_BUILD_ONLY_KEYS = ("init", "logit_std", "tokenizer_flavour", "dtype")
# The dtypes build_model can save the weights in (initialised in float32 either way).
SAVE_DTYPES = ("float32", "bfloat16")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def moe_defaults(arch: str, intermediate_size: int) -> dict[str, Any]:
    """A preset's mixture-of-experts variant (overrides still win): 8 experts, 2 per
    token, each expert 1/8 of the preset's dense intermediate size, so the model holds
    about as many parameters as the dense preset and runs about a quarter of its MLP per
    token; Qwen2-MoE adds a shared expert of 1/4."""
    expert = intermediate_size // 8
    if arch == "mixtral":  # Mixtral's intermediate_size is each expert's
        return dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=expert)
    fields = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=expert)
    if arch == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = intermediate_size // 4
    return fields


def resolve_config(arch: str, preset: str, *, tie_word_embeddings: bool = False, **overrides: Any):
    """``(config, tokenizer_vocab)`` for (arch, preset, overrides).

    Override keys besides any config field (``num_hidden_layers=...`` etc.):
      ``tokenizer_vocab``: int, tokenizer vocab size (default: the preset's);
      ``pad_vocab``: bool, model vocab = padded_vocab_size(tokenizer vocab) (default:
      True for qwen2, False otherwise); ``vocab_size``: int, set it outright (>= tokenizer);
      ``llama3_rope``: bool, or a dict updating the llama3 rope params (default: True
      for llama; llama only); ``rope_parameters``: dict, set outright; ``rope_theta``;
      build_model only: ``init`` ("peaked" (default) or "hf": transformers' own init),
      ``logit_std`` (default TARGET_LOGIT_STD), ``tokenizer_flavour`` (default
      ARCH_TOKENIZER_FLAVOUR[arch]), ``dtype`` (one of SAVE_DTYPES: the safetensors'
      dtype, default float32; bfloat16 halves a big fixture's files)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    p = dict(PRESETS[preset])
    ov = {k: v for k, v in overrides.items() if k not in _BUILD_ONLY_KEYS}
    tok_vocab = int(ov.pop("tokenizer_vocab", p.pop("tokenizer_vocab")))
    p.pop("tokenizer_vocab", None)
    pad_vocab = bool(ov.pop("pad_vocab", arch == "qwen2"))
    llama3 = ov.pop("llama3_rope", arch == "llama")
    orig_max = p.pop("llama3_original_max_position_embeddings")
    rope_theta = float(ov.pop("rope_theta", p.pop("rope_theta")))
    preset_vocab = p.pop("vocab_size", None)  # a preset may fix the model vocab outright
    if preset_vocab is None:
        preset_vocab = padded_vocab_size(tok_vocab) if pad_vocab else tok_vocab
    vocab = int(ov.pop("vocab_size", preset_vocab))
    if vocab < tok_vocab:
        raise ValueError(f"model vocab_size {vocab} < tokenizer vocab {tok_vocab}")

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if llama3:
        if arch != "llama":
            raise ValueError("llama3_rope is only supported for arch='llama'")
        rope = {
            "rope_type": "llama3",
            "rope_theta": rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": orig_max,
        }
        if isinstance(llama3, dict):
            rope.update(llama3)
    if "rope_parameters" in ov:
        rope = dict(ov.pop("rope_parameters"))

    ids = special_token_ids()
    fields: dict[str, Any] = dict(
        vocab_size=vocab,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        **p,
    )
    if arch in MOE_ARCHS:
        fields.update(moe_defaults(arch, fields["intermediate_size"]))
    fields.update(ov)
    if arch in ("qwen2", "phi3"):
        # Qwen2Config and Phi3Config have no head_dim: it is hidden_size // num_attention_heads.
        hd = fields.pop("head_dim", None)
        if hd is not None and hd != fields["hidden_size"] // fields["num_attention_heads"]:
            raise ValueError(f"{arch} requires head_dim == hidden_size // num_attention_heads")
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "qwen3_moe": Qwen3MoeConfig,
           "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig, "smollm3": SmolLM3Config,
           "granite": GraniteConfig}[arch]
    cfg = cls(**fields)
    cfg.dtype = "float32"
    return cfg, tok_vocab


def param_count(arch: str, preset: str, *, tie_word_embeddings: bool = False, **overrides: Any) -> int:
    """Exact parameter count (tied weights counted once), without allocating weights."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg, _ = resolve_config(arch, preset, tie_word_embeddings=tie_word_embeddings, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied tensors
