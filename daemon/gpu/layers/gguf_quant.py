"""GGUF block-quantized weights kept packed: the formats, their dequantization, and the
matmul a packed linear layer runs.

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

(nibbles of a 32-weight block: byte i holds weight i in its low four bits and weight
i + 16 in its high four, as ggml packs them). IQ4_NL (32; 18: fp16 d, nibbles indexing a
table of 16 int8 values; d * table[q]) is held as Q8_0, re-encoded at load (HELD_AS). The model keeps such a weight as a uint8
tensor [rows, blocks * bytes per block] (`PackedSource` is how the loader hands one over;
a layer copies its rows in as they are, q and k rows unpermuted for llama like the dense
ones); a fused projection whose parts come in different types (llama.cpp's _M mixes give
v another type than q and k) keeps each part's rows in its own type, one after the other
(`PackedPart`). A linear layer over it multiplies through `GGUFMatmul`: few rows (decode)
through the C++ kernel (cpu/cpu_quant.cpp: each block dequantized in registers and
multiplied at once, so the weight is read from memory packed), more rows (prefill)
through a slice of the weight dequantized at a time and a dense GEMM. An embedding over
a packed table dequantizes the rows it looks up. `dequantize` (torch) is the reference
every path is tested against; it equals the gguf package's dequantization bit for bit
(every scale product is exact in float32, so the one rounding is the same final add).

On a CPU with AVX-512 VNNI or AVX2 the parts of whole groups of 16 rows, of every type, are
repacked at load into the x16 layout (cpu/cpu_quant_x16_layout.h: each block of 16 rows
one record, the same bytes) and few rows multiply through int8 activations as
llama.cpp's do (cpu/cpu_quant_x16.cpp; a K-quant's sub-block scales and mins applied per
32 columns); more rows go through slices dequantized from that layout and a GEMM, and an
embedding's lookups read rows back in the GGUF layout (`unpack_x16`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


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
    "Q5_K": Format(8, 256, 176), "Q6_K": Format(9, 256, 210),
}
PACKED_TYPES = tuple(FORMATS)
# GGUF types a weight is held in as another packed type, re-encoded at load without loss
# (reencoded): IQ4_NL's 4-bit indices into a table of 16 int8 values become those values,
# a Q8_0 block under the same fp16 scale (d * IQ4_NL_VALUES[i] is Q8_0's d * q), so its
# weights run through Q8_0's kernels, at 34 bytes per 32 weights where the file has 18.
HELD_AS = {"IQ4_NL": "Q8_0"}
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
# Rows up to which a product runs through the kernel; above, dequantized slices and a GEMM
# (measured on AVX-512: the kernel is faster to 16 rows, the GEMM from 32; docs/benchmarks.md).
KERNEL_MAX_ROWS = 16
# Bytes of float32 weight dequantized at a time on the GEMM path: a slice the GEMM reads
# from cache (the 1B's 128-token prefill 5.5 -> 3.1 s against 4096 rows, 32 MiB at 2048
# columns) and a scratch that stays small.
SLICE_BYTES = 4 << 20

X16_TYPES = PACKED_TYPES  # what the x16 kernel reads: every packed type
X16_GROUP = 16  # weight rows per x16 record
# Rows up to which a product with an x16 weight runs through its kernel, by its passes
# over x (each pass is as many dot products; above, a dequantized slice and a GEMM are
# faster: measured on AVX-512 VNNI, docs/benchmarks.md; one pass beats the GEMM 1.2-1.4x
# at 512 rows, so a prompt of up to 512 tokens runs at cpu_int8_activations' precision).
X16_MAX_ROWS = {1: 512, 2: 64, 3: 32}


def slice_rows(cols: int) -> int:
    """Output features dequantized at a time for `cols` input features (whole x16 groups)."""
    return max(X16_GROUP, SLICE_BYTES // (4 * cols) // X16_GROUP * X16_GROUP)


def sliced_linear(rows: torch.Tensor, out_features: int, dense: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """rows W^T for a weight dequantized slice by slice (the GEMM path of packed weights):
    `dense(a, b)` gives W's rows a..b-1 as floats, slice_rows at a time, and each slice's
    product goes into its columns of one output (few, same-sized temporaries).

    In float32 each slice's GEMM is oneDNN's (`mkldnn._linear_pointwise` on the plain
    weight, not reordered: a slice is used once) rather than `F.linear`'s MKL sgemm: on
    the 2 Zen 3 cores 1.05-1.3x faster at 65-128 rows, the same at 512, and the 1B Q4_K_M's
    128-token prefill 4.0 -> 3.0 s (median of 6 alternated; docs/benchmarks.md)."""
    step = slice_rows(rows.shape[1])
    out = rows.new_empty(rows.shape[0], out_features)
    onednn = rows.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    rows = rows.contiguous() if onednn else rows
    for a in range(0, out_features, step):
        w = dense(a, a + step).to(rows.dtype)
        out[:, a:a + step] = (torch.ops.mkldnn._linear_pointwise(rows, w.contiguous(), None, "none", [], "")
                              if onednn else F.linear(rows, w))
    return out


def row_bytes(quant: str, cols: int) -> int:
    """Bytes of one packed row of `cols` weights."""
    f = FORMATS[quant]
    return cols // f.block * f.block_bytes


def held_type(quant: str) -> str:
    """The packed type a GGUF weight of type `quant` is held in (itself, or HELD_AS')."""
    return HELD_AS.get(quant, quant)


def reencoded(quant: str, rows: np.ndarray) -> np.ndarray:
    """Packed rows ([rows, row bytes] uint8) of a HELD_AS type in the type it is held in.
    IQ4_NL -> Q8_0: each 18-byte block (fp16 d; 16 bytes of nibbles, byte i holding
    weight i's index in its low four bits and weight i + 16's in its high four) becomes
    d and the 32 int8 table values, in weight order."""
    if quant != "IQ4_NL":
        raise ValueError(f"{quant} is not re-encoded (held as another type: {', '.join(HELD_AS)})")
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, 18)
    out = np.empty(blocks.shape[:2] + (34,), dtype=np.uint8)
    out[..., :2] = blocks[..., :2]
    nibbles = blocks[..., 2:]
    out[..., 2:18] = IQ4_NL_VALUES[nibbles & 0x0F].view(np.uint8)
    out[..., 18:] = IQ4_NL_VALUES[nibbles >> 4].view(np.uint8)
    return out.reshape(rows.shape[0], -1)


