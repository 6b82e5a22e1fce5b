"""A decoder's layers run from C++ for a decode step on CPU (one new token of each of its
requests): cpu_decode_layers.cpp's DecoderLayers calls, layer after layer, the operators the
Python layers call at that step (the C++ fused ops, paged decode, packed x16 products,
oneDNN's linear), in the same order on the same tensors, so its result is the Python
path's bit for bit, without the Python between the operators (module calls, checks, views: at batch 1 as
much time as the operators themselves for a 135M model, at 32 rows ~3 ms of Gemma 3
270M's ~55 ms step; docs/benchmarks.md).

`attach_decode_layers` builds it once the kernels are attached, only when every layer
runs exactly those operators: a decoder layer on one rank, with the C++ fused ops, the
paged decode kernel, RMSNorms, and every projection packed in the x16 layout (a GGUF's,
or an AWQ / GPTQ checkpoint's without act-order) or dense in oneDNN's layout (cpu_linear:
a float32 or bfloat16 model's, the weights as packed at load: nothing in llmd changes a
loaded weight, and a sleep that drops them loads a new model); its feed-forward a gated MLP, or a
mixture of experts whose experts are packed so too (mlp.ExpertWeights), its router and
shared-expert gate x16 or dense (F.linear: cpu_linear leaves them so). Anything else
keeps the Python layers; and every step it does not take (a prefill, more decode rows
than every projection's x16 product takes or than the MLP multiplies at once, more than a
mixture of experts' CppExperts take, a quantized KV cache) runs them too
(`DecodeLayers.takes`).

`CppExperts` does the same for a MoE layer's packed experts at any number of rows (a
prefill's, a batch's): the .cpp's MoeExperts runs fused_moe.moe_reference's loop over the
experts with no Python between them; each SparseMoeBlock whose experts qualify gets one
(`cpp_experts`) and uses it for the steps whose rows the x16 product takes.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.attention import AttentionMetadata, TorchAttention
from llmd.gpu.layers.cpu.cpu_fused_ops import ACT_CODES, CPU_FUSED
from llmd.gpu.layers.cpu.cpu_linear import PackedLinearForward
from llmd.gpu.layers.gguf_quant import GGUFMatmul
from llmd.gpu.layers.kv_quant import narrower_float
from llmd.gpu.layers.mlp import MLP_CHUNK_BYTES, GatedMLP, SparseMoeBlock
from llmd.gpu.layers.norms import RMSNorm
from llmd.gpu.layers.quant.quant_linear import IntGroupMatmul

logger = logging.getLogger("llmd.cpu_decode_layers")


class DecodeLayers:
    """The C++ layers of a model (module doc) and what a step must be for them."""

    def __init__(self, layers: Any, rope_keys: list[str], dtype: torch.dtype, max_rows: int = 1) -> None:
        self.layers = layers  # torch.classes.llmd_cpu.DecoderLayers
        self.rope_keys = rope_keys  # the rotary tables' keys, in the order the layers index them
        self.dtype = dtype
        self.max_rows = max_rows  # the most decode rows a step may have (module doc: max_decode_rows)

    def takes(self, hidden: torch.Tensor, md: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step is decode rows alone (one new token of each of up to
        `max_rows` requests), its hidden state of the layers' dtype and its caches of
        floats (the layers' dtype, or float16 / bfloat16 under float32 ones: the operators
        read and write those as they do for the Python layers; a quantized cache's scales
        are not passed)."""
        rows = hidden.shape[0] if hidden.dim() == 2 else 0
        return (1 <= rows <= self.max_rows and hidden.is_contiguous() and md.num_decodes == rows
                and not md.prefills and hidden.dtype == self.dtype and bool(kv_caches)
                and (kv_caches[0].dtype == self.dtype or narrower_float(kv_caches[0].dtype, self.dtype)))

    def __call__(self, hidden: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 kv_caches: list[torch.Tensor], md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual before it is added) for the step's rows."""
        cos = [tables[key][0] for key in self.rope_keys]
        sin = [tables[key][1] for key in self.rope_keys]
        return self.layers.forward(hidden, cos, sin, kv_caches, md.decode_block_table, md.decode_seq_lens,
                                   md.slot_mapping)


def why_not(model: nn.Module) -> str | None:
    """Why the model's layers cannot run as DecodeLayers (None: they can)."""
    if not hasattr(model, "layer_rope_keys") or not len(model.layers):
        return "not a decoder with layers"
    if model.tp is not None:
        return "tensor parallelism"
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not (layer.ops is CPU_FUSED and attn.ops is CPU_FUSED):
            return f"layer {i} does not run the C++ fused ops"
        if not isinstance(mlp, GatedMLP | SparseMoeBlock) or mlp.ops is not CPU_FUSED or \
                mlp.activation not in ACT_CODES:
            return f"layer {i}'s feed-forward is not a gated MLP or experts of the C++ fused ops"
        if not isinstance(attn.attn, TorchAttention) or attn.attn.decode_kernel is None:
            return f"layer {i} does not decode through the paged decode kernel"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.sandwich:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if not all(isinstance(n, RMSNorm) for n in norms):
            return f"layer {i} has a norm other than RMSNorm"
        if any(n.weight.dtype != model.layers[0].input_layernorm.weight.dtype for n in norms):
            return f"layer {i}'s norms differ in dtype from the model's"
        if isinstance(mlp, SparseMoeBlock) and (reason := _why_not_experts(mlp)) is not None:
            return f"layer {i}'s {reason}"
        projections = (mlp.gate_up_proj, mlp.down_proj) if isinstance(mlp, GatedMLP) else ()
        if not all(_x16(p.kernel) or _onednn(p.kernel) for p in (attn.qkv_proj, attn.o_proj, *projections)):
            return f"layer {i}'s projections are neither packed in the x16 layout nor dense in oneDNN's"
    return None


