"""Paged attention through flash-attn (the optional `gpu` extra), one launch per layer.

flash-attn's `flash_attn_varlen_func` takes a paged KV cache (`block_table`) since
2.6: every row of the step, decode rows and prefill rows alike, is one variable-length
query sequence (`cu_seqlens_q`) over its own context (`cu_seqlens_k`), causal aligned to
the end of the context (flash-attn >= 2.1), which is what a chunk over a cached prefix
and the 1 + k tokens of a speculative verify need. A sliding-window layer of window W
passes `window_size=(W - 1, 0)`: flash-attn's query i (of nq, over nk keys) then sees
keys i + nk - nq - (W - 1) through i + nk - nq, i.e. the query at position p sees keys
p - W < k <= p, transformers' convention. A soft-capped layer (Gemma 2) passes
`softcap=c`: flash-attn then takes c * tanh(s / c) of each scaled score s, as
transformers' eager attention does. The cache is passed as strided views
of ours: `kv_cache[0].permute(1, 2, 0, 3)` is [blocks, block_size, kv_heads, D] with
the head dimension at stride 1, and the kernel addresses blocks, rows and heads through
the strides, so no copy is made.

Its limits are checked at start-up (attention_backends): CUDA, fp16 or bf16, a KV cache
in the model's dtype (flash-attn 2 reads no fp8 or int8 cache: kv_cache_dtype "auto"), head_dim
a multiple of 8 up to 256, and a block size that is a multiple of 256 (upstream
flash-attn's paged kernels read whole 256-token pages; vLLM's fork lowers that, which
upstream has not).

Everything the call needs is built once per step before the forward, by
FlashMetadataBuilder, from shapes and device tensors (no host sync), and kept on the
metadata; a decode graph (cuda_graphs) captures the build with the forward and replays
both with its static buffers.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from llmd.gpu.layers.attention import AttentionLayer, AttentionMetadata, MetadataBuilder, write_kv
from llmd.gpu.layers.kv_quant import cache_format

FLASH_PAGE_MULTIPLE = 256


def flash_varlen():
    """flash-attn's varlen entry point (imported here only: the extra is optional)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_rows(md: AttentionMetadata, block_size: int, device: torch.device) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table) of the step.

    Rows are the decode rows (one query each) then the prefill rows, in token order. The
    decode rows' lengths stay on the device; max_seqlen_k, which only sizes the launch,
    is the decode table's width in tokens (an upper bound known from its shape)."""
    n = md.num_decodes
    offsets = list(range(n + 1))  # cu_seqlens_q: decode rows hold one query each
    for start, num_new, _, _ in md.prefills:
        if start != offsets[-1]:
            raise ValueError(f"prefill rows must follow the decode rows in token order (row at {start}, "
                             f"expected {offsets[-1]})")
        offsets.append(start + num_new)
    k_lens = [num_cached + num_new for _, num_new, num_cached, _ in md.prefills]
    max_q = max((num_new for _, num_new, _, _ in md.prefills), default=1)
    max_k = max(k_lens, default=0)
    widths = [ids.numel() for _, _, _, ids in md.prefills]
    if n:
        decode_table = md.decode_block_table.to(torch.int32)
        max_k = max(max_k, decode_table.shape[1] * block_size)
        widths.append(decode_table.shape[1])
    if not md.prefills:  # decode only: also the shape a captured graph has (no host copy)
        cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        table = decode_table
        seq_lens = md.decode_seq_lens.to(torch.int32)
    else:
        cu_q = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
        prefill_lens = torch.tensor(k_lens, dtype=torch.int32).to(device, non_blocking=True)
        seq_lens = torch.cat([md.decode_seq_lens.to(torch.int32), prefill_lens]) if n else prefill_lens
        table = torch.zeros(n + len(md.prefills), max(widths), dtype=torch.int32, device=device)
        if n:
            table[:n, :decode_table.shape[1]] = decode_table
        for i, (_, _, _, ids) in enumerate(md.prefills):
            table[n + i, :ids.numel()] = ids
    cu_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    return cu_q, cu_k, max_q, max_k, table


class FlashMetadataBuilder(MetadataBuilder):
    """The step's varlen arguments (flash_rows), once per step for every layer."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device

    def build(self, md: AttentionMetadata) -> None:
        if md.flash_rows is None:
            md.flash_rows = flash_rows(md, self.block_size, self.device)


class FlashAttention(AttentionLayer):
    """Paged attention through flash-attn's varlen kernel; the contract of TorchAttention."""

    @staticmethod
    def metadata_builder(layers: list[AttentionLayer], block_size: int, device: torch.device) -> MetadataBuilder:
        return FlashMetadataBuilder(block_size, device)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if head_dim % 8 or head_dim > 256:
            raise ValueError(f"attention_backend 'flash_attn' takes head_dim a multiple of 8 up to 256, "
                             f"not {head_dim}; use 'triton' or 'torch'")
        # flash-attn's (left, right) reach from a query's own position; -1 is unbounded.
        self.window_size = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self._varlen = flash_varlen()
        # Passed only when set, so a flash-attn without the argument still runs the rest.
        self._extra = {} if softcap is None else {"softcap": float(softcap)}
        if softcap is not None and "softcap" not in inspect.signature(self._varlen).parameters:
            raise ValueError("attention_backend 'flash_attn': this model soft-caps its attention scores and the "
                             "installed flash-attn has no softcap argument (flash-attn >= 2.6 has); use 'triton' "
                             "or 'torch'")

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 kv_cache: torch.Tensor, md: AttentionMetadata, kv_written: bool = False) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D], or None with kv_written (the caller's fused
        kernel, fused_ops, already wrote them at md.slot_mapping). Returns [T, H, D]."""
        if cache_format(kv_cache) is not None:  # resolve_attention_backend refuses it at start-up
            raise ValueError("attention_backend 'flash_attn' does not read a quantized KV cache (kv_cache_dtype)")
        if not kv_written:
            write_kv(kv_cache, k, v, md.slot_mapping)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if md.flash_rows is None:
            raise RuntimeError("the step's attention metadata was not built (FlashMetadataBuilder.build) before "
                               "the forward: no flash rows")
        cu_q, cu_k, max_q, max_k, table = md.flash_rows
        if q.stride(-1) != 1:
            q = q.contiguous()
        # [blocks, block_size, kv_heads, D] views of the head-major cache.
        k_pages = kv_cache[0].permute(1, 2, 0, 3)
        v_pages = kv_cache[1].permute(1, 2, 0, 3)
        return self._varlen(q, k_pages, v_pages, cu_q, cu_k, max_q, max_k, softmax_scale=self.scale,
                            causal=True, window_size=self.window_size, block_table=table, **self._extra)
