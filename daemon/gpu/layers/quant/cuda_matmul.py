"""Packed layers on CUDA: each matmul through the Triton kernel (triton_quant_mm), FP8
per-channel weights through the FP8 tensor cores where they run W8A8 (fp8_scaled_mm).

- A GGUF layer's parts, and an AWQ/GPTQ layer's (transcoded into Q4_0, Q5_0, Q8_0 at
  load, quant_linear), are laid out as planes in place at attach time (gguf_planes: the
  same bytes, so the memory account is unchanged) and multiplied by `TritonGGUFMatmul`.
  A packed vocabulary table tied to the LM head shares its planes: its lookups read rows
  back through them (gguf_planes.from_planes) and dequantize those (gguf_quant).
- An FP8 layer (`TritonFP8Matmul`): W8A8 through torch._scaled_mm where
  fp8_scaled_mm.w8a8_applies, else W8A16 through the Triton kernel.
- A MoE layer's packed experts (`TritonPackedExperts`: GGUF, AWQ / GPTQ transcoded, FP8,
  W8A16) through the grouped kernel over every expert (triton_quant_moe).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmd.gpu.layers.fused_ops import LayerOps
from llmd.gpu.layers.mlp import FP8
from llmd.gpu.layers.quant.fp8_scaled_mm import w8a8_applies, w8a8_matmul
from llmd.gpu.layers.quant.gguf_planes import from_planes, repack_part
from llmd.gpu.layers.quant.quant_linear import IntGroupMatmul
from llmd.gpu.layers.quant.scheme import FP8Scheme
from llmd.gpu.layers.quant.triton_quant_mm import QuantWeight, gguf_quant_weight, quant_matmul
from llmd.gpu.layers.quant.triton_quant_moe import (ExpertsWeight, fp8_experts_part, gguf_experts_part,
                                                     quant_fused_experts)


def weight_tensors(weights: list[QuantWeight]) -> list[torch.Tensor]:
    """The tensors the kernel's weights view (what sleep_mode moves with their layer)."""
    return [t for w in weights for t in (w.qs, w.d, w.qh, w.sc, w.m) if t is not None]


def _with_bias(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [rows, N] with the layer's bias (unless the layer reduces: added after), as x's leading shape."""
    bias = None if getattr(layer, "reduce", False) else layer.bias
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


class TritonGGUFMatmul:
    """x -> x W^T (+ b unless the layer reduces) over a packed layer's parts (`layer`:
    anything with in_features, weight, packed_parts, bias), each part laid out as
    planes now if it is not yet."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        cols = layer.in_features
        self.parts = [gguf_quant_weight(repack_part(layer.weight, part, cols), part.quant, cols)
                      for part in layer.packed_parts]

    def held_tensors(self) -> list[torch.Tensor]:
        return weight_tensors(self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.layer.in_features)
        outs = [quant_matmul(rows, weight) for weight in self.parts]
        return _with_bias(self.layer, x, outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1))


class TritonFP8Matmul:
    """x -> x W^T (+ b unless the layer reduces) over an FP8 layer's `weight` bytes and
    `weight_scales` (module doc)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        weight, scales = layer.weight, layer.weight_scales
        n, k = weight.shape
        self.weight = QuantWeight("FP8", n, k, weight, scales, fp8_group=k // scales.shape[1])
        self.w8a8: dict[torch.dtype, bool] = {}  # by activation dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        rows = x.reshape(-1, self.weight.k)
        if rows.dtype not in self.w8a8:
            self.w8a8[rows.dtype] = w8a8_applies(rows.device, rows.dtype, layer.weight, layer.weight_scales)
        if self.w8a8[rows.dtype] and rows.shape[0] > 0:
            out = w8a8_matmul(rows.contiguous(), layer.weight, layer.weight_scales)
        else:
            out = quant_matmul(rows, self.weight)
        return _with_bias(layer, x, out)


def cuda_quantized_matmul(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The CUDA matmul of a finalized AWQ / GPTQ / FP8 layer (quant_linear.finalize)."""
    if isinstance(layer.quant_method.scheme, FP8Scheme):
        return TritonFP8Matmul(layer)
    return IntGroupMatmul(layer, TritonGGUFMatmul)


