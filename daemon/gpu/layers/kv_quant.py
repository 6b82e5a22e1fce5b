"""A quantized KV cache (the engine setting `kv_cache_dtype`): what is stored, with which
scales, and the PyTorch reference of the write (quantize) and the read (dequantize).

"auto" keeps the cache in the model's dtype; "float16" and "bfloat16" in that float dtype
(for a float32 model: half the bytes, as llama.cpp's default f16 cache; written rounded
to nearest, read widened, no scales). "fp8" (or "fp8_e4m3") stores each K/V
element as one float8 e4m3fn byte (vLLM's `--kv-cache-dtype fp8`), "int8" as one
symmetric int8: the same memory holds 2x (bf16/fp16) or 4x (fp32) the tokens.

Each layer has two float32 scales, one for K and one for V (vLLM's per-layer
`k_scale`/`v_scale`): stored = quantize(x * (1 / scale)), read = stored * scale.
- fp8: x / scale rounded to the nearest e4m3 value (ties to even) after clamping to
  e4m3's finite range [-448, 448] (torch's float8 conversion would make an overflow
  NaN, not the largest value).
- int8: x / scale rounded to the nearest integer (ties to even), clamped to [-127, 127]
  (symmetric: -128 is never written).
The reciprocal is taken once, in float32, and every backend multiplies by it in float32,
so the torch path, the C++ CPU ops and the Triton kernels write the same bytes.

The cache tensor's own dtype says what it holds: uint8 (e4m3 bytes; torch's CPU
`index_copy_` has no float8 kernel, so the bytes travel as uint8 and are viewed as
float8 to convert), int8, or a float dtype (not quantized). Where the scales come from
is the worker's business (kv_calibration).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmd.config import KV_CACHE_DTYPES, KV_CACHE_FLOATS


@dataclass(frozen=True)
class KVCacheFormat:
    """A quantized cache's element format: its name (the `kv_cache_dtype` it stands for),
    the torch dtype of its storage, the largest magnitude it stores, and the kernels'
    code for it (KV_MODE: 0 is a cache in the model's dtype)."""

    name: str
    storage: torch.dtype
    qmax: float
    code: int


FP8_E4M3 = KVCacheFormat("fp8_e4m3", torch.uint8, 448.0, 1)
INT8 = KVCacheFormat("int8", torch.int8, 127.0, 2)
_BY_SETTING = {"fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3, "int8": INT8}
_BY_STORAGE = {FP8_E4M3.storage: FP8_E4M3, INT8.storage: INT8}
# A calibrated scale puts the calibration's largest |value| at 1 / KV_HEADROOM of the
# format's range (calibrated_scale).
KV_HEADROOM = 2.0


_FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}
assert set(_FLOATS) == set(KV_CACHE_FLOATS)


def kv_cache_format(kv_cache_dtype: str) -> KVCacheFormat | None:
    """The format setting `kv_cache_dtype` asks for; None for a float cache ("auto": the
    model's dtype, or float16 / bfloat16)."""
    if kv_cache_dtype == "auto" or kv_cache_dtype in _FLOATS:
        return None
    fmt = _BY_SETTING.get(kv_cache_dtype)
    if fmt is None:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return fmt


def cache_format(kv_cache: torch.Tensor) -> KVCacheFormat | None:
    """What a cache tensor holds, by its dtype (None: values in a float dtype)."""
    return _BY_STORAGE.get(kv_cache.dtype)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors are allocated in."""
    if kv_cache_dtype in _FLOATS:
        return _FLOATS[kv_cache_dtype]
    fmt = kv_cache_format(kv_cache_dtype)
    return model_dtype if fmt is None else fmt.storage


def narrower_float(cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a cache of `cache_dtype` holds float16 / bfloat16 K/V of float32 activations
    (kv_cache_dtype "float16" / "bfloat16" under a float32 model)."""
    return dtype == torch.float32 and cache_dtype in (torch.float16, torch.bfloat16)


def stores_rounded(kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a cache holds K/V of `dtype` other than as they are (quantized, or floats of
    another width): attention then reads the stored values, the new tokens' too, so that
    every path sees what a later step will."""
    return kv_cache.dtype != dtype


def cached_values(raw: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements `raw` as the values they stand for, in `dtype`: a quantized cache's
    dequantized with its `scale`, floats converted."""
    fmt = cache_format(raw)
    return raw.to(dtype) if fmt is None else dequantize(raw, fmt, scale, dtype)


def f32(x: float) -> float:
    """x rounded to float32 (what a kernel's float scalar argument holds)."""
    return float(np.float32(x))


@dataclass(frozen=True)
class KVScales:
    """One layer's scales (float32 values): read = stored * k (or v); the writes
    multiply by k_inv (v_inv), the float32 reciprocals, taken once here."""

    k: float = 1.0
    v: float = 1.0
    k_inv: float = field(init=False)
    v_inv: float = field(init=False)

    def __post_init__(self) -> None:
        for name, value in (("k", self.k), ("v", self.v)):
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"a KV cache {name}_scale must be a positive finite number, got {value!r}")
        for name in ("k", "v"):
            value = f32(getattr(self, name))
            object.__setattr__(self, name, value)
            object.__setattr__(self, f"{name}_inv", f32(1.0 / value))


UNIT_SCALES = KVScales()


def quantize(x: torch.Tensor, fmt: KVCacheFormat, inv_scale: float) -> torch.Tensor:
    """x (any float dtype) as `fmt`'s stored elements (module docstring)."""
    scaled = x.float() * inv_scale
    if fmt is FP8_E4M3:
        return scaled.clamp_(-fmt.qmax, fmt.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    return scaled.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)


def stored_values(raw: torch.Tensor, fmt: KVCacheFormat, dtype: torch.dtype) -> torch.Tensor:
    """The stored elements as numbers in `dtype`, before the scale (exact in float32,
    bfloat16 and float16: e4m3 has 3 mantissa bits, int8 7 bits of magnitude)."""
    if fmt is FP8_E4M3:
        return raw.view(torch.float8_e4m3fn).to(dtype)
    return raw.to(dtype)


def dequantize(raw: torch.Tensor, fmt: KVCacheFormat, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values a quantized cache holds, stored * scale (in float32), in `dtype`."""
    return stored_values(raw, fmt, torch.float32).mul_(scale).to(dtype)


def calibrated_scale(amax: float, fmt: KVCacheFormat) -> float:
    """A layer's scale from the largest |K| (or |V|) a calibration forward wrote: that
    amax lands at 1 / KV_HEADROOM of the format's range, so values up to KV_HEADROOM
    times it are stored unclipped. For fp8 this also lifts small values out of e4m3's
    subnormals (below 2^-6 its steps are a fixed 2^-9): with vLLM's default scale of 1.0
    a model whose K/V stay under ~0.1 keeps 1-3 significant bits of them."""
    return max(float(amax), 1e-6) * KV_HEADROOM / fmt.qmax