def packable(quant: str | None, cols: int) -> bool:
    """Whether a weight of this type and row width can be kept packed here: a type with a
    kernel, rows a whole number of its blocks."""
    return quant in FORMATS and cols % FORMATS[quant].block == 0


@dataclass(frozen=True)
class PackedPart:
    """Output rows [start, end) of a packed weight, all of type `quant`, stored from byte
    `offset` of the weight's bytes."""

    quant: str
    start: int
    end: int
    offset: int


def packed_parts(quants: Sequence[str], sizes: Sequence[int], cols: int) -> tuple[PackedPart, ...]:
    """The parts of a weight whose consecutive row groups (`sizes` rows each) have types
    `quants`: neighbours of one type merged (one kernel call covers them)."""
    parts: list[PackedPart] = []
    start = offset = 0
    for quant, size in zip(quants, sizes):
        if parts and parts[-1].quant == quant:
            parts[-1] = PackedPart(quant, parts[-1].start, start + size, parts[-1].offset)
        else:
            parts.append(PackedPart(quant, start, start + size, offset))
        start += size
        offset += size * row_bytes(quant, cols)
    return tuple(parts)


def part_weight(weight: torch.Tensor, part: PackedPart, cols: int) -> torch.Tensor:
    """The packed rows [rows, row bytes] of `part` (a view of the weight's bytes)."""
    size = row_bytes(part.quant, cols)
    return weight.reshape(-1)[part.offset:part.offset + (part.end - part.start) * size].view(-1, size)


