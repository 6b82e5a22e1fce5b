"""CPU: each fused layer op as llmd's C++ operator (llmd.gpu.layers.cpu.cpu_fused_ops) against the
unfused torch ops it replaces (llmd.gpu.layers.fused_ops.LayerOps, what LLMD_FUSED_OPS=0 runs),
at small-llama's shapes (hidden 512, 8 heads, 4 kv heads, head_dim 64, intermediate
1376) and at Llama-3-8B-like ones (`--shape 8b`: 4096, 32, 8, 128, 14336).

    python -m llmd_tools.bench_cpu_fused_ops [--rows 1 32 1365] [--dtype float32 bfloat16]
        [--threads 2] [--shape small|8b] [--iters 50] [--rounds 5]

The unfused and fused calls take turns for `--rounds` rounds of `--iters` calls each;
the median round is reported in ms per call, with the ratio. Rows 1 and 32 are decode
steps, 1365 a third of a 4,096-token prefill.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from llmd.gpu.layers.attention import AttentionMetadata, write_kv
from llmd.gpu.layers.cpu.cpu_fused_ops import CPU_FUSED
from llmd.gpu.layers.cpu.cpu_kernels import paged_decode_op
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps
from llmd.gpu.layers.kv_quant import UNIT_SCALES
from llmd.gpu.layers.norms import RMSNorm

SHAPES = {"small": (512, 8, 4, 64, 1376), "8b": (4096, 32, 8, 128, 14336)}
BLOCK_SIZE = 16


class _WriteOnly:
    """An attention layer that only writes the cache (as TorchAttention's unfused path
    does) and returns q untouched."""

    kv_scales = UNIT_SCALES

    def __call__(self, q, k, v, kv_cache, md, kv_written=False):
        if not kv_written:
            write_kv(kv_cache, k, v, md.slot_mapping)
        return q


class _Attn:
    """What `attend` reads of a DecoderAttention; its attention returns q untouched, so
    only the rotary, q/k handling and K/V write are timed."""

    q_norm = k_norm = None
    attn = _WriteOnly()

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim


def op_calls(ops: LayerOps, rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    hidden, heads, kv_heads, head_dim, inter = shape
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    x, residual = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    gate_up = torch.randn(rows, 2 * inter, generator=gen).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.randn(rows, 1, head_dim, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    blocks = -(-rows // BLOCK_SIZE) + 4
    cache = torch.zeros(2, kv_heads, blocks, BLOCK_SIZE, head_dim, dtype=dtype)
    md = AttentionMetadata(slot_mapping=torch.randperm(blocks * BLOCK_SIZE, generator=gen)[:rows], num_decodes=0,
                           decode_block_table=None, decode_seq_lens=None, prefills=[])
    attn = _Attn(heads, kv_heads, head_dim)
    return {"add + RMSNorm": lambda: ops.add_rms_norm(norm, x.clone(), residual),
            "SiLU * up": lambda: ops.act_and_mul(gate_up, "silu"),
            "rotary + K/V write": lambda: ops.attend(attn, qkv.clone(), cos, sin, cache, md)}


def _ms_per_call(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def compare(rows: int, shape: tuple[int, ...], dtype: torch.dtype, iters: int, rounds: int) -> list[tuple]:
    plain, fused = op_calls(UNFUSED, rows, shape, dtype), op_calls(CPU_FUSED, rows, shape, dtype)
    results = []
    for name in plain:
        for fn in (plain[name], fused[name]):
            fn()  # warm-up
        times = {"unfused": [], "fused": []}
        for _ in range(rounds):
            times["unfused"].append(_ms_per_call(plain[name], iters))
            times["fused"].append(_ms_per_call(fused[name], iters))
        a, b = statistics.median(times["unfused"]), statistics.median(times["fused"])
        results.append((name, a, b))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 1365])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if paged_decode_op() is None:
        raise SystemExit("llmd's CPU kernels cannot be built here (no C++ compiler or ninja)")
    print(f"shape {args.shape} {SHAPES[args.shape]}, torch threads {torch.get_num_threads()}, "
          f"median of {args.rounds} rounds x {args.iters} calls, ms per call")
    print(f"{'dtype':9} {'rows':>5}  {'op':20} {'unfused':>8} {'fused':>8} {'speed-up':>8}")
    for dtype in args.dtype:
        for rows in args.rows:
            for name, a, b in compare(rows, SHAPES[args.shape], getattr(torch, dtype), args.iters, args.rounds):
                print(f"{dtype:9} {rows:5d}  {name:20} {a:8.3f} {b:8.3f} {a / b:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
