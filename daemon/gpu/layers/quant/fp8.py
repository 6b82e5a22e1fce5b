"""FP8 weights: float8 e4m3 values times a float32 scale, w = e4m3(byte) * scale.

The checkpoint's `weight` is float8_e4m3fn [out, in]; its scale (`weight_scale`, HF's
fine-grained `weight_scale_inv`, which despite the name multiplies too) is one per
tensor (shape [] or [1]), one per output row ([out, 1]), or one per (rows, columns)
block ([ceil(out / rows), ceil(in / columns)]). The model keeps each weight as
`FP8Rows`: the bytes [out, in] (uint8) and a scale per row and group of columns
[out, groups] (a tensor's scale repeated down its rows, a block's down its block's
rows), so the parts of a fused projection, each with its own scale, sit one after
the other. Activations stay in the model's dtype (W8A16): a static `input_scale`
(W8A8 checkpoints) is not applied.

`FP8Matmul` multiplies few rows (decode) through the C++ kernel (cpu/cpu_fp8.cpp: each
byte widened to float32 in registers, so the weight is read from memory as bytes) and
more (prefill) through slices dequantized at a time and a dense GEMM; torch's own
float8 conversion on CPU is ~60x slower than a float32 matmul of the same weight
(docs/benchmarks.md), so without the kernels the slices are dequantized by table
lookup (`dequantize`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmd.gpu.layers.gguf_quant import sliced_linear

KERNEL_MAX_ROWS = 16  # rows of x up to which the kernel runs (above: dequantized slices and a GEMM)
KERNEL_COLUMN_MULTIPLE = 16  # the kernel reads a group 16 columns at a time


@dataclass
class FP8Rows:
    """A weight [out, in] as e4m3 `bytes` (uint8) and `scales` float32 [out, groups]
    (each group in // groups columns)."""

    bytes: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.bytes, self.scales)


def e4m3_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [256]: the value of each e4m3 byte (sign, 4 exponent bits biased by 7, 3
    mantissa bits; 0x7F and 0xFF NaN), from the format's definition."""
    b = torch.arange(256, device=device)
    exponent, mantissa = (b >> 3) & 0xF, (b & 7).float()
    magnitude = torch.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7).float())
    value = torch.where(b & 0x80 != 0, -magnitude, magnitude)
    return torch.where((b & 0x7F) == 0x7F, torch.nan, value)


def dequantize(weight_bytes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] of e4m3 bytes [out, in] and scales [out, groups]."""
    values = e4m3_table(weight_bytes.device)[weight_bytes.long()]
    return values * scales.repeat_interleave(weight_bytes.shape[1] // scales.shape[1], dim=1)


def fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             row_offset: int, col_offset: int, where: str) -> FP8Rows:
    """A weight's slice (its first row and column in the whole weight: `row_offset`,
    `col_offset`) and the scales read for it: a tensor's, its rows', or the blocks that
    cover it (read from block row_offset // rows and column col_offset // columns)."""
    rows, cols = weight.shape
    data = weight.contiguous().view(torch.uint8)
    scale = scale.float()
    if block is None:
        if scale.numel() == 1:
            return FP8Rows(data, scale.reshape(1, 1).expand(rows, 1).contiguous())
        if scale.numel() == rows:
            return FP8Rows(data, scale.reshape(rows, 1).contiguous())
        raise ValueError(f"{where}: scale of shape {tuple(scale.shape)} is neither per tensor nor per row of "
                         f"a [{rows}, {cols}] weight")
    block_rows, block_cols = block
    if col_offset % block_cols or cols % block_cols:
        raise ValueError(f"{where}: {cols} input columns (from column {col_offset}) are not whole "
                         f"{block_cols}-column blocks")
    first = row_offset // block_rows
    which = torch.arange(row_offset, row_offset + rows) // block_rows - first
    if scale.dim() != 2 or scale.shape[0] <= int(which[-1]) or scale.shape[1] != cols // block_cols:
        raise ValueError(f"{where}: block scales of shape {tuple(scale.shape)} do not cover a [{rows}, {cols}] "
                         f"weight in {block_rows}x{block_cols} blocks")
    return FP8Rows(data, scale[which].contiguous())


def join(parts: list[FP8Rows]) -> FP8Rows:
    """The parts of a fused projection one after the other (scales repeated to the
    finest grouping among them)."""
    groups = max(p.scales.shape[1] for p in parts)
    scales = [p.scales.repeat_interleave(groups // p.scales.shape[1], dim=1) for p in parts]
    return FP8Rows(torch.cat([p.bytes for p in parts]), torch.cat(scales))


class FP8Matmul:
    """x -> x W^T (+ b unless the layer reduces) over a layer's FP8 weight (`weight`
    bytes, `weight_scales`); `ops` the C++ kernels (cpu_kernels.FP8Ops; None: the
    table-lookup dequantization and a GEMM for every product)."""

    def __init__(self, layer: torch.nn.Module, ops: Any) -> None:
        self.layer = layer
        self.with_bias = not getattr(layer, "reduce", False)
        cols = layer.weight.shape[1]
        group = cols // layer.weight_scales.shape[1]
        self.ops = ops if ops is not None and group % KERNEL_COLUMN_MULTIPLE == 0 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        weight, scales = layer.weight, layer.weight_scales
        rows = x.reshape(-1, weight.shape[1])
        if rows.shape[0] == 0:
            out = rows.new_empty(0, weight.shape[0])
        elif self.ops is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.ops.mm(rows.contiguous(), weight, scales)
        else:
            dense: Callable[..., torch.Tensor] = self.ops.dequantize if self.ops is not None else dequantize
            out = sliced_linear(rows, weight.shape[0], lambda a, b: dense(weight[a:b], scales[a:b]))
        bias = layer.bias if self.with_bias else None
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
