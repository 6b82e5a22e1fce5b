"""What a quantized KV cache (kv_cache_dtype fp8 / int8) costs and buys: bytes per token
of a model's cache, and the decode attention of one layer over each cache, beside the
model-dtype cache in the same run (the anchor) and the bytes each call must read.

    python -m llmd_tools.bench_kv_cache_dtype [--model DIR] [--batch 32] [--context 512] [--threads 2]
        [--clock wall|cpu]
    python -m llmd_tools.bench_kv_cache_dtype --attention [--baseline REV] [--batch 1 32]
        [--context 128 512 2048] [--heads 9 --kv-heads 3 --head-dim 64] [--threads 1 --clock cpu]

On CPU the layer is TorchAttention with llmd's C++ paged decode kernel (the path a CPU
engine runs; the torch gather path without it); on CUDA TritonAttention. Times are the
median of --rounds rounds of --calls calls; `--threads 1 --clock cpu` times the one
thread's CPU time instead of the wall clock (on a shared machine, what other processes
took of the core does not count).

`--attention` (CPU) times the C++ paged_decode operator alone (no cache write, no
Python layer) for every batch x context x cache setting, in microseconds per call, with
its multiply-adds per second (2 x batch x context x heads x head_dim per call) and the
K/V bytes it reads per second. `--baseline REV` builds the same operator as commit REV
wrote it (tools/bench/kernel_revision.py) and times both in turns in the same rounds:
the anchor, old against new. `--layers N` cycles the calls over N caches, as a model's
layers do (1: the same cache each call, hot in the CPU's caches when it fits).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psutil
import torch

from llmd.gpu.layers.attention import AttentionMetadata, TorchAttention, new_kv_cache, set_decode_rows
from llmd.gpu.layers.kv_quant import UNIT_SCALES, KVCacheFormat, KVScales, cache_dtype, kv_cache_format, quantize

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


class DecodeInputs(NamedTuple):
    """One layer's decode step over a cache of one setting: every row at the same context,
    its blocks in a random order (as after churn)."""

    cache: torch.Tensor
    fmt: KVCacheFormat | None
    scales: KVScales
    tables: torch.Tensor  # [batch, blocks per row] int64
    seq_lens: torch.Tensor  # [batch] int64
    q: torch.Tensor  # [batch, heads, head_dim]
    k: torch.Tensor  # [batch, kv_heads, head_dim]: the step's new K (and V) row


def decode_inputs(setting: str, batch: int, context: int, args: argparse.Namespace, device: torch.device,
                  dtype: torch.dtype, seed: int = 0) -> DecodeInputs:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_row
    cache = new_kv_cache(num_blocks, BLOCK_SIZE, args.kv_heads, args.head_dim, cache_dtype(setting, dtype), device)
    values = torch.randn(cache.shape, generator=gen).to(device)
    fmt = kv_cache_format(setting)
    scales = KVScales(0.02, 0.02) if fmt is not None else UNIT_SCALES
    cache.copy_(values.to(dtype) if fmt is None else quantize(values, fmt, scales.k_inv))
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_row).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(batch, args.kv_heads, args.head_dim, generator=gen).to(dtype).to(device)
    return DecodeInputs(cache, fmt, scales, tables, seq_lens, q, k)


def time_decode(setting: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> float:
    """Median ms of one decode layer call over a cache of `setting`."""
    batch, context = args.batch[0], args.context[0]
    inputs = decode_inputs(setting, batch, context, args, device, dtype)
    attn = layer(device, args.heads, args.kv_heads, args.head_dim)
    attn.kv_scales = inputs.scales
    md = AttentionMetadata(slot_mapping=inputs.tables[:, -1] * BLOCK_SIZE, num_decodes=batch,
                           decode_block_table=None, decode_seq_lens=None, prefills=[])
    set_decode_rows(md, inputs.tables.cpu().numpy(), [context] * batch, device)
    type(attn).metadata_builder([attn], BLOCK_SIZE, device).build(md)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rounds = []
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first round warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            for _ in range(args.calls):
                attn(inputs.q, inputs.k, inputs.k, inputs.cache, md)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rounds.append((clock() - start) * 1e3 / args.calls)
    return statistics.median(rounds[1:])


def layer_bench(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """Bytes per token (with --model) and one decode layer call over each setting's cache."""
    if len(args.batch) != 1 or len(args.context) != 1:
        raise SystemExit("one --batch and one --context without --attention")
    if args.model:
        config = json.loads((Path(args.model) / "config.json").read_text())
        per_token = bytes_per_token(config, dtype)
        print(f"{args.model}: KV bytes per token ({args.dtype} model), and tokens in 1 GiB")
        for setting, n in per_token.items():
            print(f"  {setting:5s} {n:8d} B/token  {(1 << 30) // n:9d} tokens")
    batch, context = args.batch[0], args.context[0]
    print(f"decode attention, one layer: batch {batch} x context {context}, {args.heads} heads / "
          f"{args.kv_heads} kv heads of {args.head_dim}, {args.dtype} queries, {args.device}, {args.threads} threads, "
          f"{args.clock} clock; load average {psutil.getloadavg()[0]:.2f} before the run")
    base = None
    for setting in SETTINGS:
        ms = time_decode(setting, args, device, dtype)
        kv_bytes = kv_bytes_read(setting, batch, context, args, dtype)
        base = base or ms
        print(f"  {setting:5s} {ms:8.3f} ms/call  {base / ms:5.2f}x auto's speed  K/V read {kv_bytes / 2**20:7.1f} MiB "
              f"= {kv_bytes / ms / 1e6:6.2f} GB/s")


