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
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmd.gpu.layers.fused_moe import fused_experts, select_experts
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps
from llmd.gpu.layers.linear import (MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear, Shard,
                                    WeightLoading, copy_checked, read)
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
    size (split by rank under TP); `activation` an ACTIVATIONS name, act * up run by
    `ops`; `reduce=False` leaves down's partial sums to the caller (a shared expert).
    On CPU, rows in chunks of at most MLP_CHUNK_BYTES of gate/up output."""

    def __init__(self, hidden_size: int, size: int, bias: bool, activation: str, tp: TPShape | None = None,
                 ops: LayerOps = UNFUSED, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, size, bias, tp)
        self.down_proj = RowParallelLinear(size, hidden_size, bias, tp, reduce=reduce)
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
    """Every expert's weights, stacked (module doc); with TP, inter is this rank's slice."""

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int, tp: TPShape | None) -> None:
        super().__init__()
        self.rank, self.world_size = (0, 1) if tp is None else (tp.rank, tp.world_size)
        self.inter = expert_size // self.world_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter))

    def shards(self, name: str) -> Sequence[Shard]:
        experts = range(self.w13.shape[0])
        return [(e, part) for e in experts for part in (0, 1)] if name == "w13" else list(experts)

    def load(self, name: str, param: nn.Parameter, source: Any, shard: Shard = None) -> None:
        if shard not in self.shards(name):
            raise ValueError(f"names expert shard {shard!r}, which this model does not have")
        mine = (self.rank * self.inter, (self.rank + 1) * self.inter)
        whole = self.world_size == 1
        if name == "w13":
            expert, part = shard
            rows = param.data[expert, part * self.inter:(part + 1) * self.inter]
            copy_checked(rows, read(source) if whole else read(source, rows=mine))
        else:
            copy_checked(param.data[shard], read(source) if whole else read(source, cols=mine))


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
        self.gate = ReplicatedLinear(hidden_size, spec.num_experts)
        self.experts = ExpertWeights(spec.num_experts, hidden_size, spec.expert_size, tp)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_size is not None:
            self.shared_expert = GatedMLP(hidden_size, spec.shared_expert_size, False, activation, tp, ops,
                                          reduce=False)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = fused_experts(x, self.experts.w13, self.experts.w2, weights, ids, self.activation, self.use_triton,
                            self.ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.reduce:
            dist.all_reduce(out)
        return out
