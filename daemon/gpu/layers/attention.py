"""Attention over the paged KV cache.

The step's tokens are one flattened "super-sequence": the runner orders requests so that
all decode rows (one new token each) come first, then the prefill rows. The metadata
says where each request's new tokens sit and which cache blocks hold its context.

This is the PyTorch reference backend (CPU, and any device): new K/V are scattered into
the cache through the slot mapping, decode rows attend in batched GEMMs over K/V gathered
through their block tables, and each prefill row attends on its own with SDPA (directly
over the new K/V when it has no cached context).

Sliding-window layers (Mistral, Qwen2/Qwen3 `sliding_attention`): a layer built with
window W lets the query at position p see keys k with p - W < k <= p (transformers'
convention: the token itself and the W - 1 before it). The window is the layer's, not
the step's: every backend takes it in its constructor, so layers of one model may differ.

Attention logit soft-capping (Gemma 2): a layer built with softcap c replaces each
scaled score s by c * tanh(s / c) before the mask and the softmax, as transformers'
eager attention does. SDPA has no such hook, so capped prefill rows take a plain
matmul-softmax path.

The cache is head-major, [2, kv_heads, num_blocks, block_size, head_dim]: one
index_select then yields each (kv head, request) context as a contiguous [L, D] matrix,
so decode is two plain batched GEMMs with no permute copies (on CPU 1.4x faster than
SDPA over a token-major gather in fp32, 4.5x in bf16, where SDPA's CPU kernel is slow).

A quantized cache (kv_cache_dtype "fp8" or "int8", kv_quant) is written through the
layer's scales and read back dequantized into the model's dtype, a float cache of another
width (float16 / bfloat16 for a float32 model) rounded and widened: every key and value a
query sees is the stored one, the new tokens' own included, so a prompt attends the same
whether its prefix came from the prefix cache or was computed in the same step.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from llmd.gpu.layers.kv_quant import UNIT_SCALES, KVScales, cache_format, cached_values, quantize, stores_rounded


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_decodes: int  # rows [0, num_decodes) have exactly one new token
    # Decode rows (batched):
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64, context incl. the new token
    # Prefill rows, one entry each: (start in the flattened tokens, new tokens,
    # tokens already in the cache, block ids tensor covering the whole context).
    prefills: list[tuple[int, int, int, torch.Tensor]]
    workspace: GatherWorkspace | None = None
    # What a backend derives for all its layers, filled in before the forward by its
    # MetadataBuilder (a layer only reads them):
    # the torch backend's decode mask, [1, num_decodes, 1, L] float additive, and those of
    # its sliding-window layers, by window (the keys before the window masked too);
    decode_mask: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # the Triton backend's device copy of `prefills`;
    prefill_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None
    # the flash-attn backend's arguments for the whole step.
    flash_rows: tuple | None = None


class MetadataBuilder:
    """What one attention backend derives from a step's AttentionMetadata for all its
    layers, built once per step before the forward (inside a captured graph when the
    forward is one: the runner's and the graphs' code call `build` right after making
    the metadata). Building twice changes nothing (a draft model's forward over the
    target's step builds what it needs beside the target's). This base derives nothing."""

    def build(self, md: AttentionMetadata) -> None:
        pass


class TorchMetadataBuilder(MetadataBuilder):
    """The decode mask (when some layer decodes through it, `decode_mask`) and one per
    sliding window of those layers."""

    def __init__(self, block_size: int, decode_mask: bool, windows: set[int]) -> None:
        self.block_size = block_size
        self.decode_mask = decode_mask
        self.windows = sorted(windows)

    def build(self, md: AttentionMetadata) -> None:
        if not (self.decode_mask and md.num_decodes):
            return
        if md.decode_mask is None:
            build_decode_mask(md, self.block_size)
        for window in self.windows:
            if window not in md.window_masks:  # a draft model's forward over the target's step adds its own
                md.window_masks[window] = decode_window_mask(md, window)


class GatherWorkspace:
    """Grow-only buffers the decode path gathers K/V into. Layers run one after another,
    so one pair serves them all; reusing it avoids page-faulting fresh memory for every
    gather (measured 1.2 ms -> 0.36 ms per 15 MB gather on CPU)."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def buffers(self, rows: int, width: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = rows * width
        if self._k is None or self._k.numel() < need or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = torch.empty(need, dtype=like.dtype, device=like.device)
            self._v = torch.empty(need, dtype=like.dtype, device=like.device)
        return self._k[:need].view(rows, width), self._v[:need].view(rows, width)

    def release(self) -> None:
        """Drop the buffers (a sleeping model's memory goes back); the next gather grows them again."""
        self._k = self._v = None


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's cache: [2, kv_heads, num_blocks, block_size, head_dim] (K then V).

    Zeroed, because attention reads whole blocks and a stale NaN would survive its mask.
    On CPU the zeros come from the kernel (a private anonymous mapping of its own), not
    from writing them: a page joins the process's resident memory only when a block on it
    is first written, so a large default cache costs RAM as it fills, not at start. Not
    calloc: it may hand back a hole of glibc's heap that `malloc_trim` (a model's sleep or
    unload) returned to the kernel, and then zeroes it by writing every page."""
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    nbytes = 2 * num_kv_heads * num_blocks * block_size * head_dim * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(pages, dtype=torch.uint8)  # the tensor holds the mapping
    return raw.view(dtype).view(shape)


def model_kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all of `model`'s layers (its own kv heads)."""
    attn = model.layers[0].self_attn
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * len(model.layers) * block_size * attn.num_kv_heads * attn.head_dim * elem


