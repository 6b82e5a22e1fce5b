"""CUDA only: packed-weight matmuls (llmd.gpu.layers.quant.triton_quant_mm) at decode
batch sizes, each as a fraction of its roofline — the packed bytes it must read (the
weight's planes, which are the file's bytes, plus x and the output) over the device's
measured copy bandwidth — beside a bf16 dense F.linear of the same shape and its own
roofline (2 bytes a weight).

    python -m llmd_tools.bench_quant_gpu [--types Q4_0 Q4_K Q6_K Q8_0 FP8] [--rows 1 4 16]
        [--shapes 4096x4096 14336x4096 4096x14336] [--json]

Timing: the calls over `--copies` copies of each weight, taken in turn so that the
weight is read from device memory, not from the L2 cache (50 MB on an H100: the copies
together exceed it), captured in one CUDA graph after a warm-up (the kernel's
compilation stays out) and its replays timed by triton.testing.do_bench's median, a
call's share: the kernel as a decode step's graph runs it. A Triton launch from Python
costs ~100 us of host time, more than these kernels take, so eager timings measure the
host (an H200, 2026-11-30: 4096 x 4096 Q4_0 at 127 us eager); they are printed beside
(`eager us`). Before timing, each product is checked against x times the weight
dequantized by gguf_quant.dequantize (torch; FP8: torch's float8 conversion): a wrong
kernel prints its error instead of a time. FP8 rows also time W8A8 (torch._scaled_mm)
where fp8_scaled_mm.w8a8_applies. Random blocks (llmd_tools.gguf_blocks), never zeros.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = ("4096x4096", "14336x4096", "4096x14336")  # N x K: a 8B model's q/o, gate/up, down


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), do_bench median."""
    from triton.testing import do_bench

    src = torch.randn(1 << 28, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms / 1e3)


def _weights(quant: str, n: int, k: int, copies: int, device: torch.device):
    """(kernel weights, one per copy; the dequantized float32 weight of copy 0; packed bytes)."""
    from llmd.gpu.layers.gguf_quant import dequantize
    from llmd.gpu.layers.quant.cuda_matmul import gguf_quant_weight
    from llmd.gpu.layers.quant.gguf_planes import to_planes
    from llmd.gpu.layers.quant.triton_quant_mm import QuantWeight
    from llmd_tools.gguf_blocks import random_blocks

    if quant == "FP8":
        weights = []
        for c in range(copies):
            data = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(c))
            data[(data & 0x7F) == 0x7F] = 0x10  # no NaN bytes
            scales = torch.rand(n, 1, generator=torch.Generator().manual_seed(c)) * 1e-3
            weights.append(QuantWeight("FP8", n, k, data.to(device), scales.to(device), fp8_group=k))
        dense = weights[0].qs.view(torch.float8_e4m3fn).float() * weights[0].d
        return weights, dense, n * k + n * 4
    weights = []
    for c in range(copies):
        blocks = random_blocks(quant, n, k, seed=c).to(device)
        if c == 0:
            dense = dequantize(blocks, quant, k)
        weights.append(gguf_quant_weight(to_planes(blocks, quant, k), quant, k))
    return weights, dense, blocks.numel()


def graph_us(fns: list, warmup: int = 25, rep: int = 200) -> float | None:
    """Median us of one call of `fns` (each once, in turn) replayed from one CUDA graph
    (do_bench's `warmup` and `rep` ms); None where the capture fails (the row then has
    eager times only)."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: compilation, allocations
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except RuntimeError as exc:
        print(f"bench: CUDA graph capture failed ({exc}); eager times only", file=sys.stderr)
        return None
    return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3 / len(fns)


def _rotating(fns: list) -> object:
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()
    return call


def bench(quant: str, n: int, k: int, rows: list[int], copies: int, bandwidth: float,
          device: torch.device) -> list[dict]:
    from triton.testing import do_bench

    from llmd.gpu.layers.quant.fp8_scaled_mm import w8a8_applies, w8a8_matmul
    from llmd.gpu.layers.quant.triton_quant_mm import quant_matmul

    weights, dense, packed_bytes = _weights(quant, n, k, copies, device)
    dense_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    results = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        out = quant_matmul(x, weights[0])
        ref = x.float() @ dense.T
        err = ((out.float() - ref).norm() / ref.norm()).item()
        row = {"type": quant, "n": n, "k": k, "rows": m, "err": err, "packed_mb": packed_bytes / 1e6}
        io = 2 * m * (k + n)
        floor_us = (packed_bytes + io) / bandwidth * 1e6
        dense_floor_us = (2 * n * k + io) / bandwidth * 1e6
        if err > 2e-2:
            row["status"] = "WRONG"
        else:
            packed = [lambda w=w: quant_matmul(x, w) for w in weights]
            bf16 = [lambda w=w: F.linear(x, w) for w in dense_bf16]
            eager_us = do_bench(_rotating(packed), warmup=25, rep=200, return_mode="median") * 1e3
            us = graph_us(packed) or eager_us
            dense_us = graph_us(bf16) or do_bench(_rotating(bf16), warmup=25, rep=200, return_mode="median") * 1e3
            row.update(us=us, eager_us=eager_us, floor_us=floor_us, of_roofline=floor_us / us, dense_us=dense_us,
                       dense_of_roofline=dense_floor_us / dense_us, vs_dense=dense_us / us)
            if quant == "FP8" and w8a8_applies(device, torch.bfloat16, weights[0].qs, weights[0].d):
                row["w8a8_us"] = graph_us([lambda w=w: w8a8_matmul(x, w.qs, w.d) for w in weights])
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K", "Q6_K", "Q8_0", "FP8"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--copies", type=int, default=8, help="weights taken in turn (past the L2 cache)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant_gpu: needs a CUDA device (the kernels' correctness on CPU: tests/test_triton_quant.py)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"bench_quant_gpu: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s "
          "(read + write); bf16 activations", flush=True)
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        for quant in args.types:
            for row in bench(quant, n, k, args.rows, args.copies, bandwidth, device):
                results.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    print(f"{'type':5} {'N x K':>12} {'rows':>4} {'MB':>6} {'err':>8} {'us':>8} {'floor':>7} {'of roof':>7} "
          f"{'bf16 us':>8} {'of roof':>7} {'speedup':>7} {'w8a8 us':>8} {'eager us':>8}   (us: graph replays)")
    for r in results:
        if "us" not in r:
            print(f"{r['type']:5} {r['n']:>5}x{r['k']:<6} {r['rows']:>4} {r['packed_mb']:6.1f} {r['err']:8.1e} WRONG")
            continue
        w8a8 = f"{r['w8a8_us']:8.1f}" if r.get("w8a8_us") else f"{'-':>8}"
        print(f"{r['type']:5} {r['n']:>5}x{r['k']:<6} {r['rows']:>4} {r['packed_mb']:6.1f} {r['err']:8.1e} "
              f"{r['us']:8.1f} {r['floor_us']:7.1f} {r['of_roofline']:7.0%} {r['dense_us']:8.1f} "
              f"{r['dense_of_roofline']:7.0%} {r['vs_dense']:6.2f}x {w8a8} {r['eager_us']:8.1f}")
    return 1 if any("us" not in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
