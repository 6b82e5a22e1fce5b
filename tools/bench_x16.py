"""The x16 product against what runs without it, kernel alone, in one process: per type,
shape and rows of float32 x, min (median) µs over alternated calls of the fallback
(LLMD_GGUF_X16=0: the float32 kernel `gguf_mm` up to gguf_quant.KERNEL_MAX_ROWS rows,
dequantized weight + F.linear above) and of `gguf_mm_x16` in each of `--passes`, on the
ISA `--isa` names ("" : the one the layers get; cpu_quant_x16.cpp). Default shapes:
SmolLM2-135M's (576x576, 1536x576, 576x1536, the 49152x576 LM head).

    python -m llmd_tools.bench_x16 [--threads 2] [--calls 100] [--types Q4_1 Q4_K Q6_K]
        [--shapes 576x576 ...] [--rows 1 4 32] [--passes 1 3] [--isa avx2]

`--stream` times instead what a decode step of the 1B fixture (Llama 3.2 1B's shapes in
llama.cpp's Q4_K_M mix: Q4_K, Q6_K for attn_v and every other ffn_down, a Q6_K LM head;
763 MiB, far past any cache) asks of the product: each weight multiplied once a token by
`--rows` rows of x, per ISA of this CPU and pass count, rounds alternated, min ms a token
and the weight bytes a second, beside torch.sum over as many bytes (the memory's own rate,
which on a shared VM moves by 2x over an hour). `--layers` takes fewer layers.

    python -m llmd_tools.bench_x16 --stream [--layers 16] [--rows 1] [--passes 1 2] [--rounds 5]

`--experts E` times a MoE layer's experts instead (E weights of each `--shapes` shape and
`--types` type, `--rows` rows of x each): one gguf_mm_x16 call per expert against one
gguf_mm_x16_grouped call for them all (what cpu_decode_layers' MoeExperts runs), rounds
alternated, min (median) µs a layer.

    python -m llmd_tools.bench_x16 --experts 32 --types Q4_K --shapes 1024x1024 --rows 1 4 --passes 2
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
    parser.add_argument("--rows", nargs="+", type=int, default=None, help="default 1 4 32 (--stream: 1)")
    parser.add_argument("--passes", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--isa", default="", help="avx512_vnni or avx2 (default: the layers' choice)")
    parser.add_argument("--stream", action="store_true", help="the 1B's layer set streamed from memory, every ISA")
    parser.add_argument("--layers", type=int, default=16, help="--stream: decoder layers (the LM head besides)")
    parser.add_argument("--rounds", type=int, default=5, help="--stream: alternated rounds")
    parser.add_argument("--experts", type=int, default=0, help="a MoE layer of this many experts, per call or grouped")
    args = parser.parse_args(argv)
    if args.stream:
        args.rows = args.rows or [1]
        return stream(args)
    if args.experts:
        args.rows = args.rows or [1, 4]
        return experts(args)
    args.rows = args.rows or [1, 4, 32]

    import torch

    from llmd.gpu.layers.gguf_quant import FORMATS, KERNEL_MAX_ROWS
    from llmd_tools.gguf_blocks import random_blocks

    ops = x16_ops(args.threads)
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


def experts(args: argparse.Namespace) -> int:
    import torch

    from llmd.gpu.layers.gguf_quant import FORMATS
    from llmd_tools.gguf_blocks import random_blocks

    ops = x16_ops(args.threads)
    mm = torch.ops.llmd_cpu
    print(f"{args.threads} threads, {args.experts} experts, load average {os.getloadavg()[0]:.2f} at the start")
    for quant in args.types:
        code = FORMATS[quant].code
        for shape in args.shapes:
            n, k = map(int, shape.split("x"))
            ws = [ops.repack_x16_(random_blocks(quant, n, k, seed=e), code, k) for e in range(args.experts)]
            for rows, p in ((r, p) for r in args.rows for p in args.passes):
                x = torch.randn(args.experts * rows, k)
                starts = [e * rows for e in range(args.experts + 1)]
                out = torch.empty(args.experts * rows, n)
                runs = {"per expert": lambda x=x, rows=rows, p=p: [
                            mm.gguf_mm_x16(x[e * rows:(e + 1) * rows], w, code, k, p, args.isa)
                            for e, w in enumerate(ws)],
                        "grouped": lambda x=x, starts=starts, out=out, p=p: mm.gguf_mm_x16_grouped(
                            x, ws, starts, code, k, p, args.isa, out, 0)}
                times: dict[str, list[float]] = {key: [] for key in runs}
                for i in range(args.calls + 2):
                    for key, run in runs.items():
                        start = time.perf_counter()
                        run()
                        if i >= 2:
                            times[key].append(time.perf_counter() - start)
                cells = " ".join(f"{key} {min(t) * 1e6:.1f} ({statistics.median(t) * 1e6:.1f})"
                                 for key, t in times.items())
                print(f"{quant:<5} {shape:>10} x {args.experts} rows {rows} passes {p}: {cells} µs", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end (every tenant)")
    return 0


def x16_ops(threads: int) -> Any:
    """The kernels (cpu_kernels.GGUFOps) with torch at `threads` threads, or exit where this
    CPU runs no x16 product."""
    import torch

    from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops

    torch.set_num_threads(threads)
    ops = gguf_ops()
    if ops is None or not ops.x16:
        raise SystemExit("no x16 product here (the CPU kernels cannot be built, or the CPU runs no x16 ISA)")
    return ops


def stream_shapes(layers: int) -> list[tuple[str, int, int]]:
    """(type, N, K) of the 1B Q4_K_M fixture's products, in a step's order: per layer q, k,
    v, o, gate, up, down (v and down Q6_K in every other layer, as llama.cpp's mix), then
    the tied LM head."""
    shapes = []
    for layer in range(layers):
        mixed = "Q6_K" if layer % 2 == 0 else "Q4_K"
        shapes += [("Q4_K", 2048, 2048), ("Q4_K", 512, 2048), (mixed, 512, 2048), ("Q4_K", 2048, 2048),
                   ("Q4_K", 8192, 2048), ("Q4_K", 8192, 2048), (mixed, 2048, 8192)]
    return shapes + [("Q6_K", 128256, 2048)]


def stream(args: argparse.Namespace) -> int:
    import torch

    from llmd.gpu.layers.gguf_quant import FORMATS
    from llmd_tools.gguf_blocks import random_blocks

    ops = x16_ops(args.threads)
    weights = []
    for i, (quant, n, k) in enumerate(stream_shapes(args.layers)):
        code = FORMATS[quant].code
        weights.append((ops.repack_x16_(random_blocks(quant, n, k, seed=i % 7), code, k), code, k))
    total = sum(w.numel() for w, _, _ in weights)
    plain = torch.ones(total // 4)
    runs: dict[str, Callable[[], Any]] = {"torch.sum": plain.sum}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for _, _, k in weights}
        for isa in ops.x16_isas:
            for p in args.passes:
                runs[f"{isa} {p}p {rows} rows"] = lambda xs=xs, isa=isa, p=p: [
                    ops.mm_x16(xs[k], w, code, k, p, isa=isa) for w, code, k in weights]
    print(f"{args.threads} threads, {total / 2**20:.0f} MiB of weights ({args.layers} layers and the LM head), "
          f"{args.rounds} alternated rounds after one; load average {os.getloadavg()[0]:.2f}")
    times: dict[str, list[float]] = {key: [] for key in runs}
    for i in range(args.rounds + 1):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if i:
                times[key].append(time.perf_counter() - start)
    for key, t in times.items():
        print(f"{key:<24} {min(t) * 1e3:8.1f} ms a token (median {statistics.median(t) * 1e3:.1f})  "
              f"{total / min(t) / 1e9:5.1f} GB/s")
    print(f"load average {os.getloadavg()[0]:.2f} at the end (every tenant)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
