"""The fused MoE kernel in Triton (vLLM's fused_moe layout; the contract is
llmd.gpu.layers.fused_moe.fused_experts). Made for CUDA; on CPU it runs only in Triton's
interpreter (TRITON_INTERPRET=1 set before triton is imported), which is how the tests
check it.

`moe_align_block_size` has grouped the (token, expert) pairs by expert, each expert's
run padded to BLOCK_M rows, so a row block of the sorted list belongs to one expert.
One program computes a BLOCK_M x BLOCK_N tile of `pairs x N`: it gathers its BLOCK_M
pairs' input rows, multiplies them by its block's expert's weight tile over K, and
scatters the tile back to the pairs' own rows. Two launches per layer:

1. gate/up: A = the tokens' hidden states (pair p reads token p // top_k), B = w13,
   out [pairs, 2 * inter];
2. act(gate) * up, run by the layer's ops (torch, or with fused layer ops one Triton
   kernel: fused_ops_triton.act_and_mul), then down: A = that [pairs, inter] (pair p reads row p),
   B = w2, out [pairs, hidden], each row times its routing weight (fp32, before the
   cast to the output type); the top_k rows of a token are summed in torch.

A program whose row block lies past the padded total returns at once, so the grid can
be sized for the worst case of the batch (a CUDA graph replays the same grid whatever
the routing). Padding rows load zeros and store nothing. The activation between the
launches sizes its grid by the number of pairs alone, so the whole path stays free of
host syncs whichever ops run it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.gpu.layers.fused_ops import LayerOps
from llmd.gpu.layers.moe_align import moe_align_block_size

# Whether the kernel runs in Triton's interpreter (decided when triton was imported).
# The interpreter does no arithmetic on bf16 (it holds bf16 as uint16 bits and tl.dot
# multiplies those: triton-lang/triton#11584), so there bf16 tiles are widened to fp32
# before the dot (the same products as a GPU's bf16 MMA, which accumulates in fp32).
INTERPRETED = bool(triton.knobs.runtime.interpret)
_TL_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                  N, K, num_pairs, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                  TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, OUT_TYPE: tl.constexpr, DOT_F32: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[pair, n] = sum_k a[pair // TOP_K, k] * b[expert(pair), n, k] (x weight[pair])."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
    # Columns past N wrap onto real ones (never stored), so B loads need no mask on n.
    b_ptrs = b_ptr + expert * stride_be + (offs_n[None, :] % N) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(OUT_TYPE), mask=valid[:, None] & (offs_n[None, :] < N))


def block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks while the experts see a few rows
    each (decode), where a larger block would be mostly padding; 64 once they see many."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    return block_m, 64, 32


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
            work: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, blocks: tuple[int, int, int]) -> None:
    sorted_ids, expert_ids, num_padded = work
    block_m, block_n, block_k = blocks
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.numel() * triton.cdiv(n, block_n),)
    _grouped_gemm[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, expert_ids, num_padded,
        n, k, out.shape[0], a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        TOP_K=top_k, MUL_WEIGHT=weights is not None, OUT_TYPE=_TL_TYPES[out.dtype],
        DOT_F32=INTERPRETED and a.dtype == torch.bfloat16,
        PRECISION="ieee" if a.dtype == torch.float32 else None,  # fp32: no TF32 rounding
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def triton_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, activation: str, ops: LayerOps) -> torch.Tensor:
    """fused_experts with the grouped-GEMM kernel (see the module docstring); `activation`
    a norms.ACTIVATIONS name, applied by `ops.act_and_mul`."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.shape[0], x.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:  # an empty grid cannot launch
        return torch.zeros_like(x)
    blocks = block_sizes(num_pairs, num_experts)
    work = moe_align_block_size(topk_ids, blocks[0], num_experts)
    x = x.contiguous()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, w13, gate_up, None, work, top_k, blocks)
    inner = ops.act_and_mul(gate_up, activation)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(inner, w2, out, topk_weights.reshape(-1).float().contiguous(), work, 1, blocks)
    return out.view(tokens, top_k, hidden).sum(dim=1)
