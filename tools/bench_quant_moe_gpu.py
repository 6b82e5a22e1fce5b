"""CUDA only: one mixture-of-experts layer with its experts packed (the grouped kernel,
llmd.gpu.layers.quant.triton_quant_moe) at decode and small prefill batches, as a
fraction of its roofline — the packed bytes of the experts the batch's routing touches
(each distinct expert's gate, up and down: the least a step must read) over the device's
measured copy bandwidth — beside the same layer in bf16 through the dense fused-MoE
kernel (fused_moe_triton) and its own roofline (2 bytes a weight).

    python -m llmd_tools.bench_quant_moe_gpu [--types Q4_K_M Q8_0] [--tokens 1 4 16 64]
        [--experts 128] [--shape 2048x768] [--top-k 8] [--json]

The default layer is Qwen3-30B-A3B's (128 experts of 768 over hidden 2048, 8 a token);
`Q4_K_M` is llama.cpp's mix for it (gate and up Q4_K, down Q6_K). Routing: each token's
top_k experts drawn uniformly (seeded), the same for both. Timing: one call captured in a
CUDA graph after a warm-up (bench_quant_gpu.graph_us: a Triton launch from Python costs
more host time than these kernels take), its replays by triton.testing.do_bench's
median, the eager time beside; one layer's experts (~390 MB Q4_K_M, 1.2 GB bf16) exceed
the L2 cache, so each step reads them from device memory. Before timing, the packed layer is
checked against the bf16 one on its dequantized weights: a wrong kernel prints its error
instead of a time. Beside each row, the work list alone (moe_align_block_size at row
blocks of 16) by its one Triton launch and by the torch ops, each graph-timed: where the
one launch stops paying (moe_align.TRITON_MAX_PAIRS).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q8_0": ("Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0"), "Q6_K": ("Q6_K", "Q6_K")}


def packed_layer(mix: str, experts: int, hidden: int, inter: int, device: torch.device):
    """(ExpertWeights packed in `mix` with random blocks, its TritonPackedExperts, the
    dequantized w13 / w2 in bf16)."""
    from llmd.gpu.layers.gguf_quant import dequantize
    from llmd.gpu.layers.mlp import ExpertWeights
    from llmd.gpu.layers.quant.cuda_matmul import TritonPackedExperts
    from llmd_tools.gguf_blocks import random_blocks

    up_type, down_type = MIXES[mix]
    layer = ExpertWeights(experts, hidden, inter, None)
    layer.use_packed(up_type, "w13")
    layer.use_packed(down_type, "w2")
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    for e in range(experts):
        for part in (0, 1):
            blocks = random_blocks(up_type, inter, hidden, seed=3 * e + part)
            layer.load("w13", layer.w13, blocks, (e, part))
            w13[e, part * inter:(part + 1) * inter] = dequantize(blocks, up_type, hidden).to(torch.bfloat16)
        blocks = random_blocks(down_type, hidden, inter, seed=3 * e + 2)
        layer.load("w2", layer.w2, blocks, e)
        w2[e] = dequantize(blocks, down_type, inter).to(torch.bfloat16)
    layer = layer.to(device)
    return layer, TritonPackedExperts(layer), w13.to(device), w2.to(device)


def bench(mix: str, experts: int, hidden: int, inter: int, top_k: int, tokens: list[int], bandwidth: float,
          device: torch.device) -> list[dict]:
    from triton.testing import do_bench

    from llmd.gpu.layers.fused_moe_triton import triton_fused_experts
    from llmd.gpu.layers.fused_ops import UNFUSED
    from llmd.gpu.layers.moe_align import moe_align_block_size
    from llmd_tools.bench_quant_gpu import graph_us

    layer, packed, w13, w2 = packed_layer(mix, experts, hidden, inter, device)
    expert_bytes = (layer.w13.nbytes + layer.w2.nbytes) / experts
    dense_expert_bytes = 3 * hidden * inter * 2
    gen = torch.Generator().manual_seed(0)
    results = []
    for n in tokens:
        x = (torch.randn(n, hidden, generator=gen) * 0.5).to(torch.bfloat16).to(device)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(n)]).to(device)
        weights = torch.softmax(torch.randn(n, top_k, generator=gen), dim=-1).to(device)
        out = packed(x, weights, ids, "silu", UNFUSED)
        ref = triton_fused_experts(x, w13, w2, weights, ids, "silu", UNFUSED)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        touched = ids.unique().numel()
        io = 2 * n * hidden * 2
        row = {"mix": mix, "tokens": n, "experts_touched": touched, "err": err,
               "floor_us": (touched * expert_bytes + io) / bandwidth * 1e6,
               "dense_floor_us": (touched * dense_expert_bytes + io) / bandwidth * 1e6}
        if err > 3e-2:
            row["status"] = "WRONG"
        else:
            run = lambda: packed(x, weights, ids, "silu", UNFUSED)  # noqa: E731
            run_dense = lambda: triton_fused_experts(x, w13, w2, weights, ids, "silu", UNFUSED)  # noqa: E731
            row["eager_us"] = do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
            row["us"] = graph_us([run]) or row["eager_us"]
            row["dense_us"] = graph_us([run_dense]) or do_bench(run_dense, warmup=25, rep=200,
                                                                 return_mode="median") * 1e3
            row.update(of_roofline=row["floor_us"] / row["us"], vs_dense=row["dense_us"] / row["us"],
                       dense_of_roofline=row["dense_floor_us"] / row["dense_us"])
            for key, triton_align in (("align_us", True), ("align_torch_us", False)):  # the work list alone
                row[key] = graph_us([lambda t=triton_align: moe_align_block_size(ids, 16, experts, use_triton=t)])
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"], choices=list(MIXES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--shape", default="2048x768", help="hidden x an expert's intermediate size")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant_moe_gpu: needs a CUDA device (the kernel's correctness on CPU: "
              "tests/test_triton_quant_moe.py)", file=sys.stderr)
        return 2
    from llmd_tools.bench_quant_gpu import copy_bandwidth

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    hidden, inter = (int(v) for v in args.shape.split("x"))
    print(f"bench_quant_moe_gpu: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"{args.experts} experts of {hidden}x{inter}, top {args.top_k}, bf16 activations", flush=True)
    results = []
    for mix in args.types:
        for row in bench(mix, args.experts, hidden, inter, args.top_k, args.tokens, bandwidth, device):
            results.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    print(f"{'mix':7} {'tokens':>6} {'experts':>7} {'err':>8} {'us':>8} {'floor':>7} {'of roof':>7} "
          f"{'bf16 us':>8} {'of roof':>7} {'speedup':>7} {'eager us':>8} {'align us':>8} {'torch':>6}"
          "   (us: a CUDA graph's replays; align: the work list alone, one launch / torch ops)")
    for r in results:
        head = f"{r['mix']:7} {r['tokens']:>6} {r['experts_touched']:>7} {r['err']:8.1e}"
        if "us" not in r:
            print(f"{head} WRONG")
            continue
        print(f"{head} {r['us']:8.1f} {r['floor_us']:7.1f} {r['of_roofline']:7.0%} {r['dense_us']:8.1f} "
              f"{r['dense_of_roofline']:7.0%} {r['vs_dense']:6.2f}x {r['eager_us']:8.1f} "
              f"{r['align_us'] or 0:8.1f} {r['align_torch_us'] or 0:6.1f}")
    return 1 if any("us" not in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
