"""A stand-in for flash-attn's `flash_attn_varlen_func`, written from its documented
contract (flash-attn 2.6+), so the flash_attn backend's calls can be checked on a
machine without CUDA or flash-attn. Only the tests put this folder on sys.path.

It refuses what the real kernel's C++ checks refuse (dtype, int32 index tensors, a head
dimension at stride 1, paged blocks of a multiple of 256 tokens, table shape) and
computes, row by row in fp32, what the kernel computes: each query sequence attends to
its own context, read through its block table, causally aligned to the end of the
context, query head h on kv head h // (heads / kv_heads), and with window_size =
(left, right) != (-1, -1) sliding-window local attention as documented: query i of a
sequence of nq queries over nk keys sees only keys i + nk - nq - left through
i + nk - nq + right, inclusive (a negative side is unbounded; causal is right = 0), and
with softcap > 0 each scaled score s replaced by softcap * tanh(s / softcap) ("softcapping
attention", flash-attn 2.6).
"""
from __future__ import annotations

import math

import torch

__version__ = "2.8.3+fake"
CALLS = {"count": 0}


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    CALLS["count"] += 1
    _require(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    _require(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu_seqlens must have dtype int32")
    _require(cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(), "cu_seqlens must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _require(isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen must be ints")
    _require(dropout_p == 0.0 and alibi_slopes is None, "the stand-in does not model dropout or alibi")
    _require(isinstance(softcap, float) and softcap >= 0.0, "softcap must be a float >= 0")
    _require(len(window_size) == 2 and all(isinstance(w, int) for w in window_size),
             "window_size must be a pair of ints")
    left, right = window_size
    paged = block_table is not None
    _require(paged, "the stand-in models the paged KV cache only")
    _require(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _require(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _require(k.dim() == 4 and v.shape == k.shape, "paged k, v: [num_blocks, page_block_size, nheads_k, headdim]")
    num_blocks, page, kv_heads, head_dim = k.shape
    _require(page % 256 == 0, "Paged KV cache block size must be divisible by 256")
    total_q, heads, qd = q.shape
    _require(qd == head_dim and head_dim <= 256, "head dimensions differ or exceed 256")
    _require(heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query")
    batch = cu_seqlens_q.numel() - 1
    _require(batch > 0 and cu_seqlens_k.numel() == batch + 1, "cu_seqlens_q and cu_seqlens_k have different batch")
    _require(block_table.dim() == 2 and block_table.shape[0] == batch, "block_table must be [batch, max_blocks]")
    for t in (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table):
        _require(t.device == q.device, "all tensors must be on the same device")
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    group = heads // kv_heads
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _require(cq[0] == 0 and ck[0] == 0 and cq[-1] <= total_q, "cu_seqlens out of range")
    out = torch.zeros_like(q)
    for b in range(batch):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        _require(0 <= nq <= max_seqlen_q and 0 <= nk <= max_seqlen_k, "a sequence is longer than its max_seqlen")
        if nq == 0:
            continue
        used = math.ceil(nk / page)
        _require(used <= block_table.shape[1], "a context has more pages than its block table")
        ids = block_table[b, :used].long()
        _require(bool(((ids >= 0) & (ids < num_blocks)).all()), "block id out of range")
        keys = k[ids].reshape(used * page, kv_heads, head_dim)[:nk].float().repeat_interleave(group, 1)
        values = v[ids].reshape(used * page, kv_heads, head_dim)[:nk].float().repeat_interleave(group, 1)
        query = q[cq[b]:cq[b + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if softcap > 0.0:
            scores = torch.tanh(scores / softcap) * softcap
        # Bottom-right alignment: query i sits at context position nk - nq + i.
        q_pos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        k_pos = torch.arange(nk, device=q.device)[None, :]
        hidden = torch.zeros(nq, nk, dtype=torch.bool, device=q.device)
        if causal or right >= 0:
            hidden |= k_pos > q_pos + (0 if causal else right)
        if left >= 0:
            hidden |= k_pos < q_pos - left
        scores.masked_fill_(hidden, float("-inf"))
        # A row with every key hidden outputs zeros (flash-attn's documented behaviour).
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