def kv_bytes_read(setting: str, batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=cache_dtype(setting, dtype)).element_size()
    return 2 * batch * context * args.kv_heads * args.head_dim * elem


READ_BYTES = 256 << 20  # far above the CPU's caches


def read_bandwidth() -> float:
    """Bytes per second this host reads sequentially (torch's threads summing a large tensor)."""
    x = torch.ones(READ_BYTES // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * READ_BYTES / (time.perf_counter() - start)


def kernel_calls(op: Callable[..., torch.Tensor], inputs: list[DecodeInputs], scale: float) -> Callable[[], None]:
    """One call of `op` per layer's inputs, in turn."""
    def run() -> None:
        for x in inputs:
            op(x.q, x.cache, x.tables, x.seq_lens, scale, 0.0, 0, x.scales.k, x.scales.v)
    return run


def attention_bench(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """paged_decode alone: this checkout's (and --baseline's) over every batch x context x
    setting, in turns."""
    from llmd.gpu.layers.cpu.cpu_kernels import paged_decode_op

    if args.device != "cpu":
        raise SystemExit("--attention times the CPU kernel: --device cpu")
    ops: dict[str, Callable[..., torch.Tensor]] = {}
    if args.baseline:
        from llmd_tools.bench.kernel_revision import revision_paged_decode

        ops[args.baseline] = revision_paged_decode(args.baseline)
    op = paged_decode_op()
    if op is None:
        raise SystemExit("llmd's CPU kernels cannot be built here (no C++ compiler or ninja)")
    ops["this checkout"] = op
    device = torch.device("cpu")
    scale = args.head_dim ** -0.5
    print(f"paged_decode alone: {args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}, {args.dtype} "
          f"queries, block size {BLOCK_SIZE}, {args.layers} layer cache(s) in turn, {args.threads} thread(s), "
          f"{args.clock} clock, median of {args.rounds} rounds x {args.calls} calls; "
          f"load average {psutil.getloadavg()[0]:.2f} before the run")
    print(f"the memory anchor: this host reads {read_bandwidth() / 1e9:.1f} GB/s ({args.threads} thread(s), a sum over "
          f"{READ_BYTES >> 20} MiB); GMAC/s counts the scores' and values' multiply-adds")
    names = list(ops)
    head = "".join(f" {name[:14]:>14} us  GMAC/s  GB/s" for name in names)
    print(f"{'cache':5} {'batch':>5} {'context':>7}{head}" + ("  speed-up" if len(names) > 1 else "") + "  load")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    for setting in args.settings:
        for batch in args.batch:
            for context in args.context:
                inputs = [decode_inputs(setting, batch, context, args, device, dtype, seed=i)
                          for i in range(args.layers)]
                runs = {name: kernel_calls(fn, inputs, scale) for name, fn in ops.items()}
                times: dict[str, list[float]] = {name: [] for name in names}
                with torch.inference_mode():
                    for run in runs.values():
                        run()  # warm-up
                    for _ in range(args.rounds):
                        for name, run in runs.items():
                            start = clock()
                            for _ in range(args.calls):
                                run()
                            times[name].append((clock() - start) / (args.calls * args.layers))
                macs = 2 * batch * context * args.heads * args.head_dim
                kv_bytes = kv_bytes_read(setting, batch, context, args, dtype)
                line = f"{setting:5} {batch:5d} {context:7d}"
                medians = [statistics.median(times[name]) for name in names]
                for seconds in medians:
                    line += f" {seconds * 1e6:17.1f} {macs / seconds / 1e9:7.2f} {kv_bytes / seconds / 1e9:5.1f}"
                if len(names) > 1:
                    line += f"  {medians[0] / medians[-1]:7.2f}x"
                print(f"{line}  {psutil.getloadavg()[0]:4.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (config.json) for the bytes per token")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--context", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--attention", action="store_true", help="time the CPU paged_decode operator alone")
    parser.add_argument("--baseline", metavar="REV", help="--attention: also time paged_decode as commit REV wrote it")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS,
                        help="--attention: the cache settings to time")
    parser.add_argument("--layers", type=int, default=1, help="--attention: caches the calls cycle over")
    args = parser.parse_args()
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock cpu times one thread on the CPU: use it with --threads 1 --device cpu")
    if args.baseline and not args.attention:
        parser.error("--baseline goes with --attention")
    if min(args.batch or [1]) < 1 or min(args.context or [1]) < 1 or args.layers < 1:
        parser.error("--batch, --context and --layers must be at least 1")
    args.batch = args.batch or ([1, 32] if args.attention else [32])
    args.context = args.context or ([128, 512, 2048] if args.attention else [512])
    torch.set_num_threads(args.threads)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    if args.attention:
        attention_bench(args, dtype)
    else:
        layer_bench(args, device, dtype)
    print(f"load average {psutil.getloadavg()[0]:.2f} after the run")


if __name__ == "__main__":
    main()
