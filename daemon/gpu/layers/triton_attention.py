"""Paged attention in Triton kernels: a drop-in for TorchAttention (same constructor,
same cache layout [2, kv_heads, num_blocks, block_size, head_dim], same
AttentionMetadata). Made for CUDA; on CPU the kernels run only in Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported), which is how the tests check them.

One layer call launches:
- `_write_kv`: the step's new K/V rows into the cache through `md.slot_mapping`
  (a negative slot is skipped: a padding row); not with `kv_written`, when the caller's
  fused kernel (fused_ops) has already written them.
- `_decode` for rows [0, num_decodes), one query token each. A program takes one
  (request, kv head) and makes the G query heads that share the kv head the rows of
  its tile, so each K/V tile is read once per group. With several splits
  (flash-decoding: few requests over long contexts on a big GPU) each program covers
  one slice of the context and `_combine` merges the slices by their log-sum-exp.
- `_prefill` for the prefill rows: a program takes one (row, run of BLOCK_Q new tokens,
  kv head); its tile rows are those tokens x the G query heads. The keys are the row's
  cached context, then its new tokens, causally: the query at position p sees keys
  0..p (in a sliding-window layer of window W, keys p - W + 1..p). A decode row is the
  same computation with one token, so both kernels share `_attend`; several new tokens
  after a cached prefix (speculative verification) are an ordinary prefill row.

A sliding-window layer (SLIDING, a compile-time switch, so full-attention layers run
the kernels unchanged) starts each program's key loop at the first key its first query
sees: blocks wholly before the window are never read.

A soft-capped layer (SOFTCAP, compile-time too; Gemma 2) turns each scaled score s
into c * tanh(s / c) before the mask, as transformers' eager attention does.

Keys are visited BLOCK_N at a time whatever the cache block size: key i lives in block
table[i // block_size], slot i % block_size. Softmax is online, in fp32, in base 2 (the
scale is folded with log2(e), after the cap when there is one).

A quantized cache (KV_MODE, compile-time: kv_quant_triton) is read as exact small numbers
in the query's dtype, k_scale folded into the score scale and v_scale into the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.gpu.layers.attention import AttentionLayer, AttentionMetadata, MetadataBuilder
from llmd.gpu.layers.kv_quant import cache_format
from llmd.gpu.layers.kv_quant_triton import bf16_rounded, kv_encode, kv_mode, kv_tiles, stored_unit

# Whether the kernels below run in Triton's interpreter. Decided when they were
# decorated (this module's import), from TRITON_INTERPRET.
INTERPRETED = bool(triton.knobs.runtime.interpret)

LOG2E = 1.4426950408889634
BLOCK_N = 32  # keys per tile
PREFILL_TILE_ROWS = 64  # query rows (new tokens x heads of a group) per prefill program
SPLIT_MIN_KEYS = 256  # a decode split covers at least this many keys
MAX_SPLITS = 16


@triton.jit
def _write_kv(k_ptr, v_ptr, k_cache, v_cache, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_ch, stride_cs, k_inv, v_inv, KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, KV_MODE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """One program per new token: all its kv heads into cache slot slot_mapping[t], quantized
    (k_inv, v_inv) when KV_MODE says so, else rounded to the cache's float (EMULATE_BF16)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        dst = offs_h[:, None].to(tl.int64) * stride_ch + slot * stride_cs + offs_d[None, :]
        if KV_MODE != 0:
            k = kv_encode(k.to(tl.float32), k_inv, KV_MODE)
            v = kv_encode(v.to(tl.float32), v_inv, KV_MODE)
        elif EMULATE_BF16:
            k = bf16_rounded(k.to(tl.float32))
            v = bf16_rounded(v.to(tl.float32))
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)  # a float cache: rounded to it
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def stable_tanh(x):
    """tanh from one exp of a non-positive argument: no overflow at any |x|."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tile_rows(kv_head, num_q, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile row r is query token r // G (of the tile's tokens) and query head
    kv_head * G + r % G; rows past BLOCK_Q * G or past num_q tokens are padding."""
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // G
    head = kv_head * G + offs_m % G
    rows = (offs_m < BLOCK_Q * G) & (tok < num_q)
    return tok, head, rows


