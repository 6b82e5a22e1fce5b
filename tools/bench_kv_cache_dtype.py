"""What a quantized KV cache (kv_cache_dtype fp8 / int8) costs and buys: bytes per token
of a model's cache, and the decode attention of one layer over each cache, beside the
model-dtype cache in the same run (the anchor) and the bytes each call must read.

    python -m llmd_tools.bench_kv_cache_dtype [--model DIR] [--batch 32] [--context 512] [--threads 2]
        [--clock wall|cpu]

On CPU the layer is TorchAttention with llmd's C++ paged decode kernel (the path a CPU
engine runs; the torch gather path without it); on CUDA TritonAttention. Times are the
median of --rounds rounds of --calls calls; `--threads 1 --clock cpu` times the one
thread's CPU time instead of the wall clock (on a shared machine, what other processes
took of the core does not count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import psutil
import torch

from llmd.gpu.layers.attention import AttentionMetadata, TorchAttention, new_kv_cache, set_decode_rows
from llmd.gpu.layers.kv_quant import KVScales, cache_dtype, kv_cache_format, quantize

SETTINGS = ("auto", "fp8", "int8")
BLOCK_SIZE = 16


def bytes_per_token(config: dict, dtype: torch.dtype) -> dict[str, int]:
    """K and V bytes one token takes across the model's layers, per setting."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    elements = 2 * config["num_hidden_layers"] * (config.get("num_key_value_heads") or heads) * head_dim
    return {s: elements * torch.empty((), dtype=cache_dtype(s, dtype)).element_size() for s in SETTINGS}


def layer(device: torch.device, heads: int, kv_heads: int, head_dim: int):
    if device.type == "cuda":
        from llmd.gpu.layers.triton_attention import TritonAttention

        return TritonAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    from llmd.gpu.layers.cpu.cpu_kernels import paged_decode_op

    attn = TorchAttention(heads, kv_heads, head_dim, head_dim ** -0.5)
    attn.decode_kernel = paged_decode_op()
    return attn


def time_decode(setting: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> float:
    """Median ms of one decode layer call over a cache of `setting`."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = -(-args.context // BLOCK_SIZE)
    num_blocks = args.batch * blocks_per_row
    cache = new_kv_cache(num_blocks, BLOCK_SIZE, args.kv_heads, args.head_dim, cache_dtype(setting, dtype), device)
    values = torch.randn(cache.shape, generator=gen).to(device)
    fmt = kv_cache_format(setting)
    scales = KVScales(0.02, 0.02)
    cache.copy_(values.to(dtype) if fmt is None else quantize(values, fmt, scales.k_inv))
    attn = layer(device, args.heads, args.kv_heads, args.head_dim)
    if fmt is not None:
        attn.kv_scales = scales
    tables = torch.randperm(num_blocks, generator=gen).view(args.batch, blocks_per_row)
    md = AttentionMetadata(slot_mapping=tables[:, -1].to(device) * BLOCK_SIZE, num_decodes=args.batch,
                           decode_block_table=None, decode_seq_lens=None, prefills=[])
    set_decode_rows(md, tables.numpy(), [args.context] * args.batch, device)
    type(attn).metadata_builder([attn], BLOCK_SIZE, device).build(md)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(args.batch, args.kv_heads, args.head_dim, generator=gen).to(dtype).to(device)
    rounds = []
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first round warms up
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            for _ in range(args.calls):
                attn(q, k, k, cache, md)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rounds.append((clock() - start) * 1e3 / args.calls)
    return statistics.median(rounds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (config.json) for the bytes per token")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock cpu times one thread on the CPU: use it with --threads 1 --device cpu")
    torch.set_num_threads(args.threads)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    if args.model:
        config = json.loads((Path(args.model) / "config.json").read_text())
        per_token = bytes_per_token(config, dtype)
        print(f"{args.model}: KV bytes per token ({args.dtype} model), and tokens in 1 GiB")
        for setting, n in per_token.items():
            print(f"  {setting:5s} {n:8d} B/token  {(1 << 30) // n:9d} tokens")
    load = psutil.getloadavg()[0]
    print(f"decode attention, one layer: batch {args.batch} x context {args.context}, {args.heads} heads / "
          f"{args.kv_heads} kv heads of {args.head_dim}, {args.dtype} queries, {args.device}, {args.threads} threads, "
          f"{args.clock} clock; "
          f"load average {load:.2f} before the run")
    base = None
    for setting in SETTINGS:
        ms = time_decode(setting, args, device, dtype)
        elem = torch.empty((), dtype=cache_dtype(setting, dtype)).element_size()
        kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * elem
        base = base or ms
        print(f"  {setting:5s} {ms:8.3f} ms/call  {base / ms:5.2f}x auto's speed  K/V read {kv_bytes / 2**20:7.1f} MiB "
              f"= {kv_bytes / ms / 1e6:6.2f} GB/s")
    print(f"load average {psutil.getloadavg()[0]:.2f} after the run")


if __name__ == "__main__":
    main()
