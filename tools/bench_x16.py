"""The x16 product against what runs without it, kernel alone, in one process: per type,
shape and rows of float32 x, min (median) µs over alternated calls of the fallback
(LLMD_GGUF_X16=0: the float32 kernel `gguf_mm` up to gguf_quant.KERNEL_MAX_ROWS rows,
dequantized weight + F.linear above) and of `gguf_mm_x16` in each of `--passes`, on the
ISA `--isa` names ("" : the one the layers get; cpu_quant_x16.cpp). Default shapes:
SmolLM2-135M's (576x576, 1536x576, 576x1536, the 49152x576 LM head).

    python -m llmd_tools.bench_x16 [--threads 2] [--calls 100] [--types Q4_1 Q4_K Q6_K]
        [--shapes 576x576 ...] [--rows 1 4 32] [--passes 1 3] [--isa avx2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=100, help="per figure (a tenth for the largest products)")
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q4_K", "Q6_K"])
    parser.add_argument("--shapes", nargs="+", default=["576x576", "1536x576", "576x1536", "49152x576"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 32])
    parser.add_argument("--passes", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--isa", default="", help="avx512_vnni or avx2 (default: the layers' choice)")
    args = parser.parse_args(argv)

    import torch

    from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
    from llmd.gpu.layers.gguf_quant import FORMATS, KERNEL_MAX_ROWS
    from llmd_tools.gguf_blocks import random_blocks

    torch.set_num_threads(args.threads)
    ops = gguf_ops()
    if ops is None or not ops.x16:
        raise SystemExit("no x16 product here (the CPU kernels cannot be built, or the CPU runs no x16 ISA)")
    print(f"{args.threads} threads, x16 ISAs of this CPU {ops.x16_isas}, timed: {args.isa or 'the layers choice'}; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'type':<5} {'N x K':>10} {'rows':>4} {'fallback':>20} "
          + " ".join(f"{f'x16 {p}p':>20}" for p in args.passes) + "   (min (median) µs)")
    for quant in args.types:
        code, block = FORMATS[quant].code, FORMATS[quant].block
        for shape in args.shapes:
            n, k = map(int, shape.split("x"))
            if k % block:
                continue
            w = random_blocks(quant, n, k, seed=0)
            w16 = ops.repack_x16(w, code, k)
            for rows in args.rows:
                x = torch.randn(rows, k)
                runs: dict[str, Callable[[], Any]] = {}
                if rows <= KERNEL_MAX_ROWS:
                    runs["fallback"] = lambda: ops.mm(x, w, code, k)
                else:
                    runs["fallback"] = lambda: torch.nn.functional.linear(x, ops.dequantize(w, code, k))
                for p in args.passes:
                    runs[f"x16_{p}"] = lambda p=p: ops.mm_x16(x, w16, code, k, p, isa=args.isa)
                calls = args.calls if n * k * max(rows, 4) < 3e7 else max(5, args.calls // 10)
                times: dict[str, list[float]] = {key: [] for key in runs}
                for i in range(calls + 2):
                    for key, run in runs.items():
                        start = time.perf_counter()
                        run()
                        if i >= 2:  # warm-up
                            times[key].append(time.perf_counter() - start)
                cells = [f"{min(t) * 1e6:.1f} ({statistics.median(t) * 1e6:.1f})" for t in times.values()]
                print(f"{quant:<5} {shape:>10} {rows:>4} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end (every tenant)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