def new_model_kv_caches(model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                        device: torch.device) -> list[torch.Tensor]:
    """One cache per layer of `model` (see new_kv_cache)."""
    attn = model.layers[0].self_attn
    return [new_kv_cache(num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype, device)
            for _ in model.layers]


def pad_tables(tables: list[list[int]]) -> np.ndarray:
    """Block tables of different lengths as one [rows, longest] int64 array (0 past a
    row's end: never read, the context lengths stop before)."""
    table = np.zeros((len(tables), max((len(t) for t in tables), default=0)), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return table


def set_decode_rows(md: AttentionMetadata, tables: np.ndarray | list[list[int]], seq_lens: np.ndarray | list[int],
                    device: torch.device) -> None:
    """The decode rows' block tables ([rows, blocks] int64, columns past a row's context
    never read; or one list per row) and context lengths (what a backend derives from
    them, its MetadataBuilder adds)."""
    if isinstance(tables, list):
        tables = pad_tables(tables)
    md.decode_block_table = torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int64)).to(device, non_blocking=True)
    md.decode_seq_lens = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(device, non_blocking=True)


def build_decode_mask(md: AttentionMetadata, block_size: int) -> None:
    if md.num_decodes == 0:
        return
    length = md.decode_block_table.shape[1] * block_size
    positions = torch.arange(length, device=md.decode_seq_lens.device)
    masked = positions[None, :] >= md.decode_seq_lens[:, None]
    mask = torch.zeros(md.num_decodes, length, dtype=torch.float32, device=masked.device)
    md.decode_mask = mask.masked_fill_(masked, float("-inf")).view(1, md.num_decodes, 1, length)


def decode_window_mask(md: AttentionMetadata, window: int) -> torch.Tensor:
    """The additive decode mask of a layer with sliding window `window`: the decode
    mask, and -inf on keys at or before seq_len - 1 - window (out of the window of the
    row's query, which sits at position seq_len - 1)."""
    length = md.decode_mask.shape[-1]
    positions = torch.arange(length, device=md.decode_seq_lens.device)
    stale = positions[None, :] < (md.decode_seq_lens[:, None] - window)
    return md.decode_mask.masked_fill(stale.view(1, md.num_decodes, 1, length), float("-inf"))


