"""GGUF block-quantized weights kept packed: the formats, their dequantization, and the
matmul a packed linear layer runs.

A GGUF tensor of one of these types stores each row (one output feature) as blocks of
32 weights along the input dimension, each block its own scale (and minimum):

| type | bytes per block | a weight |
|---|--:|---|
| Q8_0 | 34: fp16 d, 32 int8 q | d * q |
| Q4_0 | 18: fp16 d, 16 bytes of nibbles | d * (q - 8) |
| Q4_1 | 20: fp16 d, fp16 m, 16 bytes of nibbles | d * q + m |

(nibbles: byte i holds weight i in its low four bits and weight i + 16 in its high four,
as ggml packs them). The model keeps such a weight as a uint8 tensor [rows, blocks *
bytes per block] (`PackedSource` is how the loader hands one over; a layer copies its
rows in as they are, q and k rows unpermuted for llama like the dense ones). A linear
layer over it multiplies through `GGUFMatmul`: few rows (decode) through the C++ kernel
(cpu/cpu_quant.cpp: each block dequantized in registers and multiplied at once, so the
weight is read from memory packed), more rows (prefill) through a slice of the weight
dequantized at a time and a dense GEMM. An embedding over a packed table dequantizes the
rows it looks up. `dequantize` (torch) is the reference every path is tested against.

On a CPU with AVX-512 VNNI a Q8_0/Q4_0/Q4_1 weight of rows in groups of 16 is repacked
at load into the x16 layout (cpu/cpu_quant_x16.cpp: each 32-column block of 16 rows one
record, the same bytes) and few rows multiply through int8 activations as llama.cpp's
do; more rows go through slices dequantized from that layout and a GEMM, and an
embedding's lookups read rows back in the GGUF layout (`unpack_x16`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block, every type here
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
PACKED_TYPES = tuple(BLOCK_BYTES)
TYPE_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}  # the C++ kernel's numbering
# Rows up to which a product runs through the kernel; above, dequantized slices and a GEMM
# (measured on AVX-512: the kernel is faster to 16 rows, the GEMM from 32; docs/benchmarks.md).
KERNEL_MAX_ROWS = 16
# Output features dequantized at a time on the GEMM path (bounds its scratch memory).
SLICE_ROWS = 4096
X16_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # what the x16 kernel reads
X16_GROUP = 16  # weight rows per x16 record
# Rows up to which a product with an x16 weight runs through its kernel, by its passes
# over x (each pass is as many dot products; above, a dequantized slice and a GEMM are
# faster: measured on AVX-512 VNNI, docs/benchmarks.md).
X16_MAX_ROWS = {1: 128, 2: 64, 3: 32}


def row_bytes(quant: str, cols: int) -> int:
    """Bytes of one packed row of `cols` weights."""
    return cols // BLOCK * BLOCK_BYTES[quant]


def packable(quant: str | None, cols: int) -> bool:
    """Whether a weight of this type and row width can be kept packed here."""
    return quant in BLOCK_BYTES and cols % BLOCK == 0


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


def dequantize(blocks: torch.Tensor, quant: str, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from packed rows [rows, row bytes] of type `quant`."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, cols // BLOCK, BLOCK_BYTES[quant])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if quant == "Q8_0":
        return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, cols)
    qs = b[..., 4:] if quant == "Q4_1" else b[..., 2:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()
    if quant == "Q4_0":
        return (d * (q - 8)).reshape(rows, cols)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows, cols)


def use_x16(module: torch.nn.Module, ops: Any) -> bool:
    """Whether `module`'s packed weight is read in the x16 layout, repacking it now if it
    is not yet (a weight tied to another module is repacked once: the parameter carries
    its layout)."""
    weight = module.weight
    if getattr(weight, "gguf_layout", None) == "x16":
        return True
    if ops is None or not ops.x16 or module.quant not in X16_TYPES or weight.shape[0] % X16_GROUP:
        return False
    weight.data = ops.repack_x16(weight.data, TYPE_CODES[module.quant], module.in_features)
    weight.gguf_layout = "x16"
    return True


def x16_passes(ops: Any, dtype: torch.dtype) -> int:
    """The int8 passes over x an x16 product takes (cpu/cpu_quant_x16.cpp): as many as
    the model's activations have bits — 3 (about 23) for float32, 2 (15) for bfloat16
    and float16 — unless LLMD_GGUF_X16 set them (cpu_kernels)."""
    if ops.x16_passes is not None:
        return ops.x16_passes
    return 3 if dtype == torch.float32 else 2


def x16_row_reader(module: torch.nn.Module, ops: Any) -> Any:
    """ids -> those rows of `module`'s x16 weight in the GGUF layout (an embedding's lookups)."""
    code, cols = TYPE_CODES[module.quant], module.in_features
    return lambda ids: ops.unpack_x16(module.weight, ids, code, cols)


class GGUFMatmul:
    """x -> x W^T (+ b unless the layer reduces) over a linear layer's packed weight
    (module doc); `ops` are the C++ kernels (cpu_kernels.GGUFOps; None: the torch
    reference, every product through dequantized slices and a GEMM); `x16_passes`: the
    weight is in the x16 layout (use_x16) and its kernel takes that many passes over x
    (0: the GGUF layout)."""

    def __init__(self, layer: torch.nn.Module, ops: Any, x16_passes: int = 0) -> None:
        self.layer = layer
        self.ops = ops
        self.code = TYPE_CODES[layer.quant]
        self.with_bias = not getattr(layer, "reduce", False)
        self.x16 = x16_passes > 0
        self.passes = x16_passes
        self.max_kernel_rows = X16_MAX_ROWS[x16_passes] if self.x16 else KERNEL_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer, ops = self.layer, self.ops
        weight, quant = layer.weight, layer.quant
        cols, out_features = layer.in_features, weight.shape[0]
        rows = x.reshape(-1, cols)
        if rows.shape[0] == 0:
            out = rows.new_empty(0, out_features)
        elif rows.shape[0] <= self.max_kernel_rows and ops is not None:
            if self.x16:
                out = ops.mm_x16(rows.contiguous(), weight, self.code, cols, self.passes)
            else:
                out = ops.mm(rows.contiguous(), weight, self.code, cols)
        else:
            def dense(a: int) -> torch.Tensor:
                piece = weight[a:a + SLICE_ROWS]  # whole x16 groups: SLICE_ROWS is a multiple of 16
                if self.x16:
                    w = ops.dequantize_x16(piece, self.code, cols)
                elif ops is not None:
                    w = ops.dequantize(piece, self.code, cols)
                else:
                    w = dequantize(piece, quant, cols)
                return w.to(rows.dtype)
            out = torch.cat([F.linear(rows, dense(a)) for a in range(0, out_features, SLICE_ROWS)], dim=-1)
        bias = layer.bias if self.with_bias else None
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out_features)

