"""The feed-forward blocks: a gated MLP, and a sparse mixture of experts.

`GatedMLP` is down(act(gate(x)) * up(x)) with gate and up fused into one projection.

`SparseMoeBlock` routes each token to `top_k` experts (fused_moe: softmax over the
experts, the top_k, renormalised when the architecture does) and sums their outputs by
the routing weights; Qwen2-MoE adds a shared expert that every token runs, scaled by
sigmoid(shared_expert_gate(x)).

Tensor parallelism splits every expert's intermediate dimension across the ranks (as the
dense MLP is split): each rank holds rows [r * I / n, (r + 1) * I / n) of every expert's
gate and up projections and the matching columns of its down projection, and the same
slice of the shared expert; the router is replicated, so every rank routes every token
identically. Each rank's experts and shared expert then give a partial sum of the
layer's output, and one all-reduce per layer completes it: the same collective as the
dense MLP's. Splitting whole experts across ranks instead would need the tokens
exchanged (all-to-all) and would leave a rank idle whenever the routing favours another
rank's experts; slicing keeps every rank's work equal whatever the routing.

A checkpoint stores each expert separately; `ExpertWeights` loads them into the stacked
parameters the fused kernel reads, `w13 [experts, 2 * inter, hidden]` (expert e's gate
rows, then its up rows) and `w2 [experts, hidden, inter]`: shard (e, 0) / (e, 1) is
expert e's gate / up projection, shard e its down projection.

A GGUF's experts stay packed (`use_packed`, the loader's plan; with TP each rank its
share): `w13` is then uint8 [experts, bytes], each expert's gate rows then its up rows
in their GGUF types (the two may differ: llama.cpp's mixes), `w2` uint8 [experts,
bytes] its down rows. On CPU each expert's projections multiply through
gguf_quant.GGUFMatmul over its rows (`use_kernels`, cpu_kernels.attach_gguf_kernels)
inside the reference MoE loop; on CUDA every expert's at once through the grouped
kernel over packed experts (`fused`, quant/cuda_matmul.TritonPackedExperts).
GPTQ act-order experts (`use_input_orders`) also keep each part's input column order
(`w13_order` [experts, 2, hidden], `w2_order` [experts, 1, inter]): a part whose columns
were sorted by group multiplies x's columns taken in that order, gate and up as one
product where their orders agree (quant_linear.IntGroupMatmul's units). FP8 experts
(`use_fp8`) are kept as quant/fp8's rows instead: `w13` / `w2` the e4m3 bytes [experts,
rows, cols], `w13_scales` / `w2_scales` float32 [experts, rows, groups], each expert
multiplied by fp8.FP8Matmul.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmd.gpu.layers.fused_moe import ExpertProducts, fused_experts, moe_reference
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps
from llmd.gpu.layers.gguf_quant import GGUFMatmul, PackedPart, packed_parts, row_bytes
from llmd.gpu.layers.linear import (MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear, Shard,
                                    WeightLoading, copy_checked, read)
from llmd.gpu.layers.quant.fp8 import FP8Matmul
from llmd.gpu.layers.quant.quant_linear import IntGroupMatmul

FP8 = "FP8"  # packed_types' name for FP8 experts (module doc)
from llmd.gpu.layers.tp import TPShape

# On CPU, bytes of gate/up output a GatedMLP computes at a time: a prefill's rows go
# through in chunks below glibc's largest mmap threshold (32 MiB). A larger tensor is
# mapped afresh on every allocation and each of its pages faulted in and zeroed by the
# kernel: the 1B's gate/up product at 1,024 rows (a 64 MiB output) ran at 126 µs a row
# where into a buffer already faulted in it runs at 103, and act * up's 32 MiB output
# faulted in likewise (~7 ms a layer). Chunks come from the heap, reused from layer to
# layer and step to step, and a prefill holds 16 MiB of gate/up output at a time instead
# of all of it; the weights stream once per chunk (per product already, at any size past
# the L2). The 1B's 32 x 32-token prefill: 4.15 -> 3.68 s (docs/benchmarks.md).
MLP_CHUNK_BYTES = 16 << 20


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused; `size` the whole intermediate
    size (split by rank under TP: tp.share(`role`, size), tp.py); `activation` an
    ACTIVATIONS name, act * up run by `ops`; `reduce=False` leaves down's partial sums to
    the caller (a shared expert). On CPU, rows in chunks of at most MLP_CHUNK_BYTES of
    gate/up output."""

    def __init__(self, hidden_size: int, size: int, bias: bool, activation: str, tp: TPShape | None = None,
                 ops: LayerOps = UNFUSED, reduce: bool = True, role: str = "mlp") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, size, bias, tp, role)
        self.down_proj = RowParallelLinear(size, hidden_size, bias, tp, reduce=reduce, role=role)
        self.activation = activation
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return self._mlp(x)
        rows = x.numel() // x.shape[-1]
        # (float32's 4 bytes a value whatever x's dtype: what the packed products write)
        step = max(1, MLP_CHUNK_BYTES // (self.gate_up_proj.out_features * 4))
        if rows <= step:
            return self._mlp(x)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.cat([self._mlp(flat[a:a + step]) for a in range(0, rows, step)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.activation))


@dataclass(frozen=True)
class MoeSpec:
    """What a config says about its experts (sizes whole, before tensor parallelism)."""

    num_experts: int
    top_k: int
    renormalize: bool  # rescale the top_k weights to sum to 1
    expert_size: int  # each expert's intermediate size
    shared_expert_size: int | None  # Qwen2-MoE's shared expert; None: none
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block (else a dense MLP)


class ExpertWeights(WeightLoading, nn.Module):
    """Every expert's weights, stacked (module doc); with TP, inter is this rank's slice
    `share` of each expert's intermediate dimension (tp.share("experts"), tp.py).
    Packed (module doc): `packed_types[attr]` the types of w13's parts (gate, up) or
    w2's (down), absent while dense."""

    split_role = "experts"  # the loader's plan finds the packed blocks a share must hold (tp.py)

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int, tp: TPShape | None) -> None:
        super().__init__()
        self.rank, self.world_size = (0, 1) if tp is None else (tp.rank, tp.world_size)
        self.share = (0, expert_size) if tp is None else tp.share(self.split_role, expert_size)
        self.inter = self.share[1] - self.share[0]
        self.hidden = hidden_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter))
        self.packed_types: dict[str, tuple[str, ...]] = {}
        self.quant_tensors: tuple[str, ...] = ()  # the packed ones (memory_profile.weight_storage)
        self.products: ExpertProducts | None = None  # packed: each expert's matmuls (use_kernels)
        self.fused: Any = None  # packed on CUDA: (x, weights, ids, activation, ops) -> out (cuda_matmul)
        self._views: dict[str, list[Any]] = {}
        self.ordered = False  # act-order: w13_order / w2_order hold each part's input order

    def shards(self, name: str) -> Sequence[Shard]:
        experts = range(self.w13.shape[0])
        return [(e, part) for e in experts for part in (0, 1)] if name == "w13" else list(experts)

    def packed_columns(self, name: str) -> int:
        """The weights in a row of `name`'s projections (what a packed type's blocks must fit)."""
        return self.hidden if name == "w13" else self.inter

    def use_packed(self, quant: str | Mapping[Shard, str], name: str = "w13") -> None:
        """Keep `name`'s experts packed: in type `quant`, or {shard: type}, one type per
        part across the experts (an expert tensor of the file gives a part of every
        expert); before loading."""
        parts = (0, 1) if name == "w13" else (None,)
        if isinstance(quant, Mapping):
            by_part: dict[Shard, set[str]] = {}
            for shard, q in quant.items():
                by_part.setdefault(shard[1] if name == "w13" else None, set()).add(q)
            if sorted(by_part, key=str) != sorted(parts, key=str) or any(len(t) != 1 for t in by_part.values()):
                raise ValueError(f"its experts' {name} parts must each come in one type, not {by_part}")
            types = tuple(by_part[p].pop() for p in parts)
        else:
            types = (quant,) * len(parts)
        rows = (self.inter,) * 2 if name == "w13" else (self.hidden,)
        cols = self.packed_columns(name)
        size = sum(r * row_bytes(q, cols) for q, r in zip(types, rows))
        experts = self.w13.shape[0]
        setattr(self, name, nn.Parameter(torch.empty(experts, size, dtype=torch.uint8, device=self.w13.device),
                                         requires_grad=False))
        self.packed_types[name] = types
        self.quant_tensors = tuple(self.packed_types)
        self.quant = "+".join(dict.fromkeys(q for n in ("w13", "w2") for q in self.packed_types.get(n, ())))

    def use_input_orders(self) -> None:
        """Keep each expert part's input column order (module doc); after use_packed,
        before loading."""
        experts = self.w13.shape[0]
        self.register_buffer("w13_order", torch.empty(experts, 2, self.hidden, dtype=torch.int32,
                                                      device=self.w13.device))
        self.register_buffer("w2_order", torch.empty(experts, 1, self.inter, dtype=torch.int32,
                                                     device=self.w13.device))
        self.ordered = True
        self.quant_tensors = (*self.packed_types, "w13_order", "w2_order")

    def use_fp8(self, name: str, groups: int) -> None:
        """Keep `name`'s experts as FP8 (module doc), `groups` scales a row; before loading."""
        experts, rows = self.w13.shape[0], 2 * self.inter if name == "w13" else self.hidden
        device = self.w13.device
        setattr(self, name, nn.Parameter(torch.empty(experts, rows, self.packed_columns(name), dtype=torch.uint8,
                                                     device=device), requires_grad=False))
        self.register_buffer(f"{name}_scales", torch.empty(experts, rows, groups, dtype=torch.float32, device=device))
        self.packed_types[name] = (FP8,) * (2 if name == "w13" else 1)
        self.quant_tensors = (*self.packed_types, *(f"{n}_scales" for n, t in self.packed_types.items() if t[0] == FP8))
        self.quant = "fp8-e4m3"

    def packed_quant(self, shard: Shard, name: str = "weight") -> str | None:
        types = self.packed_types.get(name)
        if types is None:
            return None
        return types[shard[1]] if name == "w13" else types[0]

    def load(self, name: str, param: nn.Parameter, source: Any, shard: Shard = None) -> None:
        if shard not in self.shards(name):
            raise ValueError(f"names expert shard {shard!r}, which this model does not have")
        if name in self.packed_types:
            self._load_packed(name, param, source, shard)
            return
        mine, whole = self.share, self.world_size == 1
        if name == "w13":
            expert, part = shard
            rows = param.data[expert, part * self.inter:(part + 1) * self.inter]
            copy_checked(rows, read(source) if whole else read(source, rows=mine))
        else:
            copy_checked(param.data[shard], read(source) if whole else read(source, cols=mine))

    def _load_packed(self, name: str, param: nn.Parameter, source: Any, shard: Shard) -> None:
        """An expert's packed rows of one part, copied in as they are; with TP this rank's
        share of them (w13's rows, w2's columns: whole blocks, gguf_quant.PackedSource)."""
        if self.world_size > 1:
            source = source.rows(*self.share) if name == "w13" else source.columns(*self.share)
        types, cols = self.packed_types[name], self.packed_columns(name)
        if types[0] == FP8:
            self._load_fp8(name, param, source, shard)
            return
        if name == "w13":
            (expert, part), rows = shard, self.inter
            start = part * rows * row_bytes(types[0], cols)
        else:
            expert, part, rows, start = shard, 0, self.hidden, 0
        width = row_bytes(types[part], cols)
        copy_checked(param.data[expert, start:start + rows * width].view(rows, width), read(source))
        order = getattr(source, "input_order", None)
        if self.ordered:
            with torch.no_grad():
                getattr(self, f"{name}_order")[expert, part] = torch.arange(cols) if order is None else order
        elif order is not None:
            raise ValueError("orders its input columns (act-order), which this layer was not told to keep")

    def _load_fp8(self, name: str, param: nn.Parameter, source: Any, shard: Shard) -> None:
        """An FP8 expert part's bytes and scales (its scales repeated to the layer's groups)."""
        (expert, part), rows = (shard, self.inter) if name == "w13" else ((shard, 0), self.hidden)
        start = part * rows
        copy_checked(param.data[expert, start:start + rows], read(source))
        target = getattr(self, f"{name}_scales")[expert, start:start + rows]
        scales = source.scales
        if target.shape[1] % scales.shape[1]:
            raise ValueError(f"has {scales.shape[1]} scales a row, which do not divide the layer's {target.shape[1]}")
        copy_checked(target, scales.repeat_interleave(target.shape[1] // scales.shape[1], dim=1))

    def packed_parts_of(self, name: str, merged: bool = True) -> tuple[PackedPart, ...]:
        """Where each type's rows lie in one expert's packed `name` (gguf_quant.PackedPart);
        not `merged`: a part per projection (gate, up) whatever their types."""
        rows = (self.inter,) * 2 if name == "w13" else (self.hidden,)
        return packed_parts(self.packed_types[name], rows, self.packed_columns(name), merged)

    def use_kernels(self, ops: Any, x16_passes: int, fp8_ops: Any = None) -> None:
        """Each expert's products (`products`): a packed projection through GGUFMatmul over
        its rows (`ops`, `x16_passes`: as a packed linear layer's), an FP8 one through
        FP8Matmul (`fp8_ops`), a dense one F.linear."""
        def products(name: str) -> list[Any]:
            param = getattr(self, name)
            if name not in self.packed_types:
                return [lambda x, w=param[e]: F.linear(x, w) for e in range(param.shape[0])]
            if self.packed_types[name][0] == FP8:
                scales = getattr(self, f"{name}_scales")
                return [FP8Matmul(_PackedExpert(param[e], (), param.shape[2], scales[e]), fp8_ops)
                        for e in range(param.shape[0])]
            if name not in self._views:  # made once: an x16 repack is recorded on its view (use_x16)
                self._views[name] = [self._expert_view(name, e) for e in range(param.shape[0])]
            if self.ordered:
                return [IntGroupMatmul(view, lambda unit: GGUFMatmul(unit, ops, x16_passes))
                        for view in self._views[name]]
            return [GGUFMatmul(view, ops, x16_passes) for view in self._views[name]]

        self.products = ExpertProducts(products("w13"), products("w2"))

    def _expert_view(self, name: str, expert: int) -> _PackedExpert:
        """Expert `expert`'s packed `name` as its products read it: with input orders, its
        parts grouped into units of one order each (None: the columns as they come)."""
        view = _PackedExpert(getattr(self, name)[expert], self.packed_parts_of(name), self.packed_columns(name))
        if not self.ordered:
            return view
        orders = [o if not torch.equal(o, torch.arange(o.numel(), dtype=o.dtype)) else None
                  for o in getattr(self, f"{name}_order")[expert]]
        if name == "w2" or _same(orders[0], orders[1]):
            view.order_0 = orders[0]
            view.int_units = [("order_0" if orders[0] is not None else None, view.packed_parts)]
            return view
        gate, up = self.packed_parts_of(name, merged=False)
        view.order_0, view.order_1 = orders
        view.int_units = [("order_0" if orders[0] is not None else None, (gate,)),
                          ("order_1" if orders[1] is not None else None, (up,))]
        return view


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class _PackedExpert:
    """One expert's packed projection, as GGUFMatmul reads a layer (its rows, their parts)
    and, with input orders, as IntGroupMatmul does (`int_units`, the orders by name)."""

    bias = None
    reduce = False

    def __init__(self, weight: torch.Tensor, parts: tuple[PackedPart, ...], in_features: int,
                 weight_scales: torch.Tensor | None = None) -> None:
        self.weight, self.packed_parts, self.in_features = weight, parts, in_features
        self.weight_scales = weight_scales  # an FP8 expert's (fp8.FP8Matmul)
        self.int_units: list[tuple[str | None, tuple[PackedPart, ...]]] = []


class SparseMoeBlock(nn.Module):
    """Router (`gate`), experts, optional shared expert; one all-reduce under TP.
    `activation` is an ACTIVATIONS name; `use_triton` None: the fused Triton kernel on
    CUDA, the reference elsewhere; `ops` runs the shared expert's act * up and the
    Triton experts'."""

    def __init__(self, hidden_size: int, spec: MoeSpec, tp: TPShape | None, activation: str,
                 ops: LayerOps = UNFUSED) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.reduce = tp is not None and tp.world_size > 1
        self.activation = activation
        self.ops = ops
        self.use_triton: bool | None = None
        self.cpp_experts: Any = None  # packed experts on CPU: their loop in C++ (cpu_decode_layers.CppExperts)
        self.gate = ReplicatedLinear(hidden_size, spec.num_experts)
        self.gate.plain_matmul = True  # few outputs: F.linear, not oneDNN (cpu_linear.pack_linears)
        self.experts = ExpertWeights(spec.num_experts, hidden_size, spec.expert_size, tp)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_size is not None:
            self.shared_expert = GatedMLP(hidden_size, spec.shared_expert_size, False, activation, tp, ops,
                                          reduce=False, role="shared_expert")
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
            self.shared_expert_gate.plain_matmul = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.route(self.gate, x, self.top_k, self.renormalize)
        experts = self.experts
        if experts.packed_types:
            if experts.products is None and experts.fused is None:
                raise RuntimeError(f"experts packed as {experts.quant} have no kernels "
                                   "(cpu_kernels.attach_gguf_kernels)")
            cpp = self.cpp_experts
            if experts.fused is not None:
                out = experts.fused(x, weights, ids, self.activation, self.ops)
            elif cpp is not None and ids.numel() <= cpp.max_rows:
                out = cpp(x, weights, ids)
            else:
                out = moe_reference(x, experts.w13, experts.w2, weights, ids, self.activation, experts.products,
                                    self.ops)
        else:
            out = fused_experts(x, experts.w13, experts.w2, weights, ids, self.activation, self.use_triton, self.ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.reduce:
            dist.all_reduce(out)
        return out
