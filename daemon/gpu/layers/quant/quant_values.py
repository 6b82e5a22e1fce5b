"""How the packed-weight kernels (triton_quant_mm, triton_quant_moe) read each type's
values and scales: the type codes they compare (constexpr globals), a value's float
without a conversion instruction (_as_float), FP8 e4m3 and IQ4_NL's table by arithmetic,
a 4-/2-bit value's high bits (_tile_high_bits and _stream_high_bits; Q6_K's two:
_with_high_bits), a group's scale and offset (_group_scales) — gguf_quant.dequantize's
operands, read from the planes (quant/gguf_planes.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from llmd.gpu.layers.gguf_formats import IQ4_NL_VALUES
from llmd.gpu.layers.gguf_quant import FORMATS

FP8_CODE = 100  # the kernel's code for FP8 e4m3 rows (GGUF types: gguf_formats.FORMATS' codes)

# The type codes as the kernels compare them (a jit function reads only constexpr globals).
_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K, _IQ4_NL = (
    tl.constexpr(FORMATS[q].code)
    for q in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"))
_FP8 = tl.constexpr(FP8_CODE)
# IQ4_NL's 16 int8 values four to a little-endian int32 word (_iq4_nl reads them).
_IQ4_W0, _IQ4_W1, _IQ4_W2, _IQ4_W3 = (
    tl.constexpr(int.from_bytes(IQ4_NL_VALUES[i:i + 4].tobytes(), "little", signed=True)) for i in range(0, 16, 4))


@triton.jit
def _as_float(q):
    """float32 of int32 q in [-2^22, 2^22) with no conversion instruction (Hopper runs
    those at 16 a clock per SM, an eighth of an add's rate: at two a packed byte they
    alone would hold a 4-bit GEMV to ~2 TB/s): q added to the bits of 1.5 * 2^23, read as
    a float, less 1.5 * 2^23 — exact."""
    return (q + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _e4m3(b):
    """float32 of e4m3 bytes (int32 0..255): sign, 4 exponent bits biased by 7, 3
    mantissa bits; subnormal below exponent 1; 0x7F and 0xFF NaN."""
    e = (b >> 3) & 0xF
    mantissa = b & 7
    normal = (((b & 0x80) << 24) | ((e + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    sub = _as_float(mantissa) * 0.001953125  # mantissa / 8 * 2^-6
    sub = tl.where((b & 0x80) != 0, -sub, sub)
    nan = (b * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, nan, tl.where(e == 0, sub, normal))


@triton.jit
def _iq4_nl(q):
    """IQ4_NL's table values (gguf_formats.IQ4_NL_VALUES) at indices q (int32 0..15): the
    word of four values q's high two bits pick, its byte q's low two bits pick, shifted
    to the top and back (sign-extended). Arithmetic, not a load: no table to keep on
    the device, and the same in the interpreter."""
    word = tl.where(q < 8, tl.where(q < 4, _IQ4_W0, _IQ4_W1), tl.where(q < 12, _IQ4_W2, _IQ4_W3))
    return (word << (24 - 8 * (q & 3))) >> 24


@triton.jit
def _with_high_bits(q, k, rn, nmask, kmask, QH, stride_qh, QUANT: tl.constexpr):
    """Q6_K's 4-bit values q [BN, H] of columns k [H] with their two high bits, read per
    value (these loads stream through shared memory in the sm_90 code; the one-bit types'
    come a tile at a time: _tile_high_bits); q as it is for the types without."""
    if QUANT == _Q6_K:  # per 256: bits 2 ((k % 128) / 32) of byte 32 ((k % 256) / 128) + k % 32
        h = tl.load(QH + rn[:, None] * stride_qh + ((k // 256) * 64 + ((k % 256) // 128) * 32 + k % 32)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0).to(tl.int32)
        q = q | (((h >> (2 * ((k % 128) // 32)))[None, :] & 3) << 4)
    return q


@triton.jit
def _tile_high_bits(QH, rn, nmask, k0, K, stride_qh, QUANT: tl.constexpr, STREAMS: tl.constexpr,
                    PAIR: tl.constexpr, BK: tl.constexpr, H: tl.constexpr):
    """A tile's high bits of the types that keep one a value in a plane of its own (0
    for the others), loaded once for all its streams as whole words and bytes — each
    stream's bits are then shifts (_stream_high_bits). Gathered byte by byte per value
    (_with_high_bits' way, which Q6_K keeps: its loads stream through shared memory) they
    were synchronous global loads inside the K loop, 19 a tile for Q3_K and 24 for Q5_K
    in the sm_90 code, and Q3_K's GEMV ran at 3 % of its roofline on an H200.
    Q5_0 / Q5_1: [BN, BK / 32] int32, each 32-column block's bits as a little-endian word
    (bit t: column 32 b + t). Q3_K / Q5_K: [BN, H / 32, 32], for each run of 32 bytes of
    the tile its super-block's 32 hmask bytes (bit (c % 256) / 32 of byte c % 32)."""
    if QUANT == _Q5_0 or QUANT == _Q5_1:
        g = tl.arange(0, BK // 32)
        words = (QH + rn[:, None] * stride_qh + (k0 // 8 + 4 * g)[None, :]).to(tl.pointer_type(tl.int32))
        return tl.load(words, mask=nmask[:, None] & ((k0 + 32 * g) < K)[None, :], other=0)
    elif QUANT == _Q3_K or QUANT == _Q5_K:
        a = tl.arange(0, H // 32)
        i = tl.arange(0, 32)
        start = k0 + a * (STREAMS * PAIR)  # the first column of run a's bytes
        row = QH + rn[:, None, None] * stride_qh
        mask = nmask[:, None, None] & (start < K)[None, :, None] & (i < 32)[None, None, :]
        return tl.load(row + ((start // 256) * 32)[None, :, None] + i[None, None, :], mask=mask,
                       other=0).to(tl.int32)
    else:
        return 0


@triton.jit
def _stream_high_bits(q, bits, s: tl.constexpr, k0, QUANT: tl.constexpr, STREAMS: tl.constexpr,
                      PAIR: tl.constexpr, BN: tl.constexpr, H: tl.constexpr):
    """Stream s's values q [BN, H] of a tile with their high bit from the tile's `bits`
    (_tile_high_bits). Q5_0 / Q5_1: byte j holds column 32 (j / 16) + j % 16 + 16 s, bit
    j % 16 + 16 s of block j / 16's word; Q3_K / Q5_K: byte j = 32 a + i holds column
    k0 + a STREAMS PAIR + 32 s + i, bit ((k0 + a STREAMS PAIR) % 256) / 32 + s of byte i."""
    if QUANT == _Q5_0 or QUANT == _Q5_1:
        t = tl.arange(0, 16) + 16 * s
        high = (bits[:, :, None] >> t[None, None, :]) & 1
        return q | (tl.reshape(high, [BN, H]) << 4)
    else:
        a = tl.arange(0, H // 32)
        shift = (((k0 + a * (STREAMS * PAIR)) % 256) // 32 + s).to(tl.int32)
        high = (bits >> shift[None, :, None]) & 1
        return q | (tl.reshape(high, [BN, H]) << (4 if QUANT == _Q5_K else 2))


@triton.jit
def _tile_scales(SC, D, MN, rn, nmask, k0, stride_sc, stride_d, stride_m, QUANT: tl.constexpr,
                 SCALE_WORDS: tl.constexpr):
    """With SCALE_WORDS (a BK 128 tile: one super-block), a Q4_K / Q5_K tile's scale fields
    loaded once for all its streams and groups — the super-block's 12 packed bytes as three
    little-endian words, d and dmin, each [BN] — else zeros. Gathered per group and stream
    (three bytes, d and dmin) they are 10 synchronous global loads in the sm_90 code of a
    Q4_K GEMV's K loop; as words they come by cp.async, but the GEMV's registers go 64 ->
    95 (programs per SM 8 -> 5): which costs more, a GPU's sweep says (bench_quant_sweep)."""
    if (QUANT == _Q4_K or QUANT == _Q5_K) and SCALE_WORDS:
        words = (SC + rn * stride_sc + (k0 // 256) * 12).to(tl.pointer_type(tl.int32))
        return (tl.load(words, mask=nmask, other=0), tl.load(words + 1, mask=nmask, other=0),
                tl.load(words + 2, mask=nmask, other=0),
                tl.load(D + rn * stride_d + k0 // 256, mask=nmask, other=0.0).to(tl.float32),
                tl.load(MN + rn * stride_m + k0 // 256, mask=nmask, other=0.0).to(tl.float32))
    else:
        return 0, 0, 0, 0.0, 0.0


@triton.jit
def _group_scales(kg, rn, nmask, gmask, SC, D, MN, stride_sc, stride_d, stride_m, fp8_group, tile,
                  QUANT: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """(scale, offset) fp32 [BN, NG] of the groups starting at columns kg [NG] (in K
    where gmask); `tile` the tile's scale fields (_tile_scales)."""
    mask = nmask[:, None] & gmask[None, :]
    rows_d = D + rn[:, None] * stride_d
    offset = tl.zeros(mask.shape, tl.float32)
    if QUANT == _FP8:
        scale = tl.load(rows_d + (kg.to(tl.int32) // fp8_group)[None, :], mask=mask, other=0.0)
    elif QUANT == _Q4_K or QUANT == _Q5_K:
        # sub-block j's 6-bit scale and min (gguf_quant._scale_min_k4): bytes j and j + 4 (j < 4), else
        # j + 4's nibbles with bytes j - 4's and j's top two bits
        j = (kg % 256) // 32
        low = (j < 4)[None, :]
        if SCALE_WORDS:  # from the tile's words: each of those bytes is byte j % 4 of a word
            w0, w1, w2, d, dmin = tile
            shift = ((j % 4) * 8).to(tl.int32)[None, :]
            b0 = (w0[:, None] >> shift) & 0xFF
            b1 = (w1[:, None] >> shift) & 0xFF
            b2 = (w2[:, None] >> shift) & 0xFF
            d, dmin = d[:, None], dmin[:, None]
        else:
            s = kg // 256
            d = tl.load(rows_d + s[None, :], mask=mask, other=0.0).to(tl.float32)
            dmin = tl.load(MN + rn[:, None] * stride_m + s[None, :], mask=mask, other=0.0).to(tl.float32)
            packed = SC + rn[:, None] * stride_sc + (s * 12)[None, :]
            b0 = tl.load(packed + tl.where(j < 4, j, j - 4)[None, :], mask=mask, other=0).to(tl.int32)
            b1 = tl.load(packed + tl.where(j < 4, j + 4, j)[None, :], mask=mask, other=0).to(tl.int32)
            b2 = tl.load(packed + tl.where(j < 4, j, j + 4)[None, :], mask=mask, other=0).to(tl.int32)
        sc = tl.where(low, b0 & 63, (b2 & 0xF) | ((b0 >> 6) << 4))
        mn = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
        scale = d * _as_float(sc)
        offset = -(dmin * _as_float(mn))
    elif QUANT == _Q2_K:  # per 16: the scale in a byte's low nibble, the min in its high one
        s = kg // 256
        d = tl.load(rows_d + s[None, :], mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(MN + rn[:, None] * stride_m + s[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(SC + rn[:, None] * stride_sc + (kg // 16)[None, :], mask=mask, other=0).to(tl.int32)
        scale = d * _as_float(b & 0xF)
        offset = -(dmin * _as_float(b >> 4))
    elif QUANT == _Q3_K:  # per 16, 6 bits: the low four in byte i % 8 (nibble i / 8), the high two in
        # byte 8 + i % 4 (bits 2 (i / 4)); less 32
        s = kg // 256
        i = (kg % 256) // 16
        d = tl.load(rows_d + s[None, :], mask=mask, other=0.0).to(tl.float32)
        packed = SC + rn[:, None] * stride_sc + (s * 12)[None, :]
        low = tl.load(packed + (i % 8)[None, :], mask=mask, other=0).to(tl.int32)
        high = tl.load(packed + (8 + i % 4)[None, :], mask=mask, other=0).to(tl.int32)
        sc = ((low >> (4 * (i // 8))[None, :]) & 0xF) | (((high >> (2 * (i // 4))[None, :]) & 3) << 4)
        scale = d * _as_float(sc - 32)
    elif QUANT == _Q6_K:
        d = tl.load(rows_d + (kg // 256)[None, :], mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(SC + rn[:, None] * stride_sc + (kg // 16)[None, :], mask=mask, other=0)
        scale = d * _as_float(sc.to(tl.int32))
    else:  # 32-weight blocks
        scale = tl.load(rows_d + (kg // 32)[None, :], mask=mask, other=0.0).to(tl.float32)
        if QUANT == _Q4_1 or QUANT == _Q5_1:
            offset = tl.load(MN + rn[:, None] * stride_m + (kg // 32)[None, :], mask=mask, other=0.0).to(tl.float32)
    return scale, offset
