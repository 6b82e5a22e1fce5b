"""The GGUF block formats llmd keeps packed, and their reference dequantization.

A GGUF tensor of one of these types stores each row (one output feature) as blocks along
the input dimension, 32 weights each, or 256 for the K-quants' super-blocks (eight or
sixteen sub-blocks of their own scale under one fp16 scale). The layouts (llama.cpp's
ggml-common.h; cpu/cpu_quant_formats.h spells each out byte by byte):

| type | block | bytes | a weight |
|---|--:|--:|---|
| Q8_0 | 32 | 34: fp16 d, 32 int8 q | d * q |
| Q4_0 | 32 | 18: fp16 d, 16 bytes of nibbles | d * (q - 8) |
| Q4_1 | 32 | 20: fp16 d, fp16 m, nibbles | d * q + m |
| Q5_0 | 32 | 22: fp16 d, 32 fifth bits, nibbles | d * (q - 16) |
| Q5_1 | 32 | 24: fp16 d, fp16 m, fifth bits, nibbles | d * q + m |
| Q2_K | 256 | 84: 16 4-bit scales and mins, 2-bit q, fp16 d, dmin | d * sc * q - dmin * m |
| Q3_K | 256 | 110: high bits, 2-bit q, 16 6-bit scales, fp16 d | d * sc * (q - 4) |
| Q4_K | 256 | 144: fp16 d, dmin, 8 6-bit scales and mins, nibbles | d * sc * q - dmin * m |
| Q5_K | 256 | 176: as Q4_K, with fifth bits | d * sc * q - dmin * m |
| Q6_K | 256 | 210: 4-bit q, 2-bit high q, 16 int8 scales, fp16 d | d * sc * (q - 32) |
| IQ4_NL | 32 | 18: fp16 d, 16 bytes of nibbles | d * table[q] |

(nibbles of a 32-weight block: byte i holds weight i in its low four bits and weight
i + 16 in its high four, as ggml packs them; IQ4_NL's index a table of 16 int8 values:
IQ4_NL_VALUES). IQ4_XS (256 weights in 136 bytes: fp16 d, eight 6-bit sub-block
scales ls, IQ4_NL's nibbles; a weight is d * (ls - 32) * table[q]) has no kernel of its
own: each 32-weight sub-block is held as an IQ4_NL block of the same nibbles under
d * (ls - 32) rounded to fp16 (within 2^-11 of the file's scale, far inside the format's
own 4-bit error), 144 bytes per 256 weights where the file has 136, re-encoded at load
(gguf_types.HELD_AS, reencoded). `dequantize` (torch) is the
reference every kernel is tested against; it equals the gguf package's dequantization
bit for bit (every scale product is exact in float32, so the one rounding is the same
final add).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llmd.gpu.layers.gguf_types import CPU_TYPES, HELD_AS, held_type  # noqa: F401  (held_type: re-exported)


@dataclass(frozen=True)
class Format:
    """A packed type: the C++ kernel's number for it, weights and bytes per block."""

    code: int
    block: int
    block_bytes: int


FORMATS = {
    "Q8_0": Format(0, 32, 34), "Q4_0": Format(1, 32, 18), "Q4_1": Format(2, 32, 20),
    "Q5_0": Format(3, 32, 22), "Q5_1": Format(4, 32, 24),
    "Q2_K": Format(5, 256, 84), "Q3_K": Format(6, 256, 110), "Q4_K": Format(7, 256, 144),
    "Q5_K": Format(8, 256, 176), "Q6_K": Format(9, 256, 210), "IQ4_NL": Format(10, 32, 18),
}
PACKED_TYPES = tuple(FORMATS)
assert PACKED_TYPES == CPU_TYPES, "gguf_types.CPU_TYPES names what these kernels read"
IQ4_XS_BYTES = 136  # an IQ4_XS super-block: fp16 d, 16 high scale bits, 4 bytes of low scale nibbles, 128 of nibbles
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def row_bytes(quant: str, cols: int) -> int:
    """Bytes of one packed row of `cols` weights."""
    f = FORMATS[quant]
    return cols // f.block * f.block_bytes


def reencoded(quant: str, rows: np.ndarray, held: str | None = None) -> np.ndarray:
    """Packed rows ([rows, row bytes] uint8) of a HELD_AS type in type `held` (default:
    HELD_AS[quant]; further along HELD_AS, one step after another)."""
    if quant not in HELD_AS:
        raise ValueError(f"{quant} is not re-encoded (held as another type: {', '.join(HELD_AS)})")
    held = HELD_AS[quant] if held is None else held
    steps, step = [], quant
    while step != held:
        if step not in HELD_AS:
            raise ValueError(f"{quant} is not held as {held}")
        steps.append(step)
        step = HELD_AS[step]
    for step in steps:
        rows = _REENCODE[step](rows)
    return rows