def _onednn(kernel: Any) -> bool:
    """Whether a product is a dense weight's in oneDNN's layout, its bias added by oneDNN
    (cpu_linear: every dense linear of a model on one rank)."""
    return isinstance(kernel, PackedLinearForward) and kernel.with_bias


def _x16(kernel: Any) -> bool:
    """Whether a product is a packed weight's, every part in the x16 layout."""
    return _x16_parts(kernel) is not None


def _x16_parts(kernel: Any) -> list[tuple[Any, int, torch.Tensor, int]] | None:
    """A packed product's parts (gguf_quant.GGUFMatmul.parts: part, type code, rows,
    passes) in output order, every one in the x16 layout; None if it is not such a
    product. An AWQ / GPTQ layer's (quant_linear.IntGroupMatmul) qualifies when no unit
    reorders x (no act-order): its units' parts side by side are its output."""
    if isinstance(kernel, IntGroupMatmul):
        units = [mm for order, mm in kernel.units if order is None]
        if len(units) != len(kernel.units):
            return None
        parts = [_x16_parts(mm) for mm in units]
        return None if any(p is None for p in parts) else [part for unit in parts for part in unit]
    if isinstance(kernel, GGUFMatmul) and all(passes for *_, passes in kernel.parts):
        return list(kernel.parts)
    return None


def _expert_parts(mlp: SparseMoeBlock) -> Iterator[tuple[str, int, torch.Tensor, int, int, int]]:
    """(projection, expert, packed rows, type code, columns, passes) of every x16 part of
    the layer's experts, as DecoderLayers.add_expert_part and MoeExperts.add_part take them."""
    products = mlp.experts.products
    for name, attr, kernels in (("gate_up", "w13", products.gate_up), ("down", "w2", products.down)):
        cols = mlp.experts.packed_columns(attr)
        for expert, kernel in enumerate(kernels):
            for part, code, weight, passes in _x16_parts(kernel):
                yield name, expert, weight, code, cols, passes


def _x16_max_rows(kernel: Any) -> int:
    """The most rows an x16 product (one that _x16 takes) multiplies through its kernel;
    oneDNN's linear takes any."""
    if _onednn(kernel):
        return 1 << 30
    if isinstance(kernel, IntGroupMatmul):
        return min(_x16_max_rows(mm) for _, mm in kernel.units)
    return min(kernel.max_rows[passes] for *_, passes in kernel.parts)


def _why_not_experts(mlp: SparseMoeBlock) -> str | None:
    products = mlp.experts.products
    if mlp.reduce or products is None:
        return "experts are not packed on one rank"
    if not all(_x16(kernel) for kernel in (*products.gate_up, *products.down)):
        return "experts are not all packed in the x16 layout"
    gates = [mlp.gate] if mlp.shared_expert is None else [mlp.gate, mlp.shared_expert_gate]
    if not all(_x16(g.kernel) or (g.kernel is None and g.quant is None) for g in gates):
        return "router is neither packed in the x16 layout nor dense"
    shared = mlp.shared_expert
    if shared is not None and not (shared.ops is CPU_FUSED and _x16(shared.gate_up_proj.kernel)
                                   and _x16(shared.down_proj.kernel)):
        return "shared expert is not packed in the x16 layout"
    return None