def causal_mask(q_start: int, q_end: int, k_start: int, k_end: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[1, 1, queries, keys] bool, True where the query at position q (q_start <= q <
    q_end) sees the key at position k (k_start <= k < k_end): k <= q, and with a
    sliding window, k > q - window."""
    q_pos = torch.arange(q_start, q_end, device=device)[:, None]
    k_pos = torch.arange(k_start, k_end, device=device)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    return seen.view(1, 1, q_end - q_start, k_end - k_start)


def check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """c * tanh(s / c), in place on a float32 score tensor."""
    return scores.div_(softcap).tanh_().mul_(softcap)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             scales: KVScales = UNIT_SCALES) -> None:
    """Scatter the step's new K/V rows ([T, kv_heads, D]) into their cache slots
    (quantized with `scales` when the cache is: kv_quant)."""
    _, kvh, num_blocks, block_size, d = kv_cache.shape
    fmt = cache_format(kv_cache)
    if fmt is not None:
        k, v = quantize(k, fmt, scales.k_inv), quantize(v, fmt, scales.v_inv)
    elif kv_cache.dtype != k.dtype:  # a float cache of another width: rounded to nearest
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    kv_cache[0].view(kvh, num_blocks * block_size, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_cache[1].view(kvh, num_blocks * block_size, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


class AttentionLayer:
    """What a backend's attention layer is told of its heads (the constructor every
    backend shares). sliding_window: this layer's window (None: full attention);
    softcap: its attention logit soft-cap (None: none). `kv_scales`: the scales of its
    K/V in a quantized cache (kv_quant; set by the model runner before the cache is
    first written, read by every write and read of a quantized cache)."""

    kv_scales: KVScales = UNIT_SCALES

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        check_window(sliding_window)
        check_softcap(softcap)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    @staticmethod
    def metadata_builder(layers: list[AttentionLayer], block_size: int, device: torch.device) -> MetadataBuilder:
        """The builder of a model whose attention layers are `layers` (all of this class)."""
        return MetadataBuilder()


class TorchAttention(AttentionLayer):
    """Reference paged attention in PyTorch (SDPA). With `decode_kernel` set (on CPU the
    loader hands it cpu_kernels' paged_decode) decode rows attend through it, over the
    cache in place, instead of the gather and GEMMs of `_decode`: same contract (window,
    soft-cap, GQA), softmax and sums in float32."""

    decode_kernel: Callable[..., torch.Tensor] | None = None

    @staticmethod
    def metadata_builder(layers: list[TorchAttention], block_size: int, device: torch.device) -> MetadataBuilder:
        """The builder of a model whose attention layers are `layers`: masks for those
        that decode through the gather and GEMMs (no decode kernel)."""
        masked = [layer for layer in layers if layer.decode_kernel is None]
        return TorchMetadataBuilder(block_size, bool(masked),
                                    {layer.sliding_window for layer in masked if layer.sliding_window is not None})

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, md: AttentionMetadata, kv_written: bool = False) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (a prefill with no cached tokens attends over
        them directly). kv_written: the caller's fused op already wrote them to the cache.
        Returns [T, H, D]."""
        if not kv_written:
            write_kv(kv_cache, k, v, md.slot_mapping, self.kv_scales)
        out = torch.empty_like(q)
        if md.num_decodes and self.decode_kernel is not None:
            scales = self.kv_scales
            out[:md.num_decodes] = self.decode_kernel(q[:md.num_decodes].contiguous(), kv_cache, md.decode_block_table,
                                                      md.decode_seq_lens, self.scale, self.softcap or 0.0,
                                                      self.sliding_window or 0, scales.k, scales.v)
        elif md.num_decodes:
            out[:md.num_decodes] = self._decode(q[:md.num_decodes], kv_cache, md)
        for start, num_new, num_cached, block_ids in md.prefills:
            rows = slice(start, start + num_new)
            o = self._prefill(q[rows], k[rows], v[rows], kv_cache, num_cached, block_ids)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 num_cached: int, block_ids: torch.Tensor) -> torch.Tensor:
        """One prefill row: its new tokens' q, k, v ([n, heads, D]) after num_cached
        cached tokens. Returns [1, H, n, D]."""
        kvh, d = kv_cache.shape[1], kv_cache.shape[4]
        num_new = q.shape[0]
        window = self.sliding_window
        gqa = kvh != self.num_heads
        query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        total = num_cached + num_new
        # Keys before the first query's window are never seen: left out of the gather.
        first_key = 0 if window is None else max(0, num_cached - window + 1)
        if num_cached == 0 and not stores_rounded(kv_cache, q.dtype):
            keys = k.transpose(0, 1).unsqueeze(0)
            values = v.transpose(0, 1).unsqueeze(0)
            if self.softcap is None and (window is None or num_new <= window):  # the window holds every earlier token
                return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=self.scale,
                                                      enable_gqa=gqa)
        else:
            keys = kv_cache[0][:, block_ids].view(kvh, -1, d)[:, first_key:total].unsqueeze(0)
            values = kv_cache[1][:, block_ids].view(kvh, -1, d)[:, first_key:total].unsqueeze(0)
            # the stored K/V, the new tokens' too (module docstring)
            keys = cached_values(keys, self.kv_scales.k, q.dtype)
            values = cached_values(values, self.kv_scales.v, q.dtype)
        mask = causal_mask(num_cached, total, first_key, total, window, q.device)
        if self.softcap is not None:
            return self._capped(query, keys, values, mask)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale,
                                              enable_gqa=gqa)

    def _capped(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """SDPA's contract with soft-capped scores: query [1, H, n, D] over keys and
        values [1, KVH, L, D] where `mask` ([1, 1, n, L] bool) is True."""
        group = self.num_heads // keys.shape[1]
        if group > 1:  # query head h reads kv head h // group, as transformers' repeat_kv
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        scores = soft_cap(torch.matmul(query, keys.transpose(-1, -2)).float().mul_(self.scale), self.softcap)
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        return torch.matmul(probs, values)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """One query token per request, all requests at once. q: [B, H, D]."""
        _, kvh, num_blocks, block_size, d = kv_cache.shape
        n = q.shape[0]
        group = self.num_heads // kvh
        table = md.decode_block_table  # [B, max_blocks]
        length = table.shape[1] * block_size
        # Row (h, b, j) of the gathered matrix is block table[b, j] of kv head h.
        index = (table.reshape(1, -1) + torch.arange(kvh, device=q.device).view(-1, 1) * num_blocks).view(-1)
        width = block_size * d
        workspace = md.workspace or GatherWorkspace()
        k_buf, v_buf = workspace.buffers(index.numel(), width, kv_cache)
        keys = torch.index_select(kv_cache[0].view(kvh * num_blocks, width), 0, index, out=k_buf)
        values = torch.index_select(kv_cache[1].view(kvh * num_blocks, width), 0, index, out=v_buf)
        keys = cached_values(keys, self.kv_scales.k, q.dtype)
        values = cached_values(values, self.kv_scales.v, q.dtype)
        keys = keys.view(kvh * n, length, d)
        values = values.view(kvh * n, length, d)
        query = q.view(n, kvh, group, d).transpose(0, 1).reshape(kvh * n, group, d)
        scores = torch.bmm(query, keys.transpose(1, 2)).float().mul_(self.scale)
        if self.softcap is not None:
            soft_cap(scores, self.softcap)
        mask = md.decode_mask if self.sliding_window is None else md.window_masks.get(self.sliding_window)
        if mask is None:
            raise RuntimeError("the step's attention metadata was not built (TorchMetadataBuilder.build) before the "
                               "forward: no decode mask")
        scores = scores.view(kvh, n, group, length).add_(mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kvh * n, group, length)
        out = torch.bmm(probs, values)  # [KVH * B, G, D]
        return out.view(kvh, n, group, d).transpose(0, 1).reshape(n, self.num_heads, d)
