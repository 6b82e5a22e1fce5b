"""Mixture-of-experts feed-forward: routing, and the experts of every token in one call.

A token's hidden state goes to `top_k` of the layer's experts (each a gated MLP,
`down(act(gate(x)) * up(x))`), and its output is their outputs weighted by the router's
probabilities. Expert weights are stacked: `w13 [experts, 2 * inter, hidden]` (each
expert's gate rows, then its up rows) and `w2 [experts, hidden, inter]`.

Two implementations of `fused_experts`, the same contract:

- `moe_reference` (any device; the one used off CUDA): the (token, expert) pairs are
  sorted by expert, and each expert that got tokens runs two matmuls over all of its
  rows at once; the weighted rows go back to their tokens with one gather and a sum. The
  loop is over experts, never over tokens, but it reads the per-expert counts on the
  host, so its shapes follow the routing (fine on CPU, not capturable in a CUDA graph).
  Experts kept packed (a GGUF's, an AWQ / GPTQ / FP8 checkpoint's: mlp.ExpertWeights)
  run through it with their own products (`ExpertProducts`: each expert's packed
  matmuls) in place of the two matmuls.
- `fused_moe_triton.triton_fused_experts` (CUDA): vLLM's fused-MoE layout. The pairs are
  sorted by expert and each expert's run padded to a multiple of the kernel's row block
  (moe_align.moe_align_block_size, all on the device), so every row block belongs to one
  expert; one grouped-GEMM launch then covers every expert for gate/up, and one for
  down with the routing weight multiplied in. The sorted-id buffer is sized for the
  worst case of its batch size, so a decode step's shapes never depend on the routing
  and the whole forward can be captured in a CUDA graph. Between its two GEMMs,
  act(gate) * up runs as `ops` says (fused_ops.layer_ops): the torch ops, or one
  Triton kernel (fused_ops_triton.act_and_mul) when the model's layer ops are fused.

The activation is passed by its norms.ACTIVATIONS name, which both the torch function
and the fused kernel are chosen by. The reference always computes in torch: it is what
the Triton path, fused or not, is checked against.

The Triton module is imported only when the Triton path runs, so a CPU process never
loads triton for MoE.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps
from llmd.gpu.layers.norms import ACTIVATIONS, act_and_mul


class ExpertProducts(NamedTuple):
    """Each expert's rows -> rows products: gate_up[e](x) = x w13[e]^T, down[e](h) = h w2[e]^T."""

    gate_up: Sequence[Callable[[torch.Tensor], torch.Tensor]]
    down: Sequence[Callable[[torch.Tensor], torch.Tensor]]


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", use_triton: bool | None = None,
                  ops: LayerOps = UNFUSED) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), [tokens, hidden].
    `use_triton` None: the Triton kernel on CUDA, the reference elsewhere; `ops` runs the
    Triton path's act(gate) * up."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        from llmd.gpu.layers.fused_moe_triton import triton_fused_experts

        return triton_fused_experts(x, w13, w2, topk_weights, topk_ids, activation, ops)
    return moe_reference(x, w13, w2, topk_weights, topk_ids, activation)


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu",
                  products: ExpertProducts | None = None, ops: LayerOps = UNFUSED) -> torch.Tensor:
    """The experts with batched matmuls per expert over its sorted rows (see the module
    docstring); experts that got no token cost nothing. `products`: each expert's own
    matmuls (packed experts), w13 and w2 then only give the experts' count and sizes, and
    act(gate) * up runs as `ops` says (the C++ layers' batch-1 step calls the same)."""
    act = ACTIVATIONS[activation]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    rows = x[tokens]
    out_rows = torch.empty(rows.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            if products is None:
                hidden = act_and_mul(F.linear(rows[start:end], w13[expert]), act)
                out_rows[start:end] = F.linear(hidden, w2[expert])
            else:
                hidden = ops.act_and_mul(products.gate_up[expert](rows[start:end]), activation)
                out_rows[start:end] = products.down[expert](hidden)
            start = end
    out_rows *= topk_weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    # Back to pair order (t * top_k + k) by a gather, then each token's top_k rows summed:
    # CPU index_add_ (a scatter-add) took ~60 ms for two 512-wide rows here.
    return out_rows.index_select(0, torch.argsort(order)).view(-1, top_k, out_rows.shape[1]).sum(dim=1)
