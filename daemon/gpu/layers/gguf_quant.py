"""GGUF block-quantized weights kept packed: the formats, their dequantization, and the
matmul a packed linear layer runs.

The formats, their layouts and the reference `dequantize` are gguf_formats'. The model
keeps such a weight as a uint8 tensor [rows, blocks * bytes per block] (`PackedSource` is how the loader hands one over;
a layer copies its rows in as they are, q and k rows unpermuted for llama like the dense
ones); a fused projection whose parts come in different types (llama.cpp's _M mixes give
v another type than q and k) keeps each part's rows in its own type, one after the other
(`PackedPart`). A linear layer over it multiplies through `GGUFMatmul`: few rows (decode)
through the C++ kernel (cpu/cpu_quant.cpp: each block dequantized in registers and
multiplied at once, so the weight is read from memory packed), more rows (prefill)
through a slice of the weight dequantized at a time and a dense GEMM. An embedding over
a packed table dequantizes the rows it looks up.

On a CPU with AVX-512 VNNI or AVX2 the parts of whole groups of 16 rows, of every type, are
repacked at load into the x16 layout (cpu/cpu_quant_x16_layout.h: each block of 16 rows
one record, the same bytes) and few rows multiply through int8 activations as
llama.cpp's do (cpu/cpu_quant_x16.cpp; a K-quant's sub-block scales and mins applied per
32 columns); more rows go through slices dequantized from that layout and a GEMM, and an
embedding's lookups read rows back in the GGUF layout (`unpack_x16`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llmd.gpu.layers.cpu.cpu_info import cpuinfo_field
from llmd.gpu.layers.gguf_formats import FORMATS, PACKED_TYPES, dequantize, row_bytes
from llmd.gpu.layers.greedy_head import GreedyHead


# Rows up to which a product runs through the kernel; above, dequantized slices and a GEMM
# (measured on AVX-512: the kernel is faster to 16 rows, the GEMM from 32; docs/benchmarks.md).
KERNEL_MAX_ROWS = 16
# Bytes of float32 weight dequantized at a time on the GEMM path: a slice the GEMM reads
# from cache (the 1B's 128-token prefill 5.5 -> 3.1 s against 4096 rows, 32 MiB at 2048
# columns) and a scratch that stays small.
SLICE_BYTES = 4 << 20

# An LM head's x16 product of at least this many bytes of float32 output goes into a
# buffer the layer keeps from step to step (ReusedOutput): its logits (Gemma 3's 262,144
# columns at 32 rows: 32 MiB) are above glibc's largest mmap threshold, so a new tensor
# each step is mapped afresh and every page faulted in and zeroed by the kernel (~8 ms of
# that product's 30 ms). The kernel also stores such an output past the caches (its
# kStreamBytes). Only the LM head: a buffer kept by every layer whose prefill outputs
# reach the size would hold them all (Gemma's 18 gate/up projections at 1,024 rows: 300 MiB).
REUSED_OUTPUT_BYTES = 8 << 20

X16_TYPES = PACKED_TYPES  # what the x16 kernel reads: every packed type
X16_GROUP = 16  # weight rows per x16 record
# Rows up to which a product with an x16 weight runs through its kernel, by its passes
# over x (each pass is as many int8 dot products; above, a dequantized slice and a float32
# GEMM are faster), per the ISA the product runs with and the CPU's maker: where the
# crossover lies is the ratio of the CPU's int8 dot-product rate to its float32 FMA rate
# (docs/benchmarks.md). Intel's AVX-512 cores (measured: a Xeon with VNNI) run two 512-bit
# FMAs a cycle: one pass beats the GEMM 1.2-1.4x at 512 rows, two only to 64. AMD's Zen 4
# runs 512-bit operations on 256-bit units, float32 FMAs at half that rate and vpdpbusd
# not: two passes beat oneDNN's GEMM 1.1-1.7x from 32 to 512 rows and Q4_K 1.4x at 1,024
# (Q6_K level there; a 1,024-token prefill of the 1B Q4_K_M 16% faster, its 128-token one
# 1.6x), three to 64, one 2x at 2,048 (any chunk). AVX2 (Zen 3): two passes win to 64.
X16_MAX_ROWS = {
    "avx512_vnni": {1: 512, 2: 64, 3: 32},
    "avx512_vnni/AuthenticAMD": {1: 1 << 20, 2: 1024, 3: 64},
    "avx2": {1: 512, 2: 64, 3: 32},
}


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


@dataclass(frozen=True)
class PackedPart:
    """Output rows [start, end) of a packed weight, all of type `quant`, stored from byte
    `offset` of the weight's bytes."""

    quant: str
    start: int
    end: int
    offset: int