@dataclass
class PackedSource:
    """A checkpoint tensor as its packed rows ([rows, row bytes] uint8), logical shape
    [rows, cols]: what the GGUF loader yields for a weight the model keeps packed. It
    slices by rows like a tensor (a layer takes its rows of it)."""

    quant: str
    data: np.ndarray
    shape: tuple[int, int]

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, slice):
            raise ValueError(f"a packed {self.quant} tensor is sliced by whole rows only")
        return torch.from_numpy(np.array(self.data[index]))  # a copy: the file map is read-only

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor of its logical shape."""
        return dequantize(self[:], self.quant, self.shape[1])


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _shifted(b: torch.Tensor, shifts: Sequence[int]) -> torch.Tensor:
    """[..., len(shifts), n]: the bytes [..., n] shifted right by each of `shifts`."""
    return b.unsqueeze(-2) >> torch.tensor(shifts, dtype=torch.uint8, device=b.device).unsqueeze(-1)


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


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize(blocks: torch.Tensor, quant: str, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from packed rows [rows, row bytes] of type `quant`."""
    f = FORMATS[quant]
    rows = blocks.shape[0]
    return _DEQUANTIZE[quant](blocks.reshape(rows, cols // f.block, f.block_bytes)).reshape(rows, cols)


def use_x16(weight: torch.nn.Parameter, part: PackedPart, cols: int, ops: Any) -> bool:
    """Whether `part` of a packed weight is read in the x16 layout, repacking it in place
    now if it is not yet (a weight tied to another module is repacked once: the
    parameter carries which parts are)."""
    done = getattr(weight, "x16_parts", frozenset())
    if part.offset in done:
        return True
    if ops is None or not ops.x16 or part.quant not in X16_TYPES or (part.end - part.start) % X16_GROUP:
        return False
    with torch.no_grad():  # in place, no copy of the weight (the load's peak)
        ops.repack_x16_(part_weight(weight, part, cols), FORMATS[part.quant].code, cols)
    weight.x16_parts = done | {part.offset}
    return True


def x16_passes(ops: Any, int8_activations: bool = False) -> int:
    """The int8 passes over x an x16 product takes (cpu/cpu_quant_x16.cpp): one with
    `int8_activations` (the engine setting cpu_int8_activations: llama.cpp's precision),
    else two, whatever the model's dtype (float32, bfloat16, float16) — unless
    LLMD_GGUF_X16 set them (cpu_kernels; 3 is float32's precision).

    Two passes hold x to within 1/64516 of each 32-column block's largest value (~16
    bits: more than bfloat16's and float16's mantissas), while the packed weights carry
    2-8 bits: a third pass moves a product by ~1e-5 of its scale — not a token of the
    built-in model's, Gemma 3 270M's or the 1B's greedy output (tests/test_gguf.py) —
    and costs ~30% of a batch-1 decode step where two passes stream the weights at the
    memory's speed (the 1B Q4_K_M on 2 Zen 3 cores: 9.3 -> 11.5 tok/s, llama.cpp 11.7;
    docs/benchmarks.md)."""
    if ops.x16_passes is not None:
        return ops.x16_passes
    return 1 if int8_activations else 2


def x16_row_reader(module: torch.nn.Module, ops: Any) -> Any:
    """ids -> those rows of `module`'s x16 weight in the GGUF layout (an embedding's lookups)."""
    code, cols = FORMATS[module.quant].code, module.in_features
    return lambda ids: ops.unpack_x16(module.weight, ids, code, cols)


class GGUFMatmul:
    """x -> x W^T (+ b unless the layer reduces) over a linear layer's packed weight
    (module doc), part by part (`layer.packed_parts`); `ops` are the C++ kernels
    (cpu_kernels.GGUFOps; None: the torch reference, every product through dequantized
    slices and a GEMM). With `x16_passes`, the parts the x16 kernel reads are repacked
    (use_x16) and multiplied in that many passes over x."""

    def __init__(self, layer: torch.nn.Module, ops: Any, x16_passes: int = 0) -> None:
        self.layer = layer
        self.ops = ops
        self.with_bias = not getattr(layer, "reduce", False)
        cols = layer.in_features
        self.parts = []  # (part, its type's code, its packed rows, x16 passes or 0)
        for part in layer.packed_parts:
            passes = x16_passes if x16_passes and use_x16(layer.weight, part, cols, ops) else 0
            self.parts.append((part, FORMATS[part.quant].code, part_weight(layer.weight, part, cols), passes))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        cols = layer.in_features
        rows = x.reshape(-1, cols)
        outs = [self._product(rows, part.quant, code, weight, passes) for part, code, weight, passes in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        bias = layer.bias if self.with_bias else None
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _product(self, rows: torch.Tensor, quant: str, code: int, weight: torch.Tensor, passes: int) -> torch.Tensor:
        ops, cols, out_features = self.ops, rows.shape[1], weight.shape[0]
        if rows.shape[0] == 0:
            return rows.new_empty(0, out_features)
        if passes and rows.shape[0] <= X16_MAX_ROWS[passes]:
            return ops.mm_x16(rows.contiguous(), weight, code, cols, passes)
        if not passes and rows.shape[0] <= KERNEL_MAX_ROWS and ops is not None:
            return ops.mm(rows.contiguous(), weight, code, cols)

        def dense(a: int, b: int) -> torch.Tensor:
            piece = weight[a:b]  # whole x16 groups: slice_rows is a multiple of 16
            if passes:
                return ops.dequantize_x16(piece, code, cols)
            if ops is not None:
                return ops.dequantize(piece, code, cols)
            return dequantize(piece, quant, cols)
        return sliced_linear(rows, out_features, dense)