@triton.jit
def _store_rows(ptr, row_offsets, rows, values, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(ptr + row_offsets[:, None] + offs_d[None, :], values.to(ptr.dtype.element_ty),
             mask=rows[:, None] & (offs_d[None, :] < D))


@triton.jit
def _attend(q_ptr, stride_qt, stride_qh, k_cache, v_cache, stride_ch, stride_cs, table_ptr,
            tok, head, rows, q_pos0, kv_head, key_lo, key_hi, scale_log2, window, cap_log2, v_mult,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
            BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr,
            SOFTCAP: tl.constexpr, KV_MODE: tl.constexpr):
    """Online-softmax attention of one tile of query rows (q_ptr points at the tile's
    first token; row r's token sits at position q_pos0 + tok[r]) over keys
    [key_lo, key_hi) of one request, causally (with SLIDING, only keys after
    q_pos - window). scale_log2 multiplies q.k: the softmax scale times log2(e), or with
    SOFTCAP the scale over the cap, whose tanh cap_log2 (the cap times log2(e)) then
    multiplies (with a quantized cache, both include k_scale and the stored unit). Returns
    the unnormalised output (times v_mult, a quantized cache's v_scale and unit), the
    running max and the sum of exponentials (base 2) of every row."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=rows[:, None] & d_ok[None, :], other=0.0)
    q_dtype = q_ptr.dtype.element_ty
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = q_pos0 + tok
    cache_head = kv_head.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Full attention: every tile holds at least one key each row may see (key_lo <= every
    # row's position), so the running max is finite from the first tile on. A sliding
    # window can hide a whole tile from the later rows of a prefill tile: their max
    # stays -inf until a tile they see, and is taken as 0 meanwhile (no inf - inf).
    for start in range(key_lo, key_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys < key_hi
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=k_ok, other=0)
        slot = cache_head + (block * BLOCK_SIZE + keys % BLOCK_SIZE) * stride_cs
        k_t, v = kv_tiles(k_cache, v_cache, slot, offs_d, k_ok, d_ok, q_dtype, KV_MODE)
        if DOT_F32:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2
        if SOFTCAP:  # s is score / softcap here; softcap * tanh of it, in base 2
            s = cap_log2 * stable_tanh(s)
        seen = k_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING:
            seen = seen & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if SLIDING:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    if KV_MODE != 0:
        acc = acc * v_mult
    return acc, m_i, l_i


@triton.jit
def _decode(q_ptr, out_ptr, part_out, part_lse, k_cache, v_cache, table_ptr, seq_lens_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_table,
            keys_per_split, scale_log2, window, cap_log2, v_mult, H: tl.constexpr, G: tl.constexpr,
            NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
            SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_MODE: tl.constexpr):
    """Grid (decode row b, kv head, split)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    key_lo = split * keys_per_split
    key_hi = tl.minimum(key_lo + keys_per_split, seq_len)
    if SLIDING:  # the query at seq_len - 1 sees the last `window` keys; a split before them, none
        key_lo = tl.maximum(key_lo, seq_len - window)
    tok, head, rows = _tile_rows(kv_head, 1, G, 1, BLOCK_M)
    acc, m_i, l_i = _attend(q_ptr + b * stride_qt, stride_qt, stride_qh, k_cache, v_cache, stride_ch,
                            stride_cs, table_ptr + b * stride_table, tok, head, rows, seq_len - 1, kv_head,
                            key_lo, key_hi, scale_log2, window, cap_log2, v_mult, BLOCK_M, BLOCK_N, BLOCK_SIZE, D,
                            BLOCK_D, DOT_F32, PRECISION, SLIDING, SOFTCAP, KV_MODE)
    if NUM_SPLITS == 1:
        _store_rows(out_ptr + b * stride_ot, head * stride_oh, rows, acc / l_i[:, None], D, BLOCK_D)
    else:
        # A split past the end of this request's context saw no key: weight 0 in _combine.
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        part_row = (b * H + head) * NUM_SPLITS + split
        _store_rows(part_out, part_row * D, rows, acc / l_safe[:, None], D, BLOCK_D)
        tl.store(part_lse + part_row, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=rows)


@triton.jit
def _combine(part_out, part_lse, out_ptr, stride_ot, stride_oh, H: tl.constexpr, NUM_SPLITS: tl.constexpr,
             BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (decode row b, query head): the splits' outputs weighted by their share of
    the softmax mass."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    base = (b * H + head) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(part_lse + base + offs_s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    parts = tl.load(part_out + (base + offs_s)[:, None] * D + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0)
    tl.store(out_ptr + b * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill(q_ptr, out_ptr, k_cache, v_cache, rows_ptr, tables_ptr, stride_qt, stride_qh, stride_ot,
             stride_oh, stride_ch, stride_cs, scale_log2, window, cap_log2, v_mult, G: tl.constexpr,
             BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
             SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_MODE: tl.constexpr):
    """Grid (prefill row, run of BLOCK_Q new tokens, kv head). rows_ptr: [P, 4] int32
    (first token in the flattened step, new tokens, cached tokens, offset of the row's
    block ids in tables_ptr)."""
    p = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    q_start = tl.load(rows_ptr + p * 4)
    num_new = tl.load(rows_ptr + p * 4 + 1)
    num_cached = tl.load(rows_ptr + p * 4 + 2)
    table_offset = tl.load(rows_ptr + p * 4 + 3)
    if t0 < num_new:
        num_q = tl.minimum(num_new - t0, BLOCK_Q)
        tok, head, rows = _tile_rows(kv_head, num_q, G, BLOCK_Q, BLOCK_M)
        first = q_start + t0
        key_lo = 0
        if SLIDING:  # the window of the tile's first query, whose window starts first
            key_lo = tl.maximum(num_cached + t0 - window + 1, 0)
        acc, m_i, l_i = _attend(q_ptr + first * stride_qt, stride_qt, stride_qh, k_cache, v_cache, stride_ch,
                                stride_cs, tables_ptr + table_offset, tok, head, rows, num_cached + t0,
                                kv_head, key_lo, num_cached + t0 + num_q, scale_log2, window, cap_log2, v_mult,
                                BLOCK_M, BLOCK_N, BLOCK_SIZE, D, BLOCK_D, DOT_F32, PRECISION, SLIDING, SOFTCAP,
                                KV_MODE)
        if SLIDING:  # padding rows (past the run's last token) may have seen no key
            l_i = tl.where(l_i > 0, l_i, 1.0)
        _store_rows(out_ptr + first * stride_ot, tok * stride_ot + head * stride_oh, rows,
                    acc / l_i[:, None], D, BLOCK_D)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels address the head dimension with stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def prefill_rows(md: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """md.prefills as kernel inputs: ([P, 4] int32 rows, every row's block ids in one
    tensor, most new tokens of a row)."""
    rows: list[int] = []
    tables: list[torch.Tensor] = []
    offset = 0
    for start, num_new, num_cached, block_ids in md.prefills:
        rows += [start, num_new, num_cached, offset]
        tables.append(block_ids)
        offset += block_ids.numel()
    return (torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True),
            torch.cat(tables).to(device, non_blocking=True), max(n for _, n, _, _ in md.prefills))


class TritonMetadataBuilder(MetadataBuilder):
    """The prefill rows' kernel inputs, once per step for every layer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, md: AttentionMetadata) -> None:
        if md.prefills and md.prefill_rows is None:
            md.prefill_rows = prefill_rows(md, self.device)


class TritonAttention(AttentionLayer):
    """Paged attention in Triton kernels; the contract of TorchAttention.

    sliding_window: this layer's window (None: full attention); softcap: its attention
    logit soft-cap (None: none). decode_splits: how many slices a decode row's context
    is cut into (flash-decoding); None picks by the GPU's size and the step's shape (1
    off CUDA)."""

    @staticmethod
    def metadata_builder(layers: list[AttentionLayer], block_size: int, device: torch.device) -> MetadataBuilder:
        return TritonMetadataBuilder(device)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None,
                 decode_splits: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if decode_splits is not None and not 1 <= decode_splits <= MAX_SPLITS:
            raise ValueError(f"decode_splits must be in [1, {MAX_SPLITS}], got {decode_splits}")
        self.decode_splits = decode_splits
        group = num_heads // num_kv_heads
        self.group = group
        # tl.dot wants every tile side >= 16.
        self.block_d = max(16, triton.next_power_of_2(head_dim))
        self.decode_block_m = max(16, triton.next_power_of_2(group))
        self.block_q = max(1, PREFILL_TILE_ROWS // triton.next_power_of_2(group))
        self.prefill_block_m = max(16, triton.next_power_of_2(self.block_q * group))
        self._num_sms: int | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 kv_cache: torch.Tensor, md: AttentionMetadata, kv_written: bool = False) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D], or None with kv_written (the cache already
        holds them at md.slot_mapping). Returns [T, H, D]."""
        _, kvh, _, block_size, d = kv_cache.shape
        if not kv_cache.is_contiguous():
            raise ValueError("TritonAttention needs a contiguous KV cache")
        q = _unit_last(q)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        fmt, scales, mode = cache_format(kv_cache), self.kv_scales, kv_mode(cache_format(kv_cache))
        if q.shape[0] and not kv_written:
            k, v = _unit_last(k), _unit_last(v)
            _write_kv[(q.shape[0],)](k, v, k_cache, v_cache, md.slot_mapping, k.stride(0), k.stride(1),
                                     v.stride(0), v.stride(1), kv_cache.stride(1), kv_cache.stride(3), scales.k_inv,
                                     scales.v_inv, KVH=kvh, D=d, BLOCK_H=triton.next_power_of_2(kvh),
                                     BLOCK_D=self.block_d, KV_MODE=mode,
                                     EMULATE_BF16=INTERPRETED and kv_cache.dtype == torch.bfloat16 != k.dtype)
        # Triton's interpreter does no arithmetic on bf16 (it holds bf16 as uint16 bits and
        # tl.dot multiplies those: triton-lang/triton#11584), so there bf16 dot operands
        # are widened to fp32 (after the same rounding of the probabilities as on a GPU).
        shared = dict(BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, D=d, BLOCK_D=self.block_d,
                      DOT_F32=INTERPRETED and q.dtype == torch.bfloat16,
                      PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32: no TF32 rounding
                      SLIDING=self.sliding_window is not None, SOFTCAP=self.softcap is not None, KV_MODE=mode)
        cache_args = (k_cache, v_cache)
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(1), kv_cache.stride(3))
        # With a cap, scores go to base 2 after the tanh (see _attend). A quantized cache's
        # scales (times the unit its widened elements are short of) multiply q.k and the output.
        k_mult, v_mult = (1.0, 1.0) if fmt is None else (scales.k * stored_unit(fmt), scales.v * stored_unit(fmt))
        scale_log2 = (self.scale * LOG2E if self.softcap is None else self.scale / self.softcap) * k_mult
        window = self.sliding_window or 0  # read only by SLIDING kernels
        cap_log2 = float(self.softcap or 0.0) * LOG2E  # read only by SOFTCAP kernels
        if md.num_decodes:
            self._decode(q, out, cache_args, strides, scale_log2, window, cap_log2, v_mult, md, shared)
        if md.prefills:
            if md.prefill_rows is None:
                raise RuntimeError("the step's attention metadata was not built (TritonMetadataBuilder.build) "
                                   "before the forward: no prefill rows")
            rows, tables, max_new = md.prefill_rows
            grid = (len(md.prefills), triton.cdiv(max_new, self.block_q), kvh)
            _prefill[grid](q, out, *cache_args, rows, tables, *strides, scale_log2, window, cap_log2, v_mult,
                           G=self.group, BLOCK_Q=self.block_q, BLOCK_M=self.prefill_block_m, **shared)
        return out

    def _decode(self, q: torch.Tensor, out: torch.Tensor, cache_args: tuple, strides: tuple, scale_log2: float,
                window: int, cap_log2: float, v_mult: float, md: AttentionMetadata, shared: dict) -> None:
        # Everything decided here (splits, keys per split, the grid) comes from shapes and
        # the GPU, never from tensor values: a captured decode graph (cuda_graphs) has a
        # fixed batch and a table as wide as max_model_len, so its split count is fixed.
        n = md.num_decodes
        table = md.decode_block_table
        max_keys = table.shape[1] * shared["BLOCK_SIZE"]
        splits = self._splits(n, max_keys, q.device)
        keys_per_split = triton.cdiv(triton.cdiv(max_keys, splits), BLOCK_N) * BLOCK_N
        splits = triton.cdiv(max_keys, keys_per_split)
        h, d = self.num_heads, self.head_dim
        if splits > 1:
            part_out = torch.empty(n * h * splits * d, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(n * h * splits, dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # not touched with one split
        _decode[(n, self.num_kv_heads, splits)](
            q, out, part_out, part_lse, *cache_args, table, md.decode_seq_lens, *strides, table.stride(0),
            keys_per_split, scale_log2, window, cap_log2, v_mult, H=h, G=self.group, NUM_SPLITS=splits,
            BLOCK_M=self.decode_block_m, **shared)
        if splits > 1:
            _combine[(n, h)](part_out, part_lse, out, out.stride(0), out.stride(1), H=h, NUM_SPLITS=splits,
                             BLOCK_S=triton.next_power_of_2(splits), D=d, BLOCK_D=self.block_d)

    def _splits(self, num_decodes: int, max_keys: int, device: torch.device) -> int:
        """Split the context when the rows x kv heads alone would leave most of the GPU's
        multiprocessors idle and the contexts are long enough to share out."""
        if self.decode_splits is not None:
            return self.decode_splits
        if device.type != "cuda":
            return 1
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = num_decodes * self.num_kv_heads
        if programs >= self._num_sms:
            return 1
        return max(1, min(MAX_SPLITS, triton.cdiv(2 * self._num_sms, programs), max_keys // SPLIT_MIN_KEYS))