def _iq4_xs_as_iq4_nl(rows: np.ndarray) -> np.ndarray:
    """IQ4_XS -> IQ4_NL: sub-block j of a super-block (scale ls = the low nibble j % 2 of
    scale byte j // 2, with bits 2j, 2j + 1 of scales_h on top; nibbles in bytes 16j..16j
    + 15 of qs, packed as IQ4_NL's) becomes an IQ4_NL block of those nibbles under
    d * (ls - 32), the product exact in float32 and rounded once to fp16. A product
    beyond fp16's range (only a file with absurd scales) is refused."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, IQ4_XS_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, supers, 1]
    high = blocks[..., 2:4].copy().view(np.uint16).astype(np.int32)
    low = blocks[..., 4:8].astype(np.int32)
    j = np.arange(8)
    ls = ((low[..., j // 2] >> (4 * (j % 2))) & 0xF) | (((high >> (2 * j)) & 3) << 4)  # [rows, supers, 8]
    scale = d * (ls - 32).astype(np.float32)
    with np.errstate(over="ignore"):
        held = scale.astype(np.float16)
    if not np.isfinite(held).all() and np.isfinite(scale).all():
        raise ValueError(f"an IQ4_XS sub-block scale d * (ls - 32) = {float(np.abs(scale).max()):g} exceeds "
                         f"float16's range: it cannot be held as IQ4_NL")
    out = np.empty(blocks.shape[:2] + (8, 18), dtype=np.uint8)
    out[..., :2] = held[..., None].view(np.uint8)
    out[..., 2:] = blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16)
    return out.reshape(rows.shape[0], -1)


_REENCODE: dict[str, Callable[[np.ndarray], np.ndarray]] = {"IQ4_XS": _iq4_xs_as_iq4_nl}


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _shifted(b: torch.Tensor, shifts: Sequence[int]) -> torch.Tensor:
    """[..., len(shifts), n]: the bytes [..., n] shifted right by each of `shifts` (0, s,
    2s, ...: made on b's device by arange, not copied from the host, so a CUDA graph can
    capture it: a packed table's lookups run in the decode step)."""
    step = shifts[1] if len(shifts) > 1 else 0
    if tuple(shifts) != tuple(step * i for i in range(len(shifts))):
        raise ValueError(f"shifts {tuple(shifts)} are not 0, s, 2s, ...")
    by = torch.arange(len(shifts), dtype=torch.uint8, device=b.device) * step
    return b.unsqueeze(-2) >> by.unsqueeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A 32-weight block's 4-bit values [..., 32] from its 16 bytes."""
    return (_shifted(qs, (0, 4)) & 0xF).flatten(-2)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 8 n] bits of the bytes [..., n], least significant first (a little-endian
    bit field: bit i of byte i // 8)."""
    return ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=qh.device)) & 1).flatten(-2)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins [..., 8] from their 12 bytes."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[..., 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[..., 4:]).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit values [..., 16, 16] (sub-block, weight) from their 64 bytes:
    weight 128 h + 32 s + l in bits 2 s of byte 32 h + l."""
    return (_shifted(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6)) & 3).reshape(*qs.shape[:-1], 16, 16)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[..., :16]
    dl = (_f16(b, 80) * (scales & 0xF).float()).unsqueeze(-1)
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    return (dl * _two_bit(b[..., 16:80]).float() - ml).flatten(-2)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    s = b[..., 96:108]
    low = (_shifted(s[..., :8], (0, 4)) & 0xF).flatten(-2)  # scale i: byte i % 8, nibble i // 8
    high = (_shifted(s[..., 8:], (0, 2, 4, 6)) & 3).flatten(-2)  # byte 8 + i % 4, bits 2 (i // 4)
    dl = (_f16(b, 108) * ((low | (high << 4)).float() - 32)).unsqueeze(-1)
    # weight 32 c + l is q - 4 unless bit c of hmask byte l is set
    hmask = (_shifted(b[..., :32], tuple(range(8))) & 1).reshape(*b.shape[:-1], 16, 16)
    q = _two_bit(b[..., 32:96]).float() - 4 * (1 - hmask).float()
    return (dl * q).flatten(-2)


def _k_nibbles(b: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: (scales [..., 8, 1], mins [..., 8, 1], 4-bit values [..., 8, 32]);
    chunk c's weights in nibble c % 2 of bytes 32 (c // 2)..."""
    sc, mn = _scale_min_k4(b[..., 4:16])
    q = (_shifted(qs.unflatten(-1, (4, 32)), (0, 4)) & 0xF).reshape(*qs.shape[:-1], 8, 32)
    return (_f16(b, 0) * sc).unsqueeze(-1), (_f16(b, 2) * mn).unsqueeze(-1), q


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, m, q = _k_nibbles(b, b[..., 16:144])
    return (d * q.float() - m).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, m, q = _k_nibbles(b, b[..., 48:176])
    high = _shifted(b[..., 16:48], tuple(range(8))) & 1  # chunk c: bit c of byte l
    return (d * (q | (high << 4)).float() - m).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    d = (_f16(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    low = (_shifted(b[..., :128].unflatten(-1, (2, 64)), (0, 4)) & 0xF).reshape(*lead, 8, 32)
    high = (_shifted(b[..., 128:192].unflatten(-1, (2, 32)), (0, 2, 4, 6)) & 3).reshape(*lead, 8, 32)
    q = ((low | (high << 4)).float() - 32).reshape(*lead, 16, 16)
    return (d * q).flatten(-2)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    table = _iq4_nl_table(b.device)
    return _f16(b, 0) * table[_nibbles(b[..., 2:]).long()]


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl,
}


def dequantize(blocks: torch.Tensor, quant: str, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from packed rows [rows, row bytes] of type `quant`."""
    f = FORMATS[quant]
    rows = blocks.shape[0]
    return _DEQUANTIZE[quant](blocks.reshape(rows, cols // f.block, f.block_bytes)).reshape(rows, cols)


_IQ4_NL_TABLES: dict[torch.device, torch.Tensor] = {}


def _iq4_nl_table(device: torch.device) -> torch.Tensor:
    """IQ4_NL_VALUES as float32 on `device`, copied there once (a decode graph's warm-up
    makes it before the capture, which could not copy from the host)."""
    table = _IQ4_NL_TABLES.get(device)
    if table is None:
        table = _IQ4_NL_TABLES[device] = torch.from_numpy(IQ4_NL_VALUES).to(device).float()
    return table
