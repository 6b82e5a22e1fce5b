"""GGUF blocks laid out for a GPU: every field of a type's blocks gathered into its own
plane, the same bytes in another order (the layout the Triton kernels read,
quant/triton_quant_mm.py).

Why not the blocks as stored: a block is 18, 20, 22, 34, 144, 176 or 210 bytes, so a
tile of blocks starts at addresses no wider load can use and mixes the fp16 scales into
the quantized values: a warp's loads of a weight tile come out as single bytes. In
planes, the quantized values of a row are one contiguous run (16-byte aligned: K is a
multiple of 32), the high bits another, the scales a third, so a tile's values load as
16-byte vectors and its scales as one small load per group. Nothing is decoded or
widened at load: the planes hold exactly the blocks' bytes (the same memory and the
same bytes per weight as the file, so the roofline of the packed bytes is the file's),
and the nibbles keep ggml's order inside a block (the kernels take x's columns in that
order instead, which costs nothing: x is tiny). vLLM's Marlin goes further (it
shuffles values into the tensor cores' fragment order), which Triton does not expose.

A part of `rows` rows and `cols` columns of type `quant` is `rows * row_bytes` bytes:
for each field of the block (`FIELDS`, in the block's order), its bytes of every block
of every row, [rows, blocks * field width] row-major, one plane after the other. The
repack (`to_planes`) and its inverse (`from_planes`, what an embedding reads its rows
back through) are byte permutations; `plane_views` gives the kernels typed views.
IQ4_XS, which has no Triton kernel, arrives re-encoded as IQ4_NL (gguf_types.HELD_AS).
"""
from __future__ import annotations

import torch

from llmd.gpu.layers import gguf_types
from llmd.gpu.layers.gguf_quant import FORMATS, PackedPart, part_weight

# Each type's fields as (name, first byte, end byte) within one block (ggml-common.h;
# gguf_formats' table): d / m / dmin fp16 scales, qs the 4-bit (8-bit for Q8_0, 2-bit for
# Q2_K, Q3_K) values, qh the high bits (Q3_K's hmask), sc the K-quants' sub-block scales
# (Q2_K's with their mins); IQ4_NL's qs are indices into its table.
FIELDS: dict[str, tuple[tuple[str, int, int], ...]] = {
    "Q8_0": (("d", 0, 2), ("qs", 2, 34)),
    "Q4_0": (("d", 0, 2), ("qs", 2, 18)),
    "Q4_1": (("d", 0, 2), ("m", 2, 4), ("qs", 4, 20)),
    "Q5_0": (("d", 0, 2), ("qh", 2, 6), ("qs", 6, 22)),
    "Q5_1": (("d", 0, 2), ("m", 2, 4), ("qh", 4, 8), ("qs", 8, 24)),
    "Q2_K": (("sc", 0, 16), ("qs", 16, 80), ("d", 80, 82), ("m", 82, 84)),
    "Q3_K": (("qh", 0, 32), ("qs", 32, 96), ("sc", 96, 108), ("d", 108, 110)),
    "Q4_K": (("d", 0, 2), ("m", 2, 4), ("sc", 4, 16), ("qs", 16, 144)),
    "Q5_K": (("d", 0, 2), ("m", 2, 4), ("sc", 4, 16), ("qh", 16, 48), ("qs", 48, 176)),
    "Q6_K": (("qs", 0, 128), ("qh", 128, 192), ("sc", 192, 208), ("d", 208, 210)),
    "IQ4_NL": (("d", 0, 2), ("qs", 2, 18)),
}
GPU_TYPES = tuple(FIELDS)
assert GPU_TYPES == gguf_types.GPU_TYPES, "gguf_types.GPU_TYPES names what these kernels read"
# How a plane's bytes are read: fp16 scales, signed 8-bit values (Q8_0) and sub-scales (Q6_K).
_VIEW_DTYPES = {"d": torch.float16, "m": torch.float16}
_SIGNED = {("Q8_0", "qs"), ("Q6_K", "sc")}


def _check(quant: str, rows: torch.Tensor, cols: int) -> int:
    """Blocks per row, or ValueError naming what does not fit."""
    if quant not in FIELDS:
        raise ValueError(f"{quant} has no GPU kernel (GPU types: {', '.join(GPU_TYPES)})")
    f = FORMATS[quant]
    if cols % f.block or rows.dim() != 2 or rows.shape[1] != cols // f.block * f.block_bytes:
        raise ValueError(f"packed {quant} rows of shape {tuple(rows.shape)} do not hold {cols} columns")
    return cols // f.block


def to_planes(rows: torch.Tensor, quant: str, cols: int) -> torch.Tensor:
    """The planes (flat uint8) of packed rows [rows, row bytes] of type `quant`."""
    blocks = _check(quant, rows, cols)
    b = rows.reshape(rows.shape[0], blocks, FORMATS[quant].block_bytes)
    return torch.cat([b[:, :, a:e].reshape(-1) for _, a, e in FIELDS[quant]])


def _plane_slices(quant: str, n: int, cols: int) -> dict[str, tuple[int, int, int]]:
    """Field -> (first byte, end byte, width per row) of each plane of `n` rows."""
    blocks = cols // FORMATS[quant].block
    out, offset = {}, 0
    for name, a, e in FIELDS[quant]:
        width = blocks * (e - a)
        out[name] = (offset, offset + n * width, width)
        offset += n * width
    return out


def from_planes(planes: torch.Tensor, quant: str, cols: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Packed rows [rows, row bytes] (GGUF's layout) from planes: every row (to_planes'
    inverse), or the rows `ids` (an embedding's lookups)."""
    blocks = cols // FORMATS[quant].block
    fields = []
    for plane in _byte_planes(planes, quant, cols).values():
        picked = plane if ids is None else plane.index_select(0, ids)
        fields.append(picked.view(picked.shape[0], blocks, -1))
    return torch.cat(fields, dim=-1).reshape(fields[0].shape[0], -1)


def _byte_planes(planes: torch.Tensor, quant: str, cols: int) -> dict[str, torch.Tensor]:
    """Field -> its plane [rows, width] (uint8 views of `planes`, flat bytes of whole rows)."""
    f = FORMATS[quant]
    n = planes.numel() // (cols // f.block * f.block_bytes)
    flat = planes.reshape(-1)
    return {name: flat[a:e].view(n, width) for name, (a, e, width) in _plane_slices(quant, n, cols).items()}


def plane_views(planes: torch.Tensor, quant: str, cols: int) -> dict[str, torch.Tensor]:
    """Field -> the plane [rows, width] as the kernels read it (fp16 scales, int8 where
    signed, else uint8), views of `planes` (flat uint8 bytes of whole rows)."""
    views = {}
    for name, plane in _byte_planes(planes, quant, cols).items():
        if name in _VIEW_DTYPES:
            plane = plane.view(_VIEW_DTYPES[name])
        elif (quant, name) in _SIGNED:
            plane = plane.view(torch.int8)
        views[name] = plane
    return views


def repack_part(weight: torch.Tensor, part: PackedPart, cols: int) -> torch.Tensor:
    """Lay part `part` of a packed weight out as planes, in place (once: the parameter
    records which parts are, so a table tied to an LM head is repacked once); returns
    the part's bytes (flat uint8, a view of the weight)."""
    rows = part_weight(weight, part, cols)
    flat = rows.reshape(-1)
    done = getattr(weight, "plane_parts", frozenset())
    if part.offset not in done:
        with torch.no_grad():
            flat.copy_(to_planes(rows, part.quant, cols))
        weight.plane_parts = done | {part.offset}
    return flat
