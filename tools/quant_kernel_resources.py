"""What the packed-weight matmul's kernel (llmd.gpu.layers.quant.triton_quant_mm) needs of
a Hopper GPU per tile, found without one: the launch quant_matmul makes for a weight of a
real shape, specialized by Triton's own launcher code as at run time (pointers and the
integers that are multiples of 16 marked divisible by 16, a value of 1 made a constant —
one row of x, a split of one K tile), compiled for sm_90 on this machine (its own ptxas),
then the cubin read with the cuobjdump Triton ships.

    python -m llmd_tools.quant_kernel_resources [--types Q4_K Q8_0 ...] [--rows 1 16]
        [--grid [--pick] | --stages 1 3] [--shape NxK] [--json]

Per (type, tile): registers a thread, stack bytes, the local-memory loads and stores
(LDL / STL) in the machine code, which a kernel that keeps its values in registers has
none of; shared memory; whether the K loop's loads are pipelined (cp.async); and what
those give a decode GEMV on an H200 (132 SMs, 64 K registers, 64 warps, 228 KiB of
shared memory an SM): programs an SM holds at once, and the packed weight bytes in
flight per SM — resident programs x a tile's packed bytes x the stages in flight. A
load that waits for its tile before the next is issued leaves memory idle; an H200
needs ~30 KB in flight per SM to stream at its bandwidth (Little's law: 4.2 TB/s x ~1 us
over 132 SMs). Also the K loop's instructions, which bound the rate whatever the memory
does (an SM issues 4 warp instructions a clock; CLOCK below). `estimate` takes the lower
of the two limits; `--pick` prints each type's best tile of the grid by it. A model, not
a measure: timings need the GPU, tools/bench_quant_sweep.py.

By default the tiles tiles_for picks (the GEMV and tl.dot at BM 16, 32, 64); `--grid`:
bench_quant_sweep's grid at each of those. Compiling without the launcher's
specialization (every integer of unknown divisibility) gave byte-wide loads and 2.5x the
registers: the first default table was chosen from such figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

from llmd.gpu.layers import gguf_types

GPU_TYPES = (*gguf_types.GPU_TYPES, "FP8")
SHAPE = (4096, 4096)  # the weight compiled for: a 7-8B model's attention output projection
# An H200 (sm_90): multiprocessors, and each one's registers, warps, shared memory and
# programs (Hopper tuning guide); registers go to a warp in units of 256.
SMS, SM_REGISTERS, SM_WARPS, SM_SHARED, SM_PROGRAMS = 132, 65536, 64, 228 * 1024, 32
IN_FLIGHT_GOAL = 30_000  # bytes per SM (above)
# An SM issues 4 warp instructions a clock (1.98 GHz), and converts int to float for 16
# lanes a clock (the XU pipe); the H200 copied at 4.16 TB/s (docs/benchmarks.md). A K
# loop of I instructions (C of them conversions) a warp over a tile of B bytes can
# stream at most min(4 B / I, B / 2C) / warps bytes a clock per SM, whatever the memory
# does.
CLOCK, BANDWIDTH = 1.98e9, 4.16e12


def cpu_weight(quant: str, n: int, k: int):
    """A [n, k] weight of `quant` on the CPU, as the loader lays it out (zeros: only its
    strides and alignment reach the compiler)."""
    import torch

    from llmd.gpu.layers.gguf_formats import row_bytes
    from llmd.gpu.layers.quant.cuda_matmul import gguf_quant_weight
    from llmd.gpu.layers.quant.gguf_planes import to_planes
    from llmd.gpu.layers.quant.triton_quant_mm import QuantWeight

    if quant == "FP8":
        return QuantWeight("FP8", n, k, torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, 1), fp8_group=k)
    return gguf_quant_weight(to_planes(torch.zeros(n, row_bytes(quant, k), dtype=torch.uint8), quant, k), quant, k)


def compile_tile(quant: str, tiles, shape: tuple[int, int] = SHAPE, rows: int | None = None):
    """(the kernel quant_matmul launches for `rows` rows of bf16 x — default the tile's
    BM — times a `shape` weight of `quant` with `tiles` on an H200, compiled for sm_90;
    its grid)."""
    import torch

    from llmd.gpu.layers.quant.triton_quant_mm import _quant_mm_kernel, kernel_launch

    n, k = shape
    rows = rows or tiles.bm
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    grid, args, meta, _ = kernel_launch(x, cpu_weight(quant, n, k), torch.empty(rows, n, dtype=x.dtype), None, tiles,
                                        SMS)
    return compile_for_hopper(_quant_mm_kernel, args, meta), grid


def compile_experts_tile(quants: tuple[str, str], experts: int, shape: tuple[int, int], tokens: int, top_k: int,
                         ordered: bool = False):
    """The grouped kernel over packed experts (triton_quant_moe) as a MoE layer of
    `experts` experts of `shape` (hidden, inter) launches it for `tokens` tokens of bf16
    routed to `top_k` each on an H200, for gate (w13 in `quants[0]`) and down (`quants[1]`),
    `ordered`: GPTQ act-order experts (x's columns in an order per part), compiled for
    sm_90: [(part, tiles, kernel, grid)]."""
    import torch

    from llmd.gpu.layers.mlp import ExpertWeights
    from llmd.gpu.layers.moe_align import moe_align_block_size
    from llmd.gpu.layers.quant.cuda_matmul import TritonPackedExperts
    from llmd.gpu.layers.quant.triton_quant_moe import _quant_moe_kernel, experts_launch, moe_tiles

    hidden, inter = shape
    layer = ExpertWeights(experts, hidden, inter, None)
    for name, quant in zip(("w13", "w2"), quants):
        layer.use_packed(quant, name)
        getattr(layer, name).data.zero_()
    if ordered:
        layer.use_input_orders()
        for name in ("w13_order", "w2_order"):
            getattr(layer, name).zero_()
    packed = TritonPackedExperts(layer)
    pairs = tokens * top_k
    ids = torch.arange(pairs).remainder(experts).reshape(tokens, top_k)
    found = []
    for name, part, x, k in (("gate", packed.gate_up[0], torch.zeros(tokens, hidden), top_k),
                             ("down", packed.down, torch.zeros(pairs, inter), 1)):
        tiles = moe_tiles(pairs, experts, part.first.quant)
        out = torch.empty(pairs, part.first.n, dtype=torch.bfloat16)
        grid, args, meta, _ = experts_launch(x.to(torch.bfloat16), part, out,
                                             moe_align_block_size(ids, tiles.bm, experts), k,
                                             torch.ones(pairs) if name == "down" else None, tiles, None, SMS)
        found.append((name, tiles, compile_for_hopper(_quant_moe_kernel, args, meta), grid))
    return found


def compile_for_hopper(fn, args: tuple, meta: dict):
    """A Triton kernel compiled for sm_90 from CPU arguments, specialized as its launcher
    specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def resources(kernel) -> dict[str, int]:
    """Registers, stack bytes, local loads / stores, shared memory bytes and cp.async
    instructions of a compiled kernel."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "local_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "shared": int(kernel.metadata.shared),
            "async_loads": len(re.findall(r"\bLDGSTS\b", sass)),
            **loop_body(sass)}


def loop_body(sass: str) -> dict[str, int]:
    """The K loop's machine code: the instructions from the target of the widest
    backward branch to it, and of those the int-to-float conversions (I2F / I2FP: a
    quarter-rate pipe on Hopper)."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = [(target, at) for at, text in code
             for target in [int(m.group(1), 16) for m in [re.search(r"\bBRA\s+0x([0-9a-f]+)", text)] if m]
             if target < at]
    if not spans:
        return {"loop_instructions": 0, "loop_conversions": 0}
    first, last = max(spans, key=lambda span: span[1] - span[0])
    body = [text for at, text in code if first <= at <= last]
    return {"loop_instructions": len(body), "loop_conversions": sum(bool(re.search(r"\bI2FP?\b", t)) for t in body)}