class TritonPackedExperts:
    """A MoE layer's packed experts (mlp.ExpertWeights: a GGUF's, an AWQ / GPTQ
    checkpoint's transcoded, FP8) through the grouped kernel (triton_quant_moe), each
    part laid out as planes in place now; its `fused`."""

    def __init__(self, experts: nn.Module) -> None:
        missing = [name for name in ("w13", "w2") if name not in experts.packed_types]
        if missing:
            raise ValueError(f"packed experts whose {missing[0]} is dense have no CUDA kernel; --dequantize loads "
                             "them dense")
        self.num_experts = experts.w13.shape[0]
        self.gate_up, (self.down,) = self._parts(experts, "w13"), self._parts(experts, "w2")

    @staticmethod
    def _parts(experts: nn.Module, name: str) -> list[ExpertsWeight]:
        param, types = getattr(experts, name), experts.packed_types[name]
        if types[0] == FP8:
            rows = experts.inter if name == "w13" else experts.hidden
            scales = getattr(experts, f"{name}_scales")
            return [fp8_experts_part(param, scales, i * rows, (i + 1) * rows) for i in range(len(types))]
        cols = experts.packed_columns(name)
        if not experts.ordered:
            return [gguf_experts_part(param, part, cols) for part in experts.packed_parts_of(name)]
        # act-order: a part per projection, each with its own input order (gate's and up's may differ;
        # down's is usually its columns' own: models/expert_sources.py)
        orders = getattr(experts, f"{name}_order")
        return [gguf_experts_part(param, part, cols, None if _as_they_come(orders[:, i]) else orders[:, i])
                for i, part in enumerate(experts.packed_parts_of(name, merged=False))]

    def held_tensors(self) -> list[torch.Tensor]:
        parts = (*self.gate_up, self.down)
        return weight_tensors([p.first for p in parts]) + [p.order for p in parts if p.order is not None]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: str,
                 ops: LayerOps) -> torch.Tensor:
        return quant_fused_experts(x, self.gate_up, self.down, self.num_experts, weights, ids, activation, ops)


def _as_they_come(orders: torch.Tensor) -> bool:
    """Every expert's input order [experts, cols] the columns' own."""
    own = torch.arange(orders.shape[-1], dtype=orders.dtype, device=orders.device)
    return torch.equal(orders, own.expand_as(orders))


def attach_cuda_expert_kernels(model: nn.Module) -> int:
    """Give every MoE layer's packed experts their CUDA kernel; returns how many."""
    experts = [m for m in model.modules() if getattr(m, "packed_types", None)]
    for module in experts:
        module.fused = TritonPackedExperts(module)
    return len(experts)


def attach_cuda_gguf_kernels(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every GGUF-packed layer of a CUDA model its Triton matmul and every packed
    table the dtype its rows are dequantized to (read through the planes when the LM
    head laid them out); returns how many modules are packed."""
    attach_cuda_expert_kernels(model)
    packed = [m for m in model.modules() if getattr(m, "quant", None) is not None
              and getattr(m, "quant_method", None) is None and not hasattr(m, "packed_types")]
    for module in packed:
        if hasattr(module, "kernel"):
            module.kernel = TritonGGUFMatmul(module)
    for module in packed:  # after the linears: a tied LM head has laid the table out by now
        if hasattr(module, "kernel"):
            continue
        module.compute_dtype = dtype
        (table,) = module.packed_parts
        if table.offset in getattr(module.weight, "plane_parts", frozenset()):
            module.read_rows = _plane_reader(module)
    return len(packed)


def _plane_reader(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: from_planes(module.weight, module.quant, module.in_features, ids)
