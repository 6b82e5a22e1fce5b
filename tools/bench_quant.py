"""Time the packed matmuls of AWQ, GPTQ and FP8 checkpoints against the dense matmul the
model would run instead (oneDNN's packed linear, cpu_linear; float32 and bfloat16), on a
1B-class model's weight shapes, with torch's own int4 kernel
(`_weight_int4pack_mm_for_cpu`, the well-kept candidate) beside them:

    python -m llmd_tools.bench_quant [--rows 1] [--threads 1] [--calls 100] [--json]

Each layer is built as the loader builds it (layers/quant/: the checkpoint tensors
written by llmd_tools.quantize_checkpoint, loaded, finalized, its matmul attached);
median µs of alternated calls, x [rows, in]; GB/s is the weight's bytes over the time.
The report gives the machine's other load (tools/bench_gguf.py's measure)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

SHAPES = ((2048, 2048), (5632, 2048), (2048, 5632))  # (out, in): TinyLlama's q/o, gate/up, down
GROUP = 128


def _quantized_layer(method_opts: dict, w, dtype):
    """A ReplicatedLinear holding `w` quantized as `method_opts` say, with its matmul."""
    import torch

    from llmd.gpu.layers.cpu.cpu_kernels import fp8_ops, gguf_ops
    from llmd.gpu.layers.gguf_quant import x16_passes
    from llmd.gpu.layers.linear import ReplicatedLinear
    from llmd.gpu.layers.quant.quant_linear import finalize, quantized_matmul, use_quantized
    from llmd.gpu.layers.quant.scheme import quant_scheme
    from llmd_tools.quantize_checkpoint import (awq_tensors, fp8_tensors, gptq_tensors, options,
                                                quantization_config)

    args = options(**method_opts)
    if args.method == "awq":
        tensors = awq_tensors(w, args.group_size)
    elif args.method == "gptq":
        tensors = gptq_tensors(w, args.bits, args.group_size, args.sym, None, v1=True)
    else:
        tensors = fp8_tensors(w, args.fp8_style, tuple(args.block))
    scheme = quant_scheme(type("Config", (), {"quantization_config": quantization_config(args)}))
    with torch.device("meta"):
        layer = ReplicatedLinear(w.shape[1], w.shape[0])
    use_quantized(layer, scheme, {None: "bench"})
    for name, t in tensors.items():
        if name in scheme.checkpoint_names:
            layer.quant_method.load(name, None, t, None)
    finalize(layer)
    gguf = gguf_ops()
    passes = x16_passes(gguf) if gguf is not None and gguf.x16 else 0
    layer.kernel = quantized_matmul(layer, gguf, passes, fp8_ops())
    nbytes = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
    return layer, nbytes


def _int4pack(w, dtype):
    """torch's CPU int4 kernel over the same AWQ-style weight: w = (q - 8) s + zero_f,
    zero_f = (8 - z) s, scales and zero points in the activations' dtype."""
    import torch

    from llmd_tools.quantize_checkpoint import int_quantize

    codes, zeros, scales, _ = int_quantize(w, 4, GROUP, sym=False, order=None)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    s = scales.float().t()  # [groups, out]
    qsz = torch.stack([s, (8 - zeros.t().float()) * s], dim=-1).to(dtype).contiguous()
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, qsz)), \
        packed.numel() + qsz.numel() * qsz.element_size()


def variants(out: int, inp: int, dtype) -> dict[str, tuple[Callable, int]]:
    """name -> (x -> product, weight bytes) for one shape and activation dtype."""
    import torch

    from llmd.gpu.layers.cpu.cpu_linear import PackedLinearForward
    from llmd.gpu.layers.linear import ReplicatedLinear

    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(0)) * 0.02
    found: dict[str, tuple[Callable, int]] = {}
    for dense_dtype in dict.fromkeys((dtype, torch.bfloat16)):  # the model's own dtype, and bfloat16 (the anchor)
        name = f"dense {str(dense_dtype).removeprefix('torch.')}"
        layer = ReplicatedLinear(inp, out).to(dense_dtype)
        layer.weight.data = w.to(dense_dtype)
        layer.kernel = PackedLinearForward(layer)  # as pack_linears gives the model's dense layers
        found[name] = (layer, layer.weight.numel() * layer.weight.element_size())
    for name, opts in (("awq-int4 g128 (Q5_0)", dict(method="awq", group_size=GROUP)),
                       ("gptq-int4 sym g128 (Q4_0)", dict(method="gptq", group_size=GROUP)),
                       ("gptq-int8 sym g128 (Q8_0)", dict(method="gptq", bits=8, group_size=GROUP)),
                       ("fp8-e4m3 per channel", dict(method="fp8", fp8_style="channel"))):
        layer, nbytes = _quantized_layer(opts, w, dtype)
        found[name] = (layer, nbytes)
    found["torch int4pack g128"] = _int4pack(w, dtype)
    return found


def measure(rows: int, calls: int) -> list[dict]:
    import torch

    figures = []
    for dtype in (torch.float32, torch.bfloat16):
        for out, inp in SHAPES:
            runs = variants(out, inp, dtype)
            x = torch.randn(rows, inp).to(dtype)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for i in range(calls + 5):
                for name, (run, _) in runs.items():
                    xin = x.to(torch.bfloat16) if name == "dense bfloat16" else x
                    start = time.perf_counter()
                    run(xin)
                    if i >= 5:
                        times[name].append(time.perf_counter() - start)
            for name, (_, nbytes) in runs.items():
                us = statistics.median(times[name]) * 1e6
                figures.append({"x_dtype": str(dtype).removeprefix("torch."), "out": out, "in": inp, "kernel": name,
                                "us": us, "weight_mib": nbytes / 2 ** 20, "gb_s": nbytes / us / 1e3})
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: batch-1 decode)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    from llmd_tools.bench_gguf import _other_load

    torch.set_num_threads(args.threads)
    _other_load()
    figures = measure(args.rows, args.calls)
    other, load = _other_load(), os.getloadavg()[0]
    if args.json:
        print(json.dumps({"rows": args.rows, "threads": args.threads, "other_load_cores": other,
                          "load_average_1min_end": load, "figures": figures}))
        return 0
    print(f"x [{args.rows}, in], {args.threads} thread(s), medians of {args.calls} alternated calls; other load "
          f"{other:.2f} cores (processes seen), load average {load:.2f} at the end (every tenant)")
    print(f"{'x dtype':<9} {'out x in':>11} {'kernel':<27} {'us':>9} {'MiB':>7} {'GB/s':>6}")
    for f in figures:
        print(f"{f['x_dtype']:<9} {f['out']:>5}x{f['in']:<5} {f['kernel']:<27} {f['us']:>9.0f} {f['weight_mib']:>7.2f} "
              f"{f['gb_s']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