def tile_bytes(quant: str, tiles) -> int:
    """Packed weight bytes one K step of a tile reads (values, high bits and scales)."""
    from llmd.gpu.layers.gguf_formats import row_bytes

    if quant == "FP8":  # a byte a value, a float32 scale at most every 16 columns
        return tiles.bn * (tiles.bk + tiles.bk // 4)
    return tiles.bn * row_bytes(quant, 256) * tiles.bk // 256  # every block size divides 256


def occupancy(found: dict, tiles, grid: tuple[int, int, int], k: int, quant: str) -> dict[str, float]:
    """Programs an SM holds at once, the weight bytes in flight per SM they keep, and the
    fraction of the H200's bandwidth its K loop's instructions can issue for."""
    per_warp = -(-found["registers"] * 32 // 256) * 256
    resident = min(SM_PROGRAMS, SM_WARPS // tiles.warps, SM_REGISTERS // (per_warp * tiles.warps),
                   SM_SHARED // (found["shared"] + 1024))
    programs = grid[0] * grid[1] * grid[2]
    k_tiles = -(-k // tiles.bk)
    per_split = -(-k_tiles // grid[2])  # K tiles a program runs
    ahead = min(tiles.stages, per_split) if found["async_loads"] else 1
    per_sm = min(programs, SMS * resident) / SMS
    per_clock = 4 * tile_bytes(quant, tiles) / max(1, found["loop_instructions"] * tiles.warps)
    if found["loop_conversions"]:  # 16 lanes a clock per SM: half a warp instruction
        per_clock = min(per_clock, 0.5 * tile_bytes(quant, tiles) / (found["loop_conversions"] * tiles.warps))
    issue = per_clock * SMS * CLOCK
    return {"programs_per_sm": resident, "in_flight": int(per_sm * tile_bytes(quant, tiles) * ahead),
            "issue_ceiling": round(issue / BANDWIDTH, 3)}


def tiles_to_check(grid: bool, quant: str, rows: tuple[int, ...] = (1, 16, 32, 64),
                   stages: tuple[int, ...] = ()) -> list:
    """The default tiles for each number of rows (each at every one of `stages`, if
    given), or bench_quant_sweep's grid for each."""
    from llmd.gpu.layers.quant.quant_tiles import tiles_for

    if not grid:
        defaults = [tiles_for(r, quant) for r in rows]
        return [dataclasses.replace(t, stages=s) for t in defaults for s in stages] if stages else defaults
    from llmd_tools.bench_quant_sweep import grid as sweep_grid

    return [tiles for r in rows for tiles in sweep_grid(r, quant)]


def measure(quant: str, tiles, shape: tuple[int, int] = SHAPE) -> dict:
    """One (type, tile)'s row: its resources and what they give on an H200."""
    kernel, grid = compile_tile(quant, tiles, shape)
    found = resources(kernel)
    return {"type": quant, "bm": tiles.bm, "bn": tiles.bn, "bk": tiles.bk, "warps": tiles.warps,
            "stages": tiles.stages, "scale_words": tiles.scale_words, "split": grid[2], **found,
            **occupancy(found, tiles, grid, shape[1], quant)}


def estimate(row: dict) -> float:
    """A tile's expected fraction of the bandwidth: the lower of what its bytes in flight
    and its K loop's issue allow (0 where it spills) — the rank `--pick` orders by."""
    if row["local_ops"]:
        return 0.0
    return min(1.0, row["in_flight"] / IN_FLIGHT_GOAL) * min(1.0, row["issue_ceiling"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(GPU_TYPES))
    parser.add_argument("--grid", action="store_true", help="a grid of tiles instead of the defaults")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 32, 64], help="rows of x (1: the GEMV)")
    parser.add_argument("--stages", nargs="+", type=int, default=[], help="the default tiles at these stages")
    parser.add_argument("--shape", default="x".join(map(str, SHAPE)), help="the weight's N x K")
    parser.add_argument("--pick", action="store_true", help="after the rows, each type's best tile by the estimate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while it is unset
    import triton

    shape = tuple(int(v) for v in args.shape.split("x"))
    print(f"quant_kernel_resources: Triton {triton.__version__}, sm_90, a {shape[0]} x {shape[1]} weight", flush=True)
    rows = []
    for quant in args.types:
        for tiles in tiles_to_check(args.grid, quant, tuple(args.rows), tuple(args.stages)):
            row = measure(quant, tiles, shape)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            mark = ("  spills" if row["local_ops"] else "") + ("  scale words" if tiles.scale_words else "")
            print(f"{quant:6} {'dot ' if tiles.dot else 'GEMV'} BM {tiles.bm:>2} BN {tiles.bn:>2} BK {tiles.bk:>4} "
                  f"warps {tiles.warps} stages {tiles.stages} split {row['split']:>2}: {row['registers']:>3} "
                  f"registers, {row['local_ops']:>3} LDL/STL, shared {row['shared']:>6} B, "
                  f"{'cp.async' if row['async_loads'] else 'ld     '}, {row['programs_per_sm']:>2} programs/SM, "
                  f"{row['in_flight'] / 1024:5.1f} KiB in flight/SM, K loop {row['loop_instructions']} "
                  f"instructions ({row['loop_conversions']} I2F): issue ceiling {100 * row['issue_ceiling']:.0f}% of "
                  f"the bandwidth{mark}", flush=True)
    for key in sorted({(r["type"], r["bm"]) for r in rows}) if args.pick else ():
        best = max((r for r in rows if (r["type"], r["bm"]) == key), key=estimate)
        print(f"pick {key[0]:6} BM {key[1]:>2}: BN {best['bn']} BK {best['bk']} warps {best['warps']} stages "
              f"{best['stages']} (estimate {100 * estimate(best):.0f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
