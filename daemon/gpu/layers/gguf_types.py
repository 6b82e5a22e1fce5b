"""Which GGUF tensor types llmd keeps packed on each device, which it holds as another
packed type there, which the gguf package can dequantize (the others are refused at
load), and what a tensor then takes in memory: names and sizes only, no torch, so that
the model pool's estimate (llmd.pool.estimate), which runs in the daemon before any
model loads, counts a GGUF's weights as the loader will hold them.

The types' layouts and kernels live elsewhere (gguf_formats: the CPU kernels' table and
the re-encodings; quant/gguf_planes: the CUDA kernels' planes); each of those modules
checks at import that its type list is the one named here.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# What the CPU kernels read (gguf_formats.FORMATS) and the CUDA ones (gguf_planes.FIELDS).
CPU_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
GPU_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
# GGUF types a model keeps as they are (dense, at the run dtype): everything else runs
# packed or is refused.
DENSE_TYPES = ("F32", "F16", "BF16")
# GGUF types a weight is held in as another packed type where the device's kernels lack
# it, re-encoded at load (gguf_formats.reencoded): IQ4_XS, on every device, as IQ4_NL
# blocks (gguf_formats' doc: the one rounding of each sub-block's scale to fp16).
HELD_AS = {"IQ4_XS": "IQ4_NL"}
# A dense GGUF type as HF names a checkpoint's dtype (config.dtype).
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def kernel_types(device_type: str) -> tuple[str, ...]:
    """The packed types the kernels of a device read."""
    return GPU_TYPES if device_type == "cuda" else CPU_TYPES


def held_type(quant: str, kernel_types: Collection[str] = CPU_TYPES) -> str:
    """The packed type a GGUF weight of type `quant` is held in where the kernels read
    `kernel_types`: itself, or HELD_AS' (followed on) where they lack it."""
    while quant not in kernel_types and quant in HELD_AS:
        quant = HELD_AS[quant]
    return quant


def matrices_dtype(tensors: Iterable) -> str | None:
    """The dtype of a GGUF whose matrices (its tensors of two or more dimensions; the
    norms are vectors, F32 in llama.cpp's files) are all of one dense type, as HF names a
    checkpoint's (`config.dtype`), beside F32 ones (llama.cpp's converter keeps a mixture
    of experts' routers F32 in a BF16 file): "bfloat16" for a BF16 file, which `--dtype
    auto` then runs in bfloat16 on CPU as it does such an HF checkpoint, its weights as the
    file holds them (loader.resolve_dtype; float32 would double them); None where a matrix
    is packed or two 16-bit types meet. `tensors`: the file's tensor records
    (gguf_file.GGUFTensorInfo)."""
    types = {t.tensor_type.name for t in tensors if len(t.shape) >= 2}
    halves = types - {"F32"}
    if not types or not types <= set(_FLOAT_DTYPES) or len(halves) > 1:
        return None
    return _FLOAT_DTYPES[halves.pop() if halves else "F32"]


# Values of an F16 tensor checked at a time (2 MiB)
_F16_CHUNK = 1 << 20


def file_dtype(g: Any) -> str | None:
    """matrices_dtype of a GGUF file (gguf_file.GGUFFile), an F16 file's "bfloat16" where
    every F16 value is a bfloat16 value too, as in a checkpoint released in bf16 (most
    are) and converted to F16 (llama.cpp's converter, `--outtype f16`): bf16's 8
    significant bits fit in f16's 11 over f16's normal range, and below it (|w| < 2^-14)
    f16's steps of 2^-24 are bf16 values themselves (the conversion rounds |w| < 2^-17 to
    them). Such a file then runs in bfloat16 under `--dtype auto` on CPU, every weight
    exactly the file's (float32 would double the weights); any other F16 file stays
    float16 (float32 on CPU). A file of other values fails at its first values; a
    bf16-valued one is read whole (~0.4 s for 2.4 GB in the page cache), its pages
    dropped after (gguf_file.drop_pages)."""
    dtype = matrices_dtype(g.tensors.values())
    if dtype != "float16":
        return dtype
    if g not in _BF16_FILES:  # once per opened file (its config is read more than once)
        _BF16_FILES[g] = all(_holds_bfloat16(g, t) for t in g.tensors.values() if t.tensor_type.name == "F16")
    return "bfloat16" if _BF16_FILES[g] else dtype


# file_dtype's verdict on each opened F16 file, kept while the file is (not its map)
_BF16_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _holds_bfloat16(g: Any, t: Any) -> bool:
    values = g.tensor_data(t).reshape(-1).view(np.uint16)
    try:
        return all(f16_bits_fit_bfloat16(values[i:i + _F16_CHUNK]) for i in range(0, values.size, _F16_CHUNK))
    finally:
        g.drop_pages(t)


def f16_bits_fit_bfloat16(bits: np.ndarray) -> bool:
    """Whether every float16 (given as its uint16 bits) is exactly a bfloat16: a normal
    one (or inf) with its 3 lowest mantissa bits clear; a subnormal one, m * 2^-24, with
    m of at most 8 significant bits. A NaN with payload bits there is not."""
    low = bits[(bits & 7) != 0]
    if not low.size:
        return True
    m = low & 0x3FF
    return bool(np.all(((low & 0x7C00) == 0) & ((m < 256) | ((m < 512) & (m & 1 == 0)) | (m & 3 == 0))))


def supported_tensor_types() -> list[str]:
    """Names of the GGML tensor types the installed gguf package can dequantize."""
    return [t.name for t in dequantizable_types()]


@functools.cache
def dequantizable_types() -> tuple[GGMLQuantizationType, ...]:
    """The GGML types the installed gguf package can dequantize: each tried on one block
    of zeros, the package's NotImplementedError saying it cannot (an IQ type in an older
    release, a type newer than its quants module)."""
    from gguf.quants import dequantize

    ok = []
    for qtype in GGMLQuantizationType:
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:  # one block of zeros
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        ok.append(qtype)
    return tuple(ok)


def held_block(quant: str, device_type: str) -> int:
    """The weights a block holds of a tensor of packed type `quant` as a device holds it
    (ValueError for a type gguf does not know)."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[held_type(quant, kernel_types(device_type))]][0]
    except KeyError:
        raise ValueError(f"GGUF type {quant!r} is unknown") from None


def held_bytes(quant: str, elements: int, device_type: str) -> int:
    """Bytes of a packed tensor of type `quant` and `elements` weights as a device holds
    it: its own blocks, or those of the type it is held as (ValueError for a type that
    gguf does not know; a type no kernel reads is refused at load, and counted here at its
    own size)."""
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[held_type(quant, kernel_types(device_type))]]
    except KeyError:
        raise ValueError(f"GGUF type {quant!r} is unknown") from None
    return elements // block * block_bytes


# What the CPU keeps packed, CUDA keeps packed too (as itself, or as HELD_AS' type): the
# loader's plan refuses no CPU-packed type on CUDA.
assert all(held_type(q, GPU_TYPES) in GPU_TYPES for q in CPU_TYPES + tuple(HELD_AS)), "a packed type CUDA cannot hold"
