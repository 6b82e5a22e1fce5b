"""Packed experts on a GPU: the fused-MoE grouped GEMM (fused_moe_triton's layout and
contract) with each expert's weight dequantized inside the matmul, as the packed dense
layers' kernel does (triton_quant_mm: its K loop, `_k_tiles`, is this kernel's).

A MoE layer's experts are held stacked (mlp.ExpertWeights): w13 uint8 [experts, bytes],
each expert's gate rows then its up rows, each part in its own GGUF type (an AWQ / GPTQ
checkpoint's transcoded into Q4_0 / Q5_0 / Q8_0 at load; GPTQ act-order experts with an
input column order per part, which the kernel takes x's columns in), and w2 its down rows; or FP8
e4m3 bytes [experts, rows, cols] with float32 scales per row and group of columns. Each
part of every expert is laid out as planes in place (gguf_planes, once; the same bytes),
so one part's planes lie at the same offsets in every expert's row of bytes: the kernel
reads expert e's at expert 0's pointers plus e times the row's stride (`ExpertsWeight`).

One launch per part (gate, up: into their columns of one [pairs, 2 * inter] output;
down: the routing weight multiplied in): moe_align_block_size groups the (token, expert)
pairs by expert, each expert's run padded to the tile's BM rows, and a program computes
a BM x BN tile of one row block (one expert) over a range of K tiles. While the experts
see about one row each (decode: pairs <= experts) the tile is the dense kernel's GEMV
with BM 1 — each pair its own program, no padding — else a tl.dot tile (BM 16, 32, 64 by
the rows an expert sees). Split-K as the dense kernel: fp32 partial sums added in one
launch (split_sum). The grid is sized for the worst case of the batch's pairs, and nothing is
read back to the host, so the layer can be captured in a CUDA graph.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmd.gpu.layers.fused_ops import LayerOps
from llmd.gpu.layers.gguf_quant import PackedPart, part_weight
from llmd.gpu.layers.moe_align import moe_align_block_size
from llmd.gpu.layers.quant.gguf_planes import to_planes
from llmd.gpu.layers.quant.quant_tiles import Tiles, sm_count, tiles_for
from llmd.gpu.layers.quant.split_sum import sum_splits
from llmd.gpu.layers.quant.triton_quant_mm import (QuantWeight, _k_tiles, _store_tile, gguf_quant_weight,
                                                    kernel_meta, split_plan, weight_planes)


@dataclass(frozen=True)
class ExpertsWeight:
    """One projection part of every expert: `first` the kernel's view of expert 0's rows,
    each of its five pointers (qs, qh, sc, d, m: weight_planes' order) `strides[i]`
    elements further per expert; `order` (GPTQ act-order) expert 0's input column order
    (int32 [cols]: weight column k multiplies x's column order[k]), `order_stride`
    elements further per expert."""

    first: QuantWeight
    strides: tuple[int, ...]
    order: torch.Tensor | None = None
    order_stride: int = 0


def gguf_experts_part(param: torch.Tensor, part: PackedPart, cols: int,
                      orders: torch.Tensor | None = None) -> ExpertsWeight:
    """Part `part` of every expert's packed rows (`param` uint8 [experts, bytes]), laid
    out as planes in place now if it is not yet (the parameter records which parts are);
    `orders` int32 [experts, cols]: each expert's input column order for the part."""
    done = getattr(param, "plane_parts", frozenset())
    if part.offset not in done:
        with torch.no_grad():
            for expert in param:
                rows = part_weight(expert, part, cols)
                rows.reshape(-1).copy_(to_planes(rows, part.quant, cols))
        param.plane_parts = done | {part.offset}
    first = gguf_quant_weight(part_weight(param[0], part, cols).reshape(-1), part.quant, cols)
    if orders is None:
        return ExpertsWeight(first, _expert_strides(first, param.stride(0)))
    return ExpertsWeight(first, _expert_strides(first, param.stride(0)), orders[0], orders.stride(0))


def fp8_experts_part(param: torch.Tensor, scales: torch.Tensor, start: int, end: int) -> ExpertsWeight:
    """Rows [start, end) of every FP8 expert (`param` e4m3 bytes [experts, rows, cols],
    `scales` float32 [experts, rows, groups])."""
    cols = param.shape[2]
    first = QuantWeight("FP8", end - start, cols, param[0, start:end], scales[0, start:end],
                        fp8_group=cols // scales.shape[2])
    planes, _ = weight_planes(first)
    return ExpertsWeight(first, tuple(scales.stride(0) if p is first.d else param.stride(0) for p in planes))


def _expert_strides(first: QuantWeight, expert_bytes: int) -> tuple[int, ...]:
    planes, _ = weight_planes(first)
    if any(expert_bytes % p.element_size() for p in planes):
        raise ValueError(f"an expert's {expert_bytes} bytes do not hold whole {first.quant} scales")
    return tuple(expert_bytes // p.element_size() for p in planes)


@triton.jit
def _quant_moe_kernel(X, OUT, WEIGHTS, SORTED, EXPERT_IDS, NUM_PADDED, QS, QH, SC, D, MN, N, K, num_pairs,
                      stride_xm, stride_om, stride_os, stride_qs, stride_qh, stride_sc, stride_d, stride_m,
                      e_qs, e_qh, e_sc, e_d, e_m, fp8_group, tiles_per_split, ORDER, e_order,
                      ORDERED: tl.constexpr, TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, QUANT: tl.constexpr,
                      STREAMS: tl.constexpr, PAIR: tl.constexpr, ZERO: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, H: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                      DOT_F32: tl.constexpr, PARTIAL: tl.constexpr, STAGES: tl.constexpr, EVEN_N: tl.constexpr,
                      EVEN_K: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """out[pair, n] = sum_k x[pair // TOP_K, k] * w[expert(pair), n, k] (x weight[pair])."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if pid_m * BM >= tl.load(NUM_PADDED):
        return
    pairs = tl.load(SORTED + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mmask = pairs < num_pairs  # padding rows: load zeros, store nothing
    expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = tl.full([BN], True, tl.int1) if EVEN_N else rn < N
    if DOT:
        acc = tl.zeros([BM, BN], tl.float32)
    else:
        acc = tl.zeros([BN, H], tl.float32)
    first = pid_s * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BK))
    acc = _k_tiles(acc, X, (pairs // TOP_K) * stride_xm, mmask, QS + expert * e_qs, QH + expert * e_qh,
                   SC + expert * e_sc, D + expert * e_d, MN + expert * e_m, rn, nmask, K, first, last, stride_qs,
                   stride_qh, stride_sc, stride_d, stride_m, fp8_group, ORDER + expert * e_order, QUANT, STREAMS,
                   PAIR, ZERO, GP, BN, BK, H, DOT, IEEE, DOT_F32, STAGES, EVEN_K, ORDERED, SCALE_WORDS)
    if not DOT:
        acc = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    if MUL_WEIGHT:
        acc = acc * tl.load(WEIGHTS + pairs, mask=mmask, other=0.0)[:, None]
    _store_tile(OUT + pid_s * stride_os + pairs[:, None] * stride_om + rn[None, :], acc,
                mmask[:, None] & nmask[None, :], PARTIAL)


def moe_tiles(num_pairs: int, num_experts: int, quant: str) -> Tiles:
    """The tile for `num_pairs` pairs over `num_experts` experts (module doc): the GEMV
    while the experts see about one row each, else tl.dot sized by the rows an expert sees."""
    rows = 1 if num_pairs <= num_experts else max(2, -(-num_pairs // num_experts))
    return tiles_for(rows, quant)


def experts_matmul(x: torch.Tensor, weight: ExpertsWeight, out: torch.Tensor,
                   work: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int,
                   route_weights: torch.Tensor | None, tiles: Tiles, split_k: int | None = None) -> None:
    """out[pair] = x[pair // top_k] times the weight of the pair's expert (x route_weights[pair]);
    `out` [pairs, n] may be a column slice of a wider tensor; `work` moe_align_block_size's
    for tiles.bm."""
    grid, args, meta, target = experts_launch(x, weight, out, work, top_k, route_weights, tiles, split_k,
                                              sm_count(x.device))
    _quant_moe_kernel[grid](*args, **meta)
    if target is not out:
        sum_splits(target, out)


def experts_launch(x: torch.Tensor, weight: ExpertsWeight, out: torch.Tensor,
                   work: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int,
                   route_weights: torch.Tensor | None, tiles: Tiles, split_k: int | None,
                   sms: int) -> tuple[tuple[int, int, int], tuple, dict, torch.Tensor]:
    """experts_matmul's launch on a device of `sms` multiprocessors: (grid, arguments,
    keyword arguments, the tensor the kernel writes: `out`, or [splits, pairs, n] float32
    partial sums to add), as triton_quant_mm.kernel_launch (tools/quant_kernel_resources.py
    compiles it for sm_90 from CPU tensors)."""
    sorted_ids, expert_ids, num_padded = work
    w = weight.first
    grid_m, grid_n = expert_ids.numel(), triton.cdiv(w.n, tiles.bn)
    splits, per_split = split_plan(grid_m * grid_n, w, tiles, split_k, sms)
    pairs = out.shape[0]
    target = out if splits == 1 else torch.empty(splits, pairs, w.n, dtype=torch.float32, device=x.device)
    planes, strides = weight_planes(w)
    args = (x, target, route_weights if route_weights is not None else target, sorted_ids, expert_ids, num_padded,
            *planes, w.n, w.k, pairs, x.stride(0), target.stride(-2), target.stride(0) if splits > 1 else 0,
            *strides, *weight.strides, max(1, w.fp8_group), per_split,
            weight.order if weight.order is not None else x, weight.order_stride)
    meta = dict(ORDERED=weight.order is not None, TOP_K=top_k, MUL_WEIGHT=route_weights is not None,
                **kernel_meta(w, tiles, x.dtype, splits))
    return (grid_m, grid_n, splits), args, meta, target


def quant_fused_experts(x: torch.Tensor, gate_up: Sequence[ExpertsWeight], down: ExpertsWeight,
                        num_experts: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                        ops: LayerOps, split_k: int | None = None) -> torch.Tensor:
    """fused_moe.fused_experts over packed experts: `gate_up` the parts of w13 (their
    rows in order: gate, then up), `down` w2's; act(gate) * up by `ops`."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:  # an empty grid cannot launch
        return torch.zeros_like(x)
    tiles = [moe_tiles(num_pairs, num_experts, part.first.quant) for part in (*gate_up, down)]
    work = moe_align_block_size(topk_ids, tiles[0].bm, num_experts)  # every part's BM is the rows' alone
    x = x.contiguous()
    hidden = torch.empty(num_pairs, sum(part.first.n for part in gate_up), dtype=x.dtype, device=x.device)
    col = 0
    for part, part_tiles in zip(gate_up, tiles):
        experts_matmul(x, part, hidden[:, col:col + part.first.n], work, top_k, None, part_tiles, split_k)
        col += part.first.n
    inner = ops.act_and_mul(hidden, activation)
    out = torch.empty(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    experts_matmul(inner, down, out, work, 1, topk_weights.reshape(-1).float().contiguous(), tiles[-1], split_k)
    return out.view(tokens, top_k, -1).sum(dim=1)