def packed_parts(quants: Sequence[str], sizes: Sequence[int], cols: int, merged: bool = True
                 ) -> tuple[PackedPart, ...]:
    """The parts of a weight whose consecutive row groups (`sizes` rows each) have types
    `quants`: neighbours of one type merged (one kernel call covers them) unless not
    `merged` (a part per row group)."""
    parts: list[PackedPart] = []
    start = offset = 0
    for quant, size in zip(quants, sizes):
        if merged and parts and parts[-1].quant == quant:
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
        """Rows `[a:b]`, or (a row-parallel layer's share) columns `[:, a:b]`: whole blocks."""
        if isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None) and isinstance(index[1], slice):
            return self.columns(index[1].start, index[1].stop)[:]
        if not isinstance(index, slice):
            raise ValueError(f"a packed {self.quant} tensor is sliced by whole rows or columns only")
        return torch.from_numpy(np.array(self.data[index]))  # a copy: the file map is read-only

    def rows(self, start: int, end: int) -> PackedSource:
        """Its rows [start, end) as a source of their own (tensor parallelism's share)."""
        return dataclasses.replace(self, data=self.data[start:end], shape=(end - start, self.shape[1]))

    def columns(self, start: int, end: int) -> PackedSource:
        """Its columns [start, end) as a source of their own: the bytes of those whole
        blocks of each row (tensor parallelism's share of a row-parallel weight); a
        ValueError where a bound falls inside a block."""
        block = FORMATS[self.quant].block
        if start % block or end % block:
            raise ValueError(f"cannot be split at columns {start}:{end}: its {self.quant} blocks are {block} "
                             f"weights wide")
        size = FORMATS[self.quant].block_bytes
        data = self.data[:, start // block * size:end // block * size]
        return dataclasses.replace(self, data=data, shape=(self.shape[0], end - start))

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor of its logical shape."""
        return dequantize(self[:], self.quant, self.shape[1])


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


def x16_max_rows(ops: Any) -> dict[int, int]:
    """Passes over x -> the rows up to which an x16 product runs through the kernel
    (X16_MAX_ROWS for the ISA `ops.mm_x16` runs with, on this CPU's maker)."""
    table = X16_MAX_ROWS.get(f"{ops.x16_isa}/{cpu_vendor()}") or X16_MAX_ROWS.get(ops.x16_isa)
    return table or X16_MAX_ROWS["avx2"]


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD; "" where it does not say)."""
    return cpuinfo_field("vendor_id")


def x16_row_reader(module: torch.nn.Module, ops: Any) -> Any:
    """ids -> those rows of `module`'s x16 weight in the GGUF layout (an embedding's lookups)."""
    code, cols = FORMATS[module.quant].code, module.in_features
    return lambda ids: ops.unpack_x16(module.weight, ids, code, cols)


class ReusedOutput:
    """A float32 buffer handed out again for the next product once nothing else holds
    it (a caller keeping a product's result gets a new one the next time, never an
    overwritten one)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.own_uses = 0  # the storage's use count with only this object holding it

    def get(self, rows: int, cols: int) -> torch.Tensor:
        buf = self.buffer
        if buf is None or buf.numel() < rows * cols or _uses(buf) > self.own_uses:
            buf = self.buffer = torch.empty(rows * cols, dtype=torch.float32)
            self.own_uses = _uses(buf)
        return buf[: rows * cols].view(rows, cols)


def _uses(t: torch.Tensor) -> int:
    """References to t's storage (tensors and views over it)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class GGUFMatmul:
    """x -> x W^T (+ b unless the layer reduces) over a linear layer's packed weight
    (module doc), part by part (`layer.packed_parts`); `ops` are the C++ kernels
    (cpu_kernels.GGUFOps; None: the torch reference, every product through dequantized
    slices and a GEMM). With `x16_passes`, the parts the x16 kernel reads are repacked
    (use_x16) and multiplied in that many passes over x."""

    def __init__(self, layer: torch.nn.Module, ops: Any, x16_passes: int = 0, reuse_output: bool = False) -> None:
        self.layer = layer
        self.ops = ops
        self.with_bias = not getattr(layer, "reduce", False)
        cols = layer.in_features
        self.max_rows = x16_max_rows(ops) if x16_passes else {}  # passes -> rows through the x16 kernel
        self.parts = []  # (part, its type's code, its packed rows, x16 passes or 0)
        for part in layer.packed_parts:
            passes = x16_passes if x16_passes and use_x16(layer.weight, part, cols, ops) else 0
            self.parts.append((part, FORMATS[part.quant].code, part_weight(layer.weight, part, cols), passes))
        # an LM head's large outputs (REUSED_OUTPUT_BYTES), where one x16 part writes them all
        single = len(self.parts) == 1 and self.parts[0][3] and ops.mm_x16_into is not None
        self.reused = ReusedOutput() if reuse_output and single else None
        # its greedy rows at one pass, refined (greedy_head): where x16 takes two or more
        self.greedy = None
        if self.reused is not None and self.parts[0][3] >= 2 and getattr(ops, "argmax_refine_", None):
            _, code, weight, passes = self.parts[0]
            self.greedy = GreedyHead(ops, weight, code, cols, passes, self.reused, self.max_rows)

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
        if passes and rows.shape[0] <= self.max_rows[passes]:
            if self.reused is not None and rows.dtype == torch.float32 and \
                    rows.shape[0] * out_features * 4 >= REUSED_OUTPUT_BYTES:
                out = self.reused.get(rows.shape[0], out_features)
                return ops.mm_x16_into(rows.contiguous(), weight, code, cols, passes, "", out)
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
