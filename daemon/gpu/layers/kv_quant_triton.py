"""A quantized KV cache in Triton kernels: the element conversions and the tile read that
the attention kernels (triton_attention) and the fused K/V write (fused_ops_triton) share. Their
contract is kv_quant's torch reference, bit for bit on the write side.

KV_MODE, a compile-time switch of every kernel that touches the cache: 0 the cache holds
the model's dtype (the kernels run as before), 1 float8 e4m3fn bytes (uint8), 2 int8.

Written out in integer and float32 arithmetic rather than with Triton's float8 casts:
those differ between the interpreter (the tests' CPU runs, which saturate at 256 and
flush subnormals) and the GPU, and need sm_89+ for e4m3 at all; this is one code path,
exact on both, on any GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from llmd.gpu.layers.kv_quant import FP8_E4M3, INT8, KVCacheFormat

# Adding then subtracting 1.5 * 2^23 rounds a float32 below 2^22 in magnitude to an
# integer, ties to even (the float32 addition's own rounding).
_ROUND_MAGIC = tl.constexpr(12582912.0)


def kv_mode(fmt: KVCacheFormat | None) -> int:
    """The kernels' KV_MODE of a cache of format `fmt` (None: the model's dtype)."""
    return 0 if fmt is None else fmt.code


def stored_unit(fmt: KVCacheFormat | None) -> float:
    """What kv_values' numbers are short of the stored values: the readers fold it into
    the scales (e4m3 bytes widen exactly as value / 256, see kv_values)."""
    return 256.0 if fmt is FP8_E4M3 else 1.0


assert FP8_E4M3.code == 1 and INT8.code == 2  # the KV_MODE values below


@triton.jit
def _e4m3_code(y):
    """float32 y (already scaled) as its e4m3fn byte (int32 0..255): |y| clamped to 448,
    rounded to e4m3's step at its magnitude (2^(e - 3) for 2^e <= |y| < 2^(e + 1), and
    2^-9 below 2^-6) by adding and subtracting 2^(e + 20), ties to even; the sign bit
    taken from y's own (-0.0 is 0x80, as torch converts it)."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(y), 448.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e + 20)
    r = (a + magic) - magic
    r_bits = r.to(tl.int32, bitcast=True)
    r_exp = ((r_bits >> 23) & 0xFF) - 127
    normal = ((r_exp + 7) << 3) | ((r_bits >> 20) & 7)
    subnormal = (r * 512.0).to(tl.int32)  # a multiple of 2^-9 below 2^-6: 0..7
    code = tl.where(r_exp >= -6, normal, subnormal)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def kv_encode(x, inv_scale, KV_MODE: tl.constexpr):
    """x (float32) times inv_scale as the cache stores it: KV_MODE 1 an e4m3 byte
    (uint8), 2 the nearest int8 in [-127, 127] (ties to even)."""
    y = x * inv_scale
    if KV_MODE == 1:
        out = _e4m3_code(y).to(tl.uint8)
    else:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        out = ((y + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int8)
    return out


@triton.jit
def kv_values(raw, KV_MODE: tl.constexpr):
    """Stored elements as float16 numbers before the scale: int8 as they are; an e4m3
    byte's exponent and mantissa moved into an fp16's (whose exponent bias is 8 more),
    which is its value / 256 exactly, subnormals included (stored_unit)."""
    if KV_MODE == 1:
        b = raw.to(tl.uint16)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        out = bits.to(tl.float16, bitcast=True)
    else:
        out = raw.to(tl.float16)
    return out


@triton.jit
def bf16_rounded(x):
    """fp32 x rounded to the nearest bfloat16 (ties to even), kept in fp32: what a GPU's
    conversion gives, done on the bits (Triton's interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def kv_tiles(k_cache, v_cache, slot, offs_d, k_ok, d_ok, q_dtype, KV_MODE: tl.constexpr):
    """The attention kernels' read of one tile of the cache: the keys [D, BLOCK_N]
    (transposed) and values [BLOCK_N, D] at `slot` (offsets of each key's row), in the
    query's dtype `q_dtype` (a quantized cache's before its scales)."""
    k_t = tl.load(k_cache + slot[None, :] + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0)
    v = tl.load(v_cache + slot[:, None] + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0)
    if KV_MODE != 0:
        k_t = kv_values(k_t, KV_MODE).to(q_dtype)
        v = kv_values(v, KV_MODE).to(q_dtype)
    else:  # a float cache, of q's dtype or (float16 / bfloat16 for float32 queries) another
        k_t = k_t.to(q_dtype)
        v = v.to(q_dtype)
    return k_t, v
