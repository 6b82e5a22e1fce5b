"""Rotary position embeddings: the cos/sin table of a model (or of one of its layer
types) from its Hugging Face rope parameters, and their application to q and k.

Rope types, each computed as transformers' `modeling_rope_utils` computes it: default,
linear, llama3, yarn and longrope (Phi-3's "su"/"longrope", which transformers'
Phi3Config stores as "longrope"). `partial_rotary_factor` rotates only the first
int(head_dim * factor) dimensions of each head (Phi-4-mini); the model classes refuse it
where transformers' model of the architecture does not apply it.

longrope has two sets of frequencies. transformers picks one per forward call, from the
call's largest position: the long factors when max(position) + 1 exceeds
`original_max_position_embeddings`, the short ones otherwise. llmd picks per position,
with the same threshold: position p uses the long factors when p + 1 > original max.
That is transformers' choice for every call whose positions all sit on one side of the
threshold, which covers a prompt of up to original-max tokens followed by one-token
decode steps. The two differ on one forward over a prompt longer than the original max
(transformers rotates all of it with the long factors) and after Phi3ForCausalLM's
generate() recomputes the whole sequence on crossing the threshold. llmd cannot follow
either: a token's K is written to the paged cache once, and its blocks are shared
through the prefix cache, reused across chunks and recomputed after preemption, so
its rotation may depend only on its own position (docs/models.md, "Phi-3").
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of an HF config as one flat dict (transformers 5
    `rope_parameters`, older `rope_scaling` + `rope_theta`). With `layer_type`, the
    entry of that layer type when the config nests them (Gemma 3:
    {"sliding_attention": {...}, "full_attention": {...}})."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params.get("rope_type") and layer_type is None:
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rotary_dim(params: dict[str, Any], head_dim: int) -> int:
    """How many leading dimensions of each head are rotated."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freqs(params: dict[str, Any], dim: int, config: Any) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(inverse frequencies, the long ones of longrope or None, the factor on cos/sin)
    for `dim` rotated dimensions."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type == "default":
        return _inv_freq(dim, base), None, 1.0
    if rope_type == "linear":
        return _inv_freq(dim, base) / float(params["factor"]), None, 1.0
    if rope_type == "llama3":
        return _llama3(params, _inv_freq(dim, base)), None, 1.0
    if rope_type == "yarn":
        inv_freq, scaling = _yarn(params, dim, base, config)
        return inv_freq, None, scaling
    if rope_type == "longrope":
        return _longrope(params, dim, base, config)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


def _llama3(p: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    factor = float(p["factor"])
    low_freq_factor = float(p["low_freq_factor"])
    high_freq_factor = float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(p: dict[str, Any], dim: int, base: float, config: Any) -> tuple[torch.Tensor, float]:
    factor = float(p["factor"])
    original_max = p.get("original_max_position_embeddings") or config.max_position_embeddings
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(p.get("beta_fast") or 32)
    beta_slow = float(p.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(p: dict[str, Any], dim: int, base: float, config: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Short and long frequencies (base^(2i/dim) times the per-frequency factors) and
    the attention factor, as transformers' _compute_longrope_parameters: `factor`
    defaults to max_position_embeddings / original_max_position_embeddings."""
    original_max = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original_max
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32) * base ** shape)
    long = 1.0 / (torch.tensor(p["long_factor"], dtype=torch.float32) * base ** shape)
    return short, long, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half) over the first rotary_dim dimensions
    of a head, with a cos/sin cache indexed by position ([max_positions, rotary_dim])."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        dim = rotary_dim(params, head_dim)
        inv_freq, long_inv_freq, scaling = inv_freqs(params, dim, config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        if long_inv_freq is not None:
            # Position p takes the long factors when p + 1 > the original max (module doc).
            switch = int(params["original_max_position_embeddings"])
            freqs[switch:] = torch.outer(t[switch:], long_inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # float32 cache; cast to the activation dtype per call, as HF does.
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for a step's positions, shaped [T, 1, rotary_dim] to broadcast over heads."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


class NoRotary(nn.Module):
    """The cos/sin of a layer that does not rotate q and k (SmolLM3's NoPE layers): cos 1
    and sin 0, which every rotary path (apply_rotary, the fused CPU and CUDA kernels)
    applies as the identity: x * 1 + rotated * 0 is x."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (positions.shape[0], 1, self.dim)
        return (torch.ones(shape, dtype=dtype, device=positions.device),
                torch.zeros(shape, dtype=dtype, device=positions.device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; rotates its first cos.shape[-1] dimensions, passes the rest."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
