"""CUDA only: which tile and split-K the packed-weight matmul
(llmd.gpu.layers.quant.triton_quant_mm) should take, timed over a grid in one run — for a
lent GPU session, where each call costs minutes of a 15-minute lease.

    python -m llmd_tools.bench_quant_sweep [--types Q4_K Q8_0] [--rows 1 16]
        [--shapes 14336x4096 4096x4096] [--top 5] [--budget-s 170] [--json]

For each type, shape and number of rows it times every tile of the grid (one row: the
GEMV's BN x BK x warps x stages; more: the tl.dot tile's BM x BN x BK x warps x stages)
at every split of K that leaves each split a K tile, each checked first against x times
the dequantized weight (a wrong one is dropped, and said), and prints the `--top`
fastest beside the default choice (tiles_for and split_count), each as a fraction of
the roofline of the packed bytes over the measured copy bandwidth. Timing as
bench_quant_gpu's (the calls over weight copies taken in turn past the L2 cache, replayed
from a CUDA graph: eager launches time the host), with shorter runs: a grid holds a
hundred points or more, and each tile compiles once per kind of split (one K tile a
split, a multiple of 16, other).
Q4_K and Q5_K also time each BK 128 tile with its scale fields loaded a tile at a time
(Tiles.scale_words, off by default: fewer synchronous loads, more registers).
The default tile goes first, then the pipelined tiles (stages 3: what the offline
estimate ranks first, tools/quant_kernel_resources.py), and no tile starts after
`--budget-s` seconds, so that a device call ends in its time with what it has.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import torch

from llmd.gpu.layers.quant.quant_tiles import GEMV_MAX_ROWS, Tiles, sm_count, split_count, tiles_for
from llmd_tools.bench_quant_gpu import _rotating, _weights, copy_bandwidth, graph_us

GEMV_GRID = {"stages": (3, 1), "bn": (8, 16, 32), "bk": (128, 256, 512), "warps": (4, 8)}
DOT_GRID = {"stages": (3, 1), "bn": (16, 32, 64), "bk": (128, 256), "warps": (4, 8)}
SPLITS = (1, 2, 4, 8, 16, 32)
SCALE_WORDS_TYPES = ("Q4_K", "Q5_K")


def grid(rows: int, quant: str = "") -> list:
    """Every tile of the grid for `rows` rows of x; for Q4_K / Q5_K each BK 128 tile also
    with its scale fields loaded a tile at a time (Tiles.scale_words)."""
    if rows <= GEMV_MAX_ROWS:
        tiles = [Tiles(1, bn, bk, False, w, st) for st, bn, bk, w in itertools.product(*GEMV_GRID.values())]
    else:
        bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
        tiles = [Tiles(bm, bn, bk, True, w, st) for st, bn, bk, w in itertools.product(*DOT_GRID.values())]
    if quant in SCALE_WORDS_TYPES:
        tiles += [dataclasses.replace(t, scale_words=True) for t in tiles if t.bk == 128]
    return tiles


def sweep(quant: str, n: int, k: int, rows: int, copies: int, bandwidth: float, device: torch.device,
          deadline: float = float("inf")) -> list[dict]:
    """Every (tile, split) point's time, the default tile's first, none started past
    `deadline` (time.monotonic()); the default's marked `default`."""
    from triton.testing import do_bench

    from llmd.gpu.layers.quant.triton_quant_mm import quant_matmul

    weights, dense, packed_bytes = _weights(quant, n, k, copies, device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    ref = x.float() @ dense.T
    floor_us = (packed_bytes + 2 * rows * (k + n)) / bandwidth * 1e6
    default = tiles_for(rows, quant)
    default_split = split_count(-(-rows // default.bm) * -(-n // default.bn), -(-k // default.bk), sm_count(device))
    points = []
    for tiles in [default] + [t for t in grid(rows, quant) if t != default]:
        if time.monotonic() > deadline:
            break
        k_tiles = -(-k // tiles.bk)
        for split in (s for s in SPLITS if s <= k_tiles):
            point = {"type": quant, "n": n, "k": k, "rows": rows, "tiles": [tiles.bm, tiles.bn, tiles.bk],
                     "warps": tiles.warps, "stages": tiles.stages, "scale_words": tiles.scale_words, "split": split,
                     "default": tiles == default and split == default_split}
            try:
                out = quant_matmul(x, weights[0], split_k=split, tiles=tiles)
                err = ((out.float() - ref).norm() / ref.norm()).item()
            except Exception as exc:  # a tile the compiler refuses is a result, not the end of the sweep
                points.append({**point, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            if not err <= 2e-2:
                points.append({**point, "error": f"wrong: relative error {err:.1e}"})
                continue
            calls = [lambda w=w: quant_matmul(x, w, split_k=split, tiles=tiles) for w in weights]
            us = graph_us(calls, warmup=10, rep=40) or do_bench(_rotating(calls), warmup=10, rep=40,
                                                                 return_mode="median") * 1e3
            points.append({**point, "us": us, "of_roofline": floor_us / us})
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q8_0"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x4096"])
    parser.add_argument("--copies", type=int, default=8, help="weights taken in turn (past the L2 cache)")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no tile after this many seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    if not torch.cuda.is_available():
        print("bench_quant_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"bench_quant_sweep: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          "bf16 activations", flush=True)
    runs = list(itertools.product(args.shapes, args.types, args.rows))
    for i, (shape, quant, rows) in enumerate(runs):
        n, k = (int(v) for v in shape.split("x"))
        share = max(0.0, deadline - time.monotonic()) / (len(runs) - i)  # what one left unused goes on
        points = sweep(quant, n, k, rows, args.copies, bandwidth, device, time.monotonic() + share)
        if args.json:
            for p in points:
                print(json.dumps(p), flush=True)
        timed = sorted((p for p in points if "us" in p), key=lambda p: p["us"])
        shown = timed[:args.top] + [p for p in timed[args.top:] if p["default"]]
        reached = len({(tuple(p["tiles"]), p["warps"], p["stages"], p["scale_words"]) for p in points})
        total = len({*grid(rows, quant), tiles_for(rows, quant)})
        print(f"-- {quant} {n}x{k}, {rows} rows: {reached} of {total} tiles (the budget), "
              f"{len(timed)} points timed, {len(points) - len(timed)} dropped")
        for p in shown:
            bm, bn, bk = p["tiles"]
            mark = ("  scale words" if p["scale_words"] else "") + ("  (default)" if p["default"] else "")
            print(f"   BM {bm:>2} BN {bn:>3} BK {bk:>3} warps {p['warps']} stages {p['stages']} split {p['split']:>2}: "
                  f"{p['us']:8.1f} us  {100 * p['of_roofline']:5.1f}% of roofline{mark}")
        for p in [p for p in points if "error" in p][:3]:  # the first few: a refused tile repeats per split
            print(f"   dropped {p['tiles']} warps {p['warps']} stages {p['stages']} split {p['split']}: {p['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