def build_decode_layers(model: nn.Module) -> DecodeLayers | None:
    """The model's DecodeLayers, or None (logged at debug level) when why_not says no."""
    reason = why_not(model)
    if reason is not None:
        logger.debug("decode steps keep the Python layers: %s", reason)
        return None
    rope_keys = list(dict.fromkeys(model.layer_rope_keys))
    layers = torch.classes.llmd_cpu.DecoderLayers()
    for layer, key in zip(model.layers, model.layer_rope_keys):
        attn = layer.self_attn
        kernel = attn.attn
        layers.add_layer(attn.num_heads, attn.num_kv_heads, attn.head_dim, kernel.scale, kernel.softcap or 0.0,
                         kernel.sliding_window or 0, rope_keys.index(key), ACT_CODES[layer.mlp.activation],
                         layer.sandwich, layer.residual_multiplier)
        norms = {"input": layer.input_layernorm, "post_attention": layer.post_attention_layernorm,
                 "q_norm": attn.q_norm, "k_norm": attn.k_norm}
        if layer.sandwich:
            norms.update(pre_feedforward=layer.pre_feedforward_layernorm,
                         post_feedforward=layer.post_feedforward_layernorm)
        for name, norm in norms.items():
            if norm is not None:
                layers.set_norm(name, norm.weight, norm.eps, norm.gemma_scale)
        mlp = layer.mlp
        projections = [("qkv", attn.qkv_proj), ("o", attn.o_proj)]
        if isinstance(mlp, GatedMLP):
            projections += [("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)]
        else:
            projections += _add_experts(layers, mlp)
        for name, proj in projections:
            _add_projection(layers, name, proj)
    return DecodeLayers(layers, rope_keys, model.layers[0].input_layernorm.weight.dtype, max_decode_rows(model))


def max_decode_rows(model: nn.Module) -> int:
    """The most decode rows DecoderLayers may run for the model as the Python layers run
    them: as many as every projection's x16 product takes (more go through a dequantized
    GEMM) and every gated MLP multiplies at once (more are split into chunks); a mixture of
    experts as many as its CppExperts take (more (row, expert) pairs go through the Python
    loop), with its router's and shared expert's limits (one row where it has no
    CppExperts)."""
    rows = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        rows += [_x16_max_rows(attn.qkv_proj.kernel), _x16_max_rows(attn.o_proj.kernel)]
        if isinstance(mlp, SparseMoeBlock):
            if mlp.cpp_experts is None:
                return 1
            rows.append(mlp.cpp_experts.max_rows // mlp.top_k)
            gates = [mlp.gate] if mlp.shared_expert is None else [mlp.gate, mlp.shared_expert_gate]
            rows += [_x16_max_rows(g.kernel) for g in gates if g.kernel is not None]
            mlp = mlp.shared_expert
        if mlp is not None:
            rows += [_x16_max_rows(mlp.gate_up_proj.kernel), _x16_max_rows(mlp.down_proj.kernel),
                     MLP_CHUNK_BYTES // (mlp.gate_up_proj.out_features * 4)]  # as GatedMLP.forward
    return max(1, min(rows))


def _add_projection(layers: Any, name: str, proj: nn.Module) -> None:
    """A projection of the last layer: its x16 parts (and bias), or its dense weight (a
    router's, F.linear's)."""
    kernel = proj.kernel
    if kernel is None:
        layers.set_dense(name, proj.weight, proj.bias)
        return
    if _onednn(kernel):
        layers.set_onednn(name, kernel.packed, proj.bias)
        return
    bias = proj.bias if kernel.with_bias else None
    for part, code, weight, passes in _x16_parts(kernel):
        layers.add_part(name, weight, code, proj.in_features, passes)
    if bias is not None:
        layers.set_bias(name, bias)


def _add_experts(layers: Any, mlp: SparseMoeBlock) -> list[tuple[str, nn.Module]]:
    """The last layer's experts set (their parts); the projections of its router and
    shared expert, for _add_projection."""
    shared = mlp.shared_expert
    layers.set_moe(len(mlp.experts.products.gate_up), mlp.top_k, mlp.renormalize, shared is not None)
    for part in _expert_parts(mlp):
        layers.add_expert_part(*part)
    if shared is None:
        return [("router", mlp.gate)]
    return [("router", mlp.gate), ("shared_gate", mlp.shared_expert_gate), ("shared_gate_up", shared.gate_up_proj),
            ("shared_down", shared.down_proj)]


def attach_decode_layers(model: nn.Module) -> bool:
    """Give a CPU model whose layers qualify (why_not) its DecodeLayers (`decode_layers`,
    which its forward uses for the steps they take), and each MoE layer whose experts
    qualify its CppExperts; whether it got the DecodeLayers."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.cpp_experts = CppExperts.build(module)
    model.decode_layers = build_decode_layers(model)
    return model.decode_layers is not None


class CppExperts:
    """A MoE layer's packed experts run from C++ (module doc): `max_rows` the most
    (row, expert) pairs a step may route for the x16 product to take every expert's."""

    def __init__(self, experts: Any, max_rows: int, act: int) -> None:
        self.experts, self.max_rows, self.act = experts, max_rows, act

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.experts.forward(x, weights, ids, self.act)

    @staticmethod
    def build(mlp: SparseMoeBlock) -> CppExperts | None:
        """The layer's CppExperts, or None where its experts are not packed x16 on one
        rank or it does not run the C++ fused ops."""
        products = mlp.experts.products
        if mlp.reduce or products is None or mlp.ops is not CPU_FUSED or mlp.activation not in ACT_CODES:
            return None
        kernels = (*products.gate_up, *products.down)
        if not all(_x16(k) for k in kernels):
            return None
        experts = torch.classes.llmd_cpu.MoeExperts(len(products.gate_up))
        for part in _expert_parts(mlp):
            experts.add_part(*part)
        return CppExperts(experts, min(_x16_max_rows(k) for k in kernels), ACT_CODES[mlp.activation])
