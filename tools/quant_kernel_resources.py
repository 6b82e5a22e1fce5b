"""What the packed-weight matmul's kernel (llmd.gpu.layers.quant.triton_quant_mm) needs of
a Hopper GPU per tile, found without one: each (type, tile) compiled by Triton for sm_90
on this machine (its own ptxas), then the cubin read with the cuobjdump Triton ships —
registers per thread, stack bytes, and the local-memory loads and stores (LDL / STL) in
the machine code, which a kernel that keeps its values in registers has none of.

    python -m llmd_tools.quant_kernel_resources [--types Q4_K Q8_0 ...] [--grid] [--json]

By default the tiles tiles_for picks (the GEMV and tl.dot at BM 16, 32, 64); `--grid`:
bench_quant_sweep's grid at each of those (BN x BK x warps). A tile that spills moves
values through local memory every K step; with Triton 3.9 the first default tiles did,
by hundreds of instructions in most types, which is how the defaults were chosen
(triton_quant_mm's table). Registers also bound how
many programs an SM holds, and so the weight bytes in flight. Timings need the GPU:
tools/bench_quant_sweep.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

GPU_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "FP8")


def compile_tile(quant: str, tiles, x_dtype: str = "bf16"):
    """The kernel for `quant` and `tiles` compiled for sm_90 (no GPU needed), writing
    float32 partial sums (a split-K launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmd.gpu.layers.quant import triton_quant_mm as mm

    layout = mm.LAYOUTS[quant]
    fn = mm._quant_mm_kernel
    signature = dict.fromkeys(fn.arg_names, "i32")
    signature.update(X=f"*{x_dtype}", OUT="*fp32", QS="*u8", QH="*u8", SC="*u8", MN="*fp16",
                     D="*fp32" if quant == "FP8" else "*fp16")
    constants = dict(QUANT=layout.code, NIBBLES=layout.nibbles, PAIR=layout.pair, ZERO=layout.zero, GP=layout.gp,
                     BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, H=tiles.bk // 2 if layout.nibbles else tiles.bk,
                     DOT=tiles.dot, IEEE=False, DOT_F32=False, PARTIAL=True)
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tiles.warps})


def resources(kernel) -> dict[str, int]:
    """Registers, stack bytes and local loads / stores of a compiled kernel's cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "local_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass))}


def tiles_to_check(grid: bool, quant: str) -> list:
    """The default tiles for 1, 16, 32 and 64 rows, or bench_quant_sweep's grid for each."""
    from llmd.gpu.layers.quant.triton_quant_mm import tiles_for

    if not grid:
        return [tiles_for(rows, quant) for rows in (1, 16, 32, 64)]
    from llmd_tools.bench_quant_sweep import grid as sweep_grid

    return [tiles for rows in (1, 16, 32, 64) for tiles in sweep_grid(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(GPU_TYPES))
    parser.add_argument("--grid", action="store_true", help="a grid of tiles instead of the defaults")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while it is unset
    import triton

    print(f"quant_kernel_resources: Triton {triton.__version__}, sm_90", flush=True)
    for quant in args.types:
        for tiles in tiles_to_check(args.grid, quant):
            row = {"type": quant, "bm": tiles.bm, "bn": tiles.bn, "bk": tiles.bk, "warps": tiles.warps,
                   **resources(compile_tile(quant, tiles))}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                mark = "" if row["local_ops"] == 0 else "  spills"
                print(f"{quant:6} {'GEMV' if not tiles.dot else 'dot ':4} BM {tiles.bm:>2} BN {tiles.bn:>2} "
                      f"BK {tiles.bk} warps {tiles.warps}: {row['registers']:>3} registers, stack "
                      f"{row['stack']:>3} B, {row['local_ops']:>3} LDL/STL{mark}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
