"""The rotary embedding a GGUF file describes, as transformers' `rope_parameters`: the
rope keys of its metadata (`{arch}.rope.freq_base`, `{arch}.rope.scaling.*`), the
per-frequency factors of its `rope_freqs.weight` tensor, Phi-3's longrope factors
(`rope_factors_long.weight`, `rope_factors_short.weight`) and a rotation of part of each
head (`{arch}.rope.dimension_count` below the head size: `partial_rotary_factor`).

Phi-3's 128k models come with two sets of factors, one per rotated frequency each (half
the rotated dimensions, F32), as llama.cpp's converter (`Phi3MiniModel`) writes the HF
config's `long_factor` / `short_factor`, with `rope.scaling.original_context_length` (the
context the short ones serve) and `rope.scaling.attn_factor` (what cos and sin are scaled
by: the converter's sqrt(1 + ln(factor) / ln(original)), transformers' own default for
longrope). They become the HF config's longrope parameters again, the attention factor
the file's.

`rope_freqs.weight` is how llama.cpp's converter (`convert_hf_to_gguf.py`,
`LlamaModel.generate_extra_tensors`) writes Llama 3.1-style rope scaling (`rope_scaling:
{rope_type: llama3, factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings}`): not the four parameters but their effect, one
factor per rotated frequency (head size / 2 float32s; 1 for high frequencies, `factor`
for low ones, a smooth blend between). llama.cpp divides each inverse frequency by its
factor (ggml_rope_ext's `freq_factors`: theta_i = p * base^(-2i/d) / f_i, then the linear
or YaRN scaling of the metadata on top), for the llama family of architectures
(llama_model::load_tensors reads it for LLM_ARCH_LLAMA and a few llama derivatives, none
of the other architectures llmd runs from GGUF; llama.cpp refuses their files with the
tensor as having one tensor too many).

The factors become transformers' `longrope` parameters with the file's factors as both
`short_factor` and `long_factor` and an attention factor of 1: transformers computes
longrope's inverse frequencies as 1 / (f_i * base^(2i/d)), which is llama.cpp's
arithmetic, and with one set of factors longrope's switch between them changes nothing.
So the config stays one transformers itself runs exactly as llama.cpp runs the file,
and every part of llmd that builds rope tables reads the same frequencies from it
(daemon/gpu/layers/rotary.py). The file does not hold llama3's parameters, only the
factors they gave (which depend on them only through original / low_freq_factor and
original / high_freq_factor), so they are not mapped back to `rope_type: llama3`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from llmd.gpu.models.gguf_arch import GGUFArchitecture
from llmd.gpu.models.gguf_file import GGUFFile

ROPE_FREQS = "rope_freqs.weight"
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_TENSORS = frozenset({ROPE_FREQS, *LONGROPE})  # rope parameters, not weights


def gguf_rope_parameters(g: GGUFFile, a: str, where: str, head_dim: int, rotary_dim: int,
                         spec: GGUFArchitecture) -> dict[str, Any]:
    """transformers' rope_parameters from llama.cpp's rope keys (which transformers' own
    GGUF loader ignores; llama.cpp applies them, so llmd does too) and the rope tensors
    the architecture reads (others refused naming them), over the first `rotary_dim`
    dimensions of each head."""
    params = _parameters(g, a, where, rotary_dim, spec)
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    return params


def _parameters(g: GGUFFile, a: str, where: str, rotary_dim: int, spec: GGUFArchitecture) -> dict[str, Any]:
    params = _scaling_parameters(g, a, where)
    longrope = _longrope_parameters(g, a, where, rotary_dim, spec.reads_longrope)
    if longrope is not None:
        if params["rope_type"] != "default":
            raise ValueError(f"{where}: GGUF tensors {', '.join(LONGROPE)} together with "
                             f"{a}.rope.scaling.type={params['rope_type']!r} are not implemented by llmd")
        return {**params, **longrope}
    factors = rope_freq_factors(g, a, where, rotary_dim, spec.reads_rope_freqs)
    if factors is None:
        return params
    if params["rope_type"] == "linear":  # llama.cpp: freq_scale * theta / f_i, one factor
        factors = factors * np.float64(params["factor"])
    elif params["rope_type"] != "default":
        raise ValueError(f"{where}: GGUF tensor {ROPE_FREQS!r} (per-frequency rope factors) together with "
                         f"{a}.rope.scaling.type={params['rope_type']!r} is not implemented by llmd")
    per_frequency = [float(f) for f in factors]
    return {"rope_type": "longrope", "rope_theta": params["rope_theta"],
            "short_factor": per_frequency, "long_factor": list(per_frequency),
            "original_max_position_embeddings": int(g.require(f"{a}.context_length")),
            "factor": 1.0, "attention_factor": 1.0}


def _longrope_parameters(g: GGUFFile, a: str, where: str, rotary_dim: int, reads: bool) -> dict[str, Any] | None:
    """Phi-3's longrope parameters from its two factor tensors (module doc); None without
    them; refused naming them where the architecture has none or one is missing."""
    present = [name for name in LONGROPE if name in g.tensors]
    if not present:
        return None
    if not reads or len(present) < 2:
        problem = "come in pairs in" if reads else "are not part of"
        raise ValueError(f"{where}: GGUF tensors {', '.join(LONGROPE)} (longrope factors) {problem} a {a!r} model; "
                         f"this file has {', '.join(present)}")
    long, short = (list(map(float, rope_freq_factors(g, a, where, rotary_dim, True, name))) for name in LONGROPE)
    params: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                              "original_max_position_embeddings": int(
                                  g.get(f"{a}.rope.scaling.original_context_length") or g.require(f"{a}.context_length"))}
    if g.get(f"{a}.rope.scaling.attn_factor") is not None:
        params["attention_factor"] = float(g.get(f"{a}.rope.scaling.attn_factor"))
    return params


def rope_freq_factors(g: GGUFFile, a: str, where: str, head_dim: int, reads_rope_freqs: bool,
                      name: str = ROPE_FREQS) -> np.ndarray | None:
    """The file's per-frequency rope factors in tensor `name` (float64 copies of its
    float32s), None without the tensor; refused naming it where llama.cpp would not run
    it: on an architecture that does not read it, in a type other than F32 (ggml's rope
    asserts F32), of a length other than the rotated size / 2, or holding a factor that
    is not a positive finite number (a division by it)."""
    t = g.tensors.get(name)
    if t is None:
        return None
    if not reads_rope_freqs:
        raise ValueError(f"{where}: GGUF tensor {name!r} (per-frequency rope factors) is not part of a {a!r} "
                         "model: llama.cpp reads it only for the llama family and refuses this file")
    if t.tensor_type != GGMLQuantizationType.F32:
        raise ValueError(f"{where}: GGUF tensor {name!r} has type {t.tensor_type.name}; llama.cpp reads "
                         "per-frequency rope factors only as F32")
    if t.shape[0] != head_dim // 2 or any(d != 1 for d in t.shape[1:]):  # ggml: trailing 1s are no dimension
        raise ValueError(f"{where}: GGUF tensor {name!r} has shape {list(t.shape)}; it must hold one factor "
                         f"per rotated frequency: [{head_dim // 2}] for the {head_dim} rotated dimensions")
    factors = np.array(g.tensor_data(t), dtype=np.float64).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(factors) & (factors > 0)))
    if bad.size:
        raise ValueError(f"{where}: GGUF tensor {name!r} holds {float(factors[bad[0]])} at index {int(bad[0])}: "
                         "every per-frequency rope factor must be a positive finite number")
    return factors


def _scaling_parameters(g: GGUFFile, a: str, where: str) -> dict[str, Any]:
    """rope_parameters of the metadata keys alone: rope base and scaling type."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(g.get(f"{a}.rope.freq_base", 10000.0))}
    scaling = g.get(f"{a}.rope.scaling.type")
    factor = g.get(f"{a}.rope.scaling.factor")
    if scaling is None and g.get(f"{a}.rope.scale_linear") is not None:
        scaling, factor = "linear", g.get(f"{a}.rope.scale_linear")
    if scaling in (None, "none"):
        return params
    if factor is None:
        raise ValueError(f"{where}: GGUF metadata {a}.rope.scaling.type={scaling!r} without "
                         f"{a}.rope.scaling.factor")
    if scaling == "linear":
        return {**params, "rope_type": "linear", "factor": float(factor)}
    if scaling == "yarn":
        params.update(rope_type="yarn", factor=float(factor))
        original = g.get(f"{a}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if g.get(f"{a}.rope.scaling.{key}") is not None:
                params[name] = float(g.get(f"{a}.rope.scaling.{key}"))
        return params
    raise ValueError(f"{where}: GGUF metadata {a}.rope.scaling.type={scaling!r} is not implemented by llmd "
                     "(supported: none, linear, yarn)")
