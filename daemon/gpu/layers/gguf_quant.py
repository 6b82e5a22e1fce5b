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


class GGUFMatmul:
    """x -> x W^T (+ b unless the layer reduces) over a linear layer's packed weight
    (module doc); `ops` are the C++ kernels (cpu_kernels.GGUFOps; None: the torch
    reference, every product through dequantized slices and a GEMM)."""

    def __init__(self, layer: torch.nn.Module, ops: Any) -> None:
        self.layer = layer
        self.ops = ops
        self.code = TYPE_CODES[layer.quant]
        self.with_bias = not getattr(layer, "reduce", False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer, ops = self.layer, self.ops
        weight, quant = layer.weight, layer.quant
        cols, out_features = layer.in_features, weight.shape[0]
        rows = x.reshape(-1, cols)
        if rows.shape[0] == 0:
            out = rows.new_empty(0, out_features)
        elif rows.shape[0] <= KERNEL_MAX_ROWS and ops is not None:
            out = ops.mm(rows.contiguous(), weight, self.code, cols)
        else:
            def dense(a: int) -> torch.Tensor:
                piece = weight[a:a + SLICE_ROWS]
                w = ops.dequantize(piece, self.code, cols) if ops is not None else dequantize(piece, quant, cols)
                return w.to(rows.dtype)
            out = torch.cat([F.linear(rows, dense(a)) for a in range(0, out_features, SLICE_ROWS)], dim=-1)
        bias = layer.bias if self.with_bias else None
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out_features)

