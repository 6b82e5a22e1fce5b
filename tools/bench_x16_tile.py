"""The AVX2 x16 product's tile alone, built in seconds: `group_tile` of
daemon/gpu/layers/cpu/cpu_quant_x16_avx2_tiles.h compiled in one C++ file
(tools/bench_x16_tile.cpp) for the types and passes asked, single-threaded, its weights in
cache — the product's arithmetic without the kernels' build (minutes), the threads or the
memory. Per (type, passes): the fastest of `--reps` sweeps over `--groups` 16-row weight
groups of `--k` columns against `--rows` rows of x (tiles of 4 rows, the rest one by
one), in ms, GMAC/s and MACs per cycle at `--ghz`; then how many of the integer ops the
tile is made of issue per cycle (vpmaddubsw, vpaddw, vpmaddwd, eight independent chains
each; and vpmaddubsw + vpaddw pairs): what the tile's instruction count is to be set
against. `--headers DIR`: modified copies of the product's headers, found before the
package's, to A/B a change (run once with, once without).

    python -m llmd_tools.bench_x16_tile [--types Q4_K Q6_K Q8_0] [--passes 1 2] [--k 2048]
        [--groups 64] [--rows 32] [--reps 300] [--ghz 2.45] [--headers DIR]

docs/benchmarks.md, "The AVX2 product's multi-row tile against the issue rate".
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("bench_x16_tile.cpp")


def kernel_dir() -> Path:
    """The package's C++ kernel sources (the product's headers)."""
    import llmd.gpu.layers.cpu as cpu

    return Path(cpu.__file__).parent


def build(types: list[str], passes: list[int], headers: Path | None, out: Path) -> Path:
    """The harness for each (type, passes) in types x passes, compiled into `out`."""
    from torch.utils.cpp_extension import include_paths

    from llmd.gpu.layers.gguf_formats import FORMATS

    unknown = [t for t in types if t not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown type(s) {', '.join(unknown)}; the product's: {', '.join(FORMATS)}")
    bad = [p for p in passes if p not in (1, 2, 3)]
    if bad:
        raise SystemExit(f"passes must be 1, 2 or 3, got {bad}")
    cases = " ".join(f'TILE("{t}", {FORMATS[t].code}, {p})' for t in types for p in passes)
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise SystemExit(f"no C++ compiler ({cxx})")
    includes = ([headers] if headers is not None else []) + [kernel_dir()] + [Path(p) for p in include_paths()]
    binary = out / "bench_x16_tile"
    cmd = [cxx, "-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2",
           f"-DLLMD_TILE_CASES={cases}", *(f"-I{p}" for p in includes), str(SOURCE), "-o", str(binary)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the harness did not compile:\n{done.stderr[:4000]}")  # the first errors
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--passes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--k", type=int, default=2048, help="columns (a multiple of 256)")
    parser.add_argument("--groups", type=int, default=64, help="16-row weight groups per sweep")
    parser.add_argument("--rows", type=int, default=32, help="rows of x")
    parser.add_argument("--reps", type=int, default=300, help="sweeps timed (the fastest is kept)")
    parser.add_argument("--ghz", type=float, default=2.45, help="the clock the per-cycle figures assume")
    parser.add_argument("--issue-iterations", type=int, default=50_000_000, help="0: no issue rates")
    parser.add_argument("--headers", type=Path, help="a folder of modified product headers, found first")
    args = parser.parse_args(argv)
    if args.k <= 0 or args.k % 256:
        raise SystemExit(f"--k must be a positive multiple of 256, got {args.k}")
    from llmd.gpu.layers.cpu.cpu_info import cpuinfo_field

    if not {"avx2", "fma", "f16c"} <= set(cpuinfo_field("flags").split()):
        raise SystemExit("this CPU lacks AVX2, FMA or F16C: the AVX2 product does not run here")
    with tempfile.TemporaryDirectory(prefix="llmd-x16-tile-") as tmp:
        binary = build(args.types, args.passes, args.headers, Path(tmp))
        done = subprocess.run([str(binary), str(args.k), str(args.groups), str(args.rows), str(args.reps),
                               str(args.ghz), str(args.issue_iterations)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the harness failed ({done.returncode}): {done.stderr[-2000:]}")
    print(f"single thread, x16 tile of the AVX2 product; per-cycle figures at {args.ghz} GHz"
          + (f"; headers from {args.headers}" if args.headers else ""))
    print(f"{'type':<6} {'passes':>6} {'N x K':>11} {'rows':>4} {'ms':>8} {'GMAC/s':>7} {'MAC/cycle':>9}")
    for line in done.stdout.splitlines():
        kind, *fields = line.split()
        if kind == "tile":
            name, passes, n, k, rows, ms, gmacs, per_cycle = fields
            print(f"{name:<6} {passes:>6} {n + 'x' + k:>11} {rows:>4} {float(ms):>8.3f} {float(gmacs):>7.1f} "
                  f"{float(per_cycle):>9.2f}")
        elif kind == "issue":
            print(f"issue rate, {fields[0]}: {float(fields[1]):.2f} per cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
