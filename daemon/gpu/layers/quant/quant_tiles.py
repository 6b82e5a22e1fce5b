"""Which tile and how many K splits the packed-weight matmul
(quant/triton_quant_mm.py) launches with, by the rows of x and the weight's type: the
tile's shape, warps and pipeline stages, chosen offline from what each compiles to for
Hopper (tools/quant_kernel_resources.py), and split-K from the device's multiprocessors.
Shapes alone decide: nothing is read back from the device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GEMV_MAX_ROWS = 1  # rows of x up to which the GEMV runs (above: the tl.dot GEMM)
# A split-K launch aims at this many programs per SM: programs an SM holds at once keep
# its weight bytes in flight (each its tile, or its next STAGES - 1 tiles where the K loop
# is pipelined), and an H200 needs ~30 KB in flight per SM to stream at its bandwidth
# (4.2 TB/s x ~1 us over 132 SMs). At 2 programs per SM (2-4 KB each) the H200 measured
# 2-8 % of the roofline; 16 is Little's law's figure, not yet measured (bench_quant_sweep).
SPLIT_K_WAVES = 16


@dataclass(frozen=True)
class Tiles:
    """A launch's tile: rows of x, rows of the weight, columns; GEMV (bm 1) or tl.dot;
    the warps of a program; `stages` K tiles in flight (Triton's software pipeline over
    the K loop: the loads of the next stages - 1 tiles go to shared memory by cp.async
    while this one is multiplied; 1: each tile loaded, then used). BK must hold a whole
    number of every type's value pairs (2 PAIR <= 128: a multiple of 128) and of FP8's
    groups of 16. `scale_words` (BK 128): Q4_K / Q5_K's scale fields loaded once a tile
    as words by cp.async instead of gathered per group (quant_values._tile_scales: fewer
    synchronous loads, more registers; off by default until a GPU's sweep says)."""

    bm: int
    bn: int
    bk: int
    dot: bool
    warps: int = 4
    stages: int = 1
    scale_words: bool = False

    def __post_init__(self) -> None:
        if (self.bk % 128 or (self.dot and self.bm < 16) or (not self.dot and self.bm != 1)
                or not 1 <= self.stages <= 6 or (self.scale_words and self.bk != 128)):
            raise ValueError(f"no such tile: {self}")


# The default tiles, chosen offline (tools/quant_kernel_resources.py --grid --pick:
# Triton 3.9's ptxas for sm_90, a 4096 x 4096 weight's launch as the launcher specializes
# it, 2026-11-30): no spill, and of those the best estimate — the lower of what the bytes
# in flight per SM and the K loop's instruction issue allow. The GEMV's defaults estimate
# 27-100 % of the H200's bandwidth by type (Q4_K 38, Q4_0 64), the tiles before 3-19 %
# in all but Q8_0; tl.dot at 16 rows 18-100 %. Q2_K's GEMV 14 %, Q3_K's 15 %: at 2.6 and
# 3.4 bits a weight the loop gets more weights a byte (two thirds, a half of Q4_K's
# weights a second).
# Speed on a GPU: not yet measured (bench_quant_sweep). Each (BN, BK, warps, stages):
GEMV_TILES = {"Q4_0": (16, 256, 4, 3), "Q4_1": (16, 256, 4, 3), "IQ4_NL": (16, 256, 4, 3), "Q2_K": (16, 256, 4, 3),
              "Q3_K": (16, 256, 4, 3)}
GEMV_DEFAULT = (32, 128, 4, 3)
DOT_16_ROWS = (32, 128, 4, 3)
DOT_TILES = {"Q5_0": (32, 32), "IQ4_NL": (64, 32), "Q4_K": (32, 16), "Q5_K": (32, 16), "Q2_K": (64, 32),
             "Q3_K": (64, 32)}  # BN at BM 32, 64
DOT_DEFAULT = (32, 32)  # (BK 128, 8 warps, 3 stages)


def tiles_for(rows: int, quant: str | None = None) -> Tiles:
    """The tile for `rows` rows of x times a weight of type `quant` (the tables above)."""
    if rows <= GEMV_MAX_ROWS:
        bn, bk, warps, stages = GEMV_TILES.get(quant, GEMV_DEFAULT)
        return Tiles(1, bn, bk, False, warps, stages)
    if rows <= 16:
        bn, bk, warps, stages = DOT_16_ROWS
        return Tiles(16, bn, bk, True, warps, stages)
    wide = rows > 32
    return Tiles(64 if wide else 32, DOT_TILES.get(quant, DOT_DEFAULT)[wide], 128, True, 8, 3)


def split_count(programs: int, k_tiles: int, sm_count: int) -> int:
    """Splits of K for a launch of `programs` tiles (module doc): enough to give every SM
    SPLIT_K_WAVES programs, at most one split per K tile; 1 without an SM count."""
    if sm_count <= 0 or programs >= sm_count * SPLIT_K_WAVES:
        return 1
    return max(1, min(k_tiles, sm_count * SPLIT_K_WAVES // programs))


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (0 elsewhere: the interpreter takes no split)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
