"""A checkpoint's own per-layer K/V cache scales (static FP8 / int8 KV-cache quantization:
what llm-compressor, vLLM's and NVIDIA modelopt's exporters write beside the weights).

The names, as vLLM reads them (`maybe_remap_kv_scale_name`, compressed-tensors'
`get_cache_scale`): `layers.N.self_attn.k_scale` / `v_scale` (compressed-tensors now,
vLLM's fp8), `self_attn.k_proj.output_scale` / `v_proj.output_scale` (compressed-tensors
before), `self_attn.k_proj.k_scale` / `v_proj.v_scale` (modelopt) and the deprecated
`self_attn.kv_scale` (one for both); a query's scale (`q_scale`, `q_proj.output_scale`:
FP8 attention) is read past. A scale s means a stored value q reads as q * s in a
format of largest magnitude qmax: the layer's K (V) spans up to amax = s * qmax, which is
what is kept here (`KVAmax`). kv_calibration turns it into the scales of the cache
format a run chooses (fp8 or int8: amax / that format's qmax) instead of calibrating;
with a cache in the model's dtype (`kv_cache_dtype` auto) they are not used.

qmax is the checkpoint's: 448 (float8 e4m3) unless its quantization_config's
kv_cache_scheme says int (127; quant/scheme.py). A checkpoint that declares a
kv_cache_scheme must carry both scales for every layer; one that does not may carry
them anyway (vLLM's fp8, modelopt), then all of them too. A scale that is not a finite
positive number is refused naming the tensor."""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from llmd.gpu.layers.quant.scheme import KV_SCHEME_QMAX

# A checkpoint tensor that is a layer's K or V scale -> (layer, "k" | "v" | "kv"); "q": a
# query scale (FP8 attention, which llmd does not do: queries stay in the model's dtype,
# so it is read past).
_SCALE_NAME = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\."
                         r"(?:(k|v|q)_scale|(k|v|q)_proj\.output_scale|(k|v)_proj\.(?:k|v)_scale|(kv)_scale)")


@dataclass(frozen=True)
class KVAmax:
    """Each layer's largest |K| and |V| the checkpoint's scales allow (scale * qmax)."""

    k: tuple[float, ...]
    v: tuple[float, ...]


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv" | "q") for a K/V (or query) scale tensor's name; None for
    any other."""
    m = _SCALE_NAME.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)), next(g for g in m.groups()[1:] if g)


class KVScaleCollector:
    """Takes the K/V scales out of a checkpoint's tensors as they stream by (`weights`),
    then `amax(num_layers)` gives them per layer (None: the checkpoint has none)."""

    def __init__(self, qmax: float | None) -> None:
        self.declared = qmax is not None  # the config's kv_cache_scheme says they are there
        self.qmax = KV_SCHEME_QMAX["float"] if qmax is None else qmax  # e4m3 unless the config says
        self.found: dict[tuple[int, str], float] = {}

    def weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, source in weights:
            target = kv_scale_target(name)
            if target is None:
                yield name, source
                continue
            layer, which = target
            if which == "q":
                continue
            value = _scalar(name, source)
            for part in ("k", "v") if which == "kv" else (which,):
                self.found[(layer, part)] = value

    def amax(self, num_layers: int) -> KVAmax | None:
        if not self.found:
            if self.declared:
                raise ValueError("quantization_config.kv_cache_scheme declares static K/V cache scales, but the "
                                 "checkpoint has no k_scale / v_scale tensors")
            return None
        extra = sorted(layer for layer, _ in self.found if layer >= num_layers)
        if extra:
            raise ValueError(f"K/V cache scale for layer {extra[0]} in a checkpoint of {num_layers} layers")
        missing = [f"layers.{layer}.self_attn.{part}_scale" for layer in range(num_layers) for part in ("k", "v")
                   if (layer, part) not in self.found]
        if missing:
            raise ValueError(f"checkpoint has K/V cache scales for some layers but not {missing[0]!r} "
                             f"({len(missing)} missing)")
        return KVAmax(tuple(self.found[(i, "k")] * self.qmax for i in range(num_layers)),
                      tuple(self.found[(i, "v")] * self.qmax for i in range(num_layers)))


def _scalar(name: str, source: Any) -> float:
    tensor = source[...]  # a safetensors slice read whole (a 0-d one too)
    if tensor.numel() != 1:
        raise ValueError(f"K/V cache scale {name!r} has {tensor.numel()} values (llmd reads one per layer: "
                         "per-head scales are not implemented)")
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"K/V cache scale {name!r} is {value!r}: it must be a finite positive number")
    return value
