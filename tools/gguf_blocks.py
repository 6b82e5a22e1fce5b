"""Valid GGUF blocks of random bytes, for tests and kernel benchmarks: every packed type
(gguf_formats.FORMATS), the K-quants included (the gguf package cannot quantize those)."""
from __future__ import annotations

import numpy as np
import torch

from llmd.gpu.layers.gguf_quant import FORMATS

# Byte offsets of each type's fp16 scales (d, and dmin / m where the type has one):
# ggml-common.h's block structs.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                 "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,)}
# fp16 scales at the edges: the largest finite, the smallest subnormal, zero, a negative.
EXTREME_SCALES = (65504.0, 2.0 ** -24, 0.0, -1.5)


def random_blocks(quant: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01,
                  extremes: bool = False) -> torch.Tensor:
    """Valid packed rows [rows, row bytes] of `quant`: random bytes (every bit pattern of
    the quantized values and sub-scales is a valid block) with random finite fp16
    scales of about `scale`; `extremes`: the first rows' scales EXTREME_SCALES instead,
    one value per row, every scale field of the row."""
    f = FORMATS[quant]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // f.block, f.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[quant]:
        d = (rng.standard_normal((rows, cols // f.block)) * scale).astype(np.float16)
        if extremes:
            d[:len(EXTREME_SCALES)] = np.array(EXTREME_SCALES, dtype=np.float16)[:, None]
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))
