"""x [M, K] times a packed weight [N, K]^T on a GPU, the weight dequantized inside the
matmul (W4A16 / W8A16: activations bf16, fp16 or fp32, fp32 accumulation): GGUF types
from their planes (quant/gguf_planes.py; AWQ and GPTQ weights are transcoded into Q4_0,
Q5_0 or Q8_0 at load, int_groups), and FP8 e4m3 bytes with float32 scales per row and
group of columns (quant/fp8.py's FP8Rows; the fallback where no FP8 tensor core runs
W8A8, quant/fp8_scaled_mm.py). One Triton kernel, one program per tile of M x N over a
range of K tiles:

- one row of x (M <= quant_tiles.GEMV_MAX_ROWS, batch-1 decode): a GEMV, the dequantized
  tile times x elementwise in fp32 into a [BN, H] accumulator that is summed once after
  the last tile (the weight never rounded to the activation dtype; no reduction inside
  the loop);
- more rows: a tiled GEMM, the dequantized tile rounded to the activation dtype (as the
  dequantized model's weight is) into `tl.dot` on the tensor cores, fp32 accumulate
  (x padded to BM = 16 rows: the tensor cores' work is free beside the weight's bytes);
- both with split-K: the K tiles spread over enough programs to fill the GPU (N / BN
  programs alone leave most SMs idle), their fp32 partial sums added after in one launch
  (split_sum: deterministic, no atomics).

On an H200 (2026-11-30) the first form of the GEMV (x broadcast against the tile, padded
to two rows, a [BM, BN, H] product reduced every tile) ran at 2-8 % of its roofline and
1.4-8x slower than bf16 dense; the rows-16 GEMM at 10-19 %: each program waited for its
tile's bytes before asking for the next, and its K loop spent ~10-20 instructions a
weight (int-to-float conversions among them, a quarter-rate pipe). The K loop is now
pipelined (Tiles.stages, tl.range's num_stages: the next tiles' loads in flight by
cp.async while one is dequantized), converts by _as_float, and drops its masks where the
shape is whole tiles; the tiles are chosen offline (quant_tiles.py). `quant_matmul` takes
a `tiles` and `split_k` for tools/bench_quant_sweep.py, which times the choices in one
device call.

A tile of BK columns reads its 4-bit values as BK / 2 bytes: byte j holds the weights of
columns `lo(j)` (low nibble) and `lo(j) + PAIR` (high), ggml's order (PAIR 16 in a
32-weight block, 32 in Q4_K/Q5_K, 64 in Q6_K), so the kernel multiplies two streams, x
taken at `lo` and `lo + PAIR`; Q2_K's and Q3_K's 2-bit values four streams, BK / 4
bytes, byte j the weights of columns `lo(j) + s * 32` in bits 2 s (Q3_K's third bit from
its hmask, as the 5-bit types' fifth from theirs). Scales come per group of GP columns
of a stream (GP divides both the type's scale group and PAIR), one load per group. Every
type computes `(q - zero) * scale + offset` in fp32 with gguf_quant.dequantize's
operands (K-quant scales d * sc, offsets -dmin * m; IQ4_NL its table's value at q times
d), so a GEMV equals x times that reference to fp32 summation order. Shapes alone decide grids and
nothing is read back to the host, so a launch can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmd.gpu.layers.quant.quant_values import (_FP8, _IQ4_NL, _Q2_K, _Q3_K, _Q4_0, _Q4_1, _Q4_K, _Q5_0, _Q5_1, _Q5_K,
                                                _Q6_K, _Q8_0, FP8_CODE, _as_float, _e4m3, _group_scales, _iq4_nl,
                                                _stream_high_bits, _tile_high_bits, _tile_scales,
                                                _with_high_bits)
from llmd.gpu.layers.quant.gguf_planes import plane_views
from llmd.gpu.layers.quant.quant_tiles import Tiles, sm_count, split_count, tiles_for
from llmd.gpu.layers.quant.split_sum import sum_splits

# Whether the kernel runs in Triton's interpreter (decided when triton was imported): it holds bf16
# as uint16 bits and its tl.dot multiplies those (triton-lang/triton#11584), so a bf16 tile is widened.
INTERPRETED = bool(triton.knobs.runtime.interpret)

@dataclass(frozen=True)
class Layout:
    """How the kernel reads a type: `streams` values a byte (1: bytes; 2: 4-bit, 4:
    2-bit, the lowest bits first), `pair` columns apart; `zero` subtracted from each
    value; scale groups of `gp` columns per stream."""

    code: int
    streams: int
    pair: int
    zero: int
    gp: int


LAYOUTS = {
    "Q8_0": Layout(_Q8_0, 1, 0, 0, 32),
    "Q4_0": Layout(_Q4_0, 2, 16, 8, 16),
    "Q4_1": Layout(_Q4_1, 2, 16, 0, 16),
    "Q5_0": Layout(_Q5_0, 2, 16, 16, 16),
    "Q5_1": Layout(_Q5_1, 2, 16, 0, 16),
    "Q2_K": Layout(_Q2_K, 4, 32, 0, 16),
    "Q3_K": Layout(_Q3_K, 4, 32, 4, 16),
    "Q4_K": Layout(_Q4_K, 2, 32, 0, 32),
    "Q5_K": Layout(_Q5_K, 2, 32, 0, 32),
    "Q6_K": Layout(_Q6_K, 2, 64, 32, 16),
    "IQ4_NL": Layout(_IQ4_NL, 2, 16, 0, 16),
    # per-tensor and per-row scales are one group of K; block scales' columns are
    # multiples of 16 (quant/scheme.py), so 16 columns never span two groups
    "FP8": Layout(FP8_CODE, 1, 0, 0, 16),
}


@dataclass(frozen=True)
class QuantWeight:
    """One packed weight [n, k] as the kernel reads it: `qs` the values [n, ...], `qh`
    high bits, `sc` sub-block scales, `d` the scales, `m` the offsets (Q4_1 / Q5_1's m,
    the K-quants' dmin), each None where the type has none; `fp8_group` the columns per
    FP8 scale."""

    quant: str
    n: int
    k: int
    qs: torch.Tensor
    d: torch.Tensor
    qh: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    m: torch.Tensor | None = None
    fp8_group: int = 0


def gguf_quant_weight(planes: torch.Tensor, quant: str, cols: int) -> QuantWeight:
    """The kernel's view of packed rows laid out as planes (flat uint8)."""
    views = plane_views(planes, quant, cols)
    return QuantWeight(quant, views["qs"].shape[0], cols, views["qs"], views["d"], views.get("qh"), views.get("sc"),
                       views.get("m"))


@triton.jit
def _dequantized(q, kg, rn, nmask, gmask, SC, D, MN, stride_sc, stride_d, stride_m, fp8_group, tile,
                 QUANT: tl.constexpr, ZERO: tl.constexpr, BN: tl.constexpr, H: tl.constexpr, GP: tl.constexpr,
                 SCALE_WORDS: tl.constexpr):
    """fp32 weights [BN, H] of one stream's values q (int32 [BN, H]); kg [H / GP] the
    first column of each group of GP; `tile` the tile's scale fields (_tile_scales)."""
    scale, offset = _group_scales(kg, rn, nmask, gmask, SC, D, MN, stride_sc, stride_d, stride_m, fp8_group, tile,
                                  QUANT, SCALE_WORDS)
    q3 = tl.reshape(q, [BN, H // GP, GP])
    if QUANT == _FP8:
        v = _e4m3(q3)
    elif QUANT == _IQ4_NL:
        v = _as_float(_iq4_nl(q3))
    else:
        v = _as_float(q3 - ZERO)
    return tl.reshape(v * scale[:, :, None] + offset[:, :, None], [BN, H])


@triton.jit
def _accumulate(acc, x, w, DOT: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """x [BM, H] times w [BN, H]^T into acc: with DOT, acc [BM, BN] += x w^T on the tensor
    cores; else (one row, BM 1) acc [BN, H] += w * x elementwise, summed by the caller."""
    if DOT:
        if DOT_F32:  # the interpreter's bf16 (INTERPRETED): w rounded to bf16 (to nearest even, on the
            # bits: the interpreter's own conversion truncates), multiplied in fp32
            bits = w.to(tl.int32, bitcast=True)
            w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    else:
        acc += w * x.to(tl.float32)
    return acc


@triton.jit
def _k_tiles(acc, X, x_rows, mmask, QS, QH, SC, D, MN, rn, nmask, K, first, last, stride_qs, stride_qh, stride_sc,
             stride_d, stride_m, fp8_group, ORDER, QUANT: tl.constexpr, STREAMS: tl.constexpr, PAIR: tl.constexpr,
             ZERO: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, H: tl.constexpr,
             DOT: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, STAGES: tl.constexpr,
             EVEN_K: tl.constexpr, ORDERED: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """acc plus the products of K tiles [first, last) of the weight's rows rn with the
    rows of x starting at offsets x_rows (where mmask): the matmul's K loop, shared by
    the dense kernel and the experts' (triton_quant_moe). ORDERED: the weight's column k
    multiplies x's column ORDER[k] (GPTQ act-order columns sorted by group at load)."""
    j = tl.arange(0, H)
    jg = tl.arange(0, H // GP) * GP  # the first byte of each scale group of a stream
    for t in tl.range(first, last, num_stages=STAGES):  # STAGES > 1: the next tiles' loads issued ahead
        k0 = tl.cast(t * BK, tl.uint32)  # unsigned: the columns' divisions below are shifts
        if STREAMS > 1:  # byte j holds the values of columns klo(j) + s PAIR, s < STREAMS
            klo = k0 + (j // PAIR) * (STREAMS * PAIR) + j % PAIR
            kg = k0 + (jg // PAIR) * (STREAMS * PAIR) + jg % PAIR
            byte = k0 // STREAMS + j
        else:
            klo = k0 + j
            kg = k0 + jg
            byte = k0 + j
        # whole blocks: a later stream's column is in range when the first one's is
        kmask = tl.full([H], True, tl.int1) if EVEN_K else klo < K
        gmask = tl.full([H // GP], True, tl.int1) if EVEN_K else kg < K
        raw = tl.load(QS + rn[:, None] * stride_qs + byte[None, :], mask=nmask[:, None] & kmask[None, :],
                      other=0).to(tl.int32)
        bits = _tile_high_bits(QH, rn, nmask, k0, K, stride_qh, QUANT, STREAMS, PAIR, BK, H)
        tile = _tile_scales(SC, D, MN, rn, nmask, k0, stride_sc, stride_d, stride_m, QUANT, SCALE_WORDS)
        for s in tl.static_range(STREAMS):
            q = raw
            if STREAMS > 1:
                q = raw >> (8 // STREAMS * s)
                if s < STREAMS - 1:  # the last stream's bits are the byte's top: nothing above them
                    q = q & ((1 << (8 // STREAMS)) - 1)
            k = klo + s * PAIR
            if QUANT == _Q5_0 or QUANT == _Q5_1 or QUANT == _Q3_K or QUANT == _Q5_K:
                q = _stream_high_bits(q, bits, s, k0, QUANT, STREAMS, PAIR, BN, H)
            else:  # Q6_K's two high bits (nothing for the types without)
                q = _with_high_bits(q, k, rn, nmask, kmask, QH, stride_qh, QUANT)
            w = _dequantized(q, kg + s * PAIR, rn, nmask, gmask, SC, D, MN, stride_sc, stride_d, stride_m,
                             fp8_group, tile, QUANT, ZERO, BN, H, GP, SCALE_WORDS)
            kx = tl.load(ORDER + k, mask=kmask, other=0) if ORDERED else k
            x = tl.load(X + x_rows[:, None] + kx[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc = _accumulate(acc, x, w, DOT, IEEE, DOT_F32)
    return acc


@triton.jit
def _quant_mm_kernel(X, OUT, QS, QH, SC, D, MN, M, N, K, stride_xm, stride_om, stride_os,
                     stride_qs, stride_qh, stride_sc, stride_d, stride_m, fp8_group, tiles_per_split,
                     QUANT: tl.constexpr, STREAMS: tl.constexpr, PAIR: tl.constexpr, ZERO: tl.constexpr,
                     GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, H: tl.constexpr,
                     DOT: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, PARTIAL: tl.constexpr,
                     STAGES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, SCALE_WORDS: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = tl.full([BN], True, tl.int1) if EVEN_N else rn < N  # a constant mask: no per-element test
    if DOT:
        acc = tl.zeros([BM, BN], tl.float32)
    else:  # one row: the products summed over the tiles, reduced once after
        acc = tl.zeros([BN, H], tl.float32)
    first = pid_s * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BK))
    acc = _k_tiles(acc, X, rm * stride_xm, mmask, QS, QH, SC, D, MN, rn, nmask, K, first, last, stride_qs,
                   stride_qh, stride_sc, stride_d, stride_m, fp8_group, X, QUANT, STREAMS, PAIR, ZERO, GP, BN, BK, H,
                   DOT, IEEE, DOT_F32, STAGES, EVEN_K, False, SCALE_WORDS)
    if not DOT:
        acc = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    _store_tile(OUT + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mmask[:, None] & nmask[None, :],
                PARTIAL)


@triton.jit
def _store_tile(out, acc, mask, PARTIAL: tl.constexpr):
    """A tile's fp32 sums into `out` (pointers): as they are into split-K's partial sums,
    else in the output's dtype."""
    if PARTIAL:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out.dtype.element_ty), mask=mask)


def quant_matmul(x: torch.Tensor, weight: QuantWeight, split_k: int | None = None,
                 tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) times `weight`^T -> [M, N] in x's dtype; `split_k`
    forces the number of K splits and `tiles` the tile (tests, the benchmark's sweep;
    None: split_count's and tiles_for's choices). A GEMV tile takes one row of x."""
    if x.dim() != 2 or x.shape[1] != weight.k:
        raise ValueError(f"x of shape {tuple(x.shape)} does not multiply a [{weight.n}, {weight.k}] weight")
    out = torch.empty(x.shape[0], weight.n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or weight.n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    grid, args, meta, target = kernel_launch(x, weight, out, split_k, tiles, sm_count(x.device))
    _quant_mm_kernel[grid](*args, **meta)
    if target is not out:
        sum_splits(target, out)
    return out


def kernel_launch(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, split_k: int | None, tiles: Tiles | None,
                  sms: int) -> tuple[tuple[int, int, int], tuple, dict, torch.Tensor]:
    """The kernel's launch for x (unit column stride) times `weight` into `out` on a
    device of `sms` multiprocessors: (grid, arguments, keyword arguments, the tensor the
    kernel writes: `out`, or [splits, M, N] float32 partial sums to add). quant_matmul
    launches it; tools/quant_kernel_resources.py compiles it for sm_90 from CPU tensors,
    specialized as Triton's launcher specializes these arguments."""
    rows = x.shape[0]
    tiles = tiles or tiles_for(rows, weight.quant)
    if not tiles.dot and rows > 1:
        raise ValueError(f"a GEMV tile takes one row of x, not {rows}")
    grid_m, grid_n = triton.cdiv(rows, tiles.bm), triton.cdiv(weight.n, tiles.bn)
    splits, per_split = split_plan(grid_m * grid_n, weight, tiles, split_k, sms)
    target = out if splits == 1 else torch.empty(splits, rows, weight.n, dtype=torch.float32, device=x.device)
    planes, strides = weight_planes(weight)
    args = (x, target, *planes, rows, weight.n, weight.k, x.stride(0), target.stride(-2),
            target.stride(0) if splits > 1 else 0, *strides, max(1, weight.fp8_group), per_split)
    meta = kernel_meta(weight, tiles, x.dtype, splits)
    return (grid_m, grid_n, splits), args, meta, target


def split_plan(programs: int, weight: QuantWeight, tiles: Tiles, split_k: int | None, sms: int) -> tuple[int, int]:
    """(K splits, K tiles a split) for a launch of `programs` tiles: `split_k` or
    split_count's choice, no split empty."""
    k_tiles = triton.cdiv(weight.k, tiles.bk)
    splits = split_k if split_k is not None else split_count(programs, k_tiles, sms)
    per_split = triton.cdiv(k_tiles, max(1, min(splits, k_tiles)))
    return triton.cdiv(k_tiles, per_split), per_split


def weight_planes(weight: QuantWeight) -> tuple[list[torch.Tensor], list[int]]:
    """The kernel's weight pointers (QS, QH, SC, D, MN: qs in place of a plane the type
    lacks) and their row strides."""
    qs = weight.qs
    planes = [qs, *(p if p is not None else qs for p in (weight.qh, weight.sc, weight.d, weight.m))]
    return planes, [qs.stride(0), *(p.stride(0) if p.dim() == 2 else 0 for p in planes[1:])]


def kernel_meta(weight: QuantWeight, tiles: Tiles, dtype: torch.dtype, splits: int) -> dict:
    """The kernels' compile-time arguments for `weight` times x of `dtype` in `tiles`."""
    layout = LAYOUTS[weight.quant]
    return dict(QUANT=layout.code, STREAMS=layout.streams, PAIR=layout.pair, ZERO=layout.zero, GP=layout.gp,
                BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, H=tiles.bk // layout.streams,
                DOT=tiles.dot, IEEE=dtype == torch.float32, DOT_F32=INTERPRETED and dtype == torch.bfloat16,
                PARTIAL=splits > 1, STAGES=tiles.stages, EVEN_N=weight.n % tiles.bn == 0,
                EVEN_K=weight.k % tiles.bk == 0, SCALE_WORDS=tiles.scale_words, num_warps=tiles.warps)
