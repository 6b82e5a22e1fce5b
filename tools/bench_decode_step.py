"""A CPU engine's decode step with this checkout's C++ paged_decode against another
commit's, in turns in one process: the end-to-end figure of a kernel change.

    python -m llmd_tools.bench_decode_step [--model tiny-llama|PATH] [--batch 32] [--input-len 96]
        [--against REV|this] [--rounds 6] [--steps-per-round 5] [--json]

profile_step's engine (prefill of `--batch` random prompts, warm-up decode steps), then
`--rounds` rounds, each `--steps-per-round` decode steps with one kernel and as many with
the other (the order swapped every round), timed by the host clock around engine.step().
Every attention layer's decode kernel is swapped in place between the turns; the rest of
the step (weights, packed matmuls, KV pool, scheduler) is the same objects throughout.
Separate processes differ by ±20% in step time on a shared machine (where the weights and
the pool land, what the neighbours do), more than a kernel change moves it; turns in one
process cancel that. `--against REV` builds REV's kernel (tools/bench/kernel_revision.py,
~1 minute the first time); `--against this` runs this checkout's on both sides: the A/A
spread, the figure's noise floor. The contexts grow one token a step on both sides alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from llmd.config import KV_CACHE_DTYPES
from llmd.gpu.layers.attention import TorchAttention
from llmd.gpu.layers.cpu.cpu_kernels import paged_decode_op
from llmd_tools.profile_step import build_engine, start_decoding

THIS = "this"


def attention_layers(llm) -> list[TorchAttention]:
    """The model's attention layers that decode through the C++ kernel."""
    model = llm.engine.core.executor.runner.model
    return [m.attn for m in model.modules()
            if isinstance(getattr(m, "attn", None), TorchAttention) and m.attn.decode_kernel is not None]


def run(args: argparse.Namespace) -> dict[str, Any]:
    new = paged_decode_op()
    if new is None:
        raise SystemExit("llmd's CPU kernels cannot be built here (no C++ compiler or ninja)")
    if args.against == THIS:
        old: Callable[..., torch.Tensor] = new
    else:
        from llmd_tools.bench.kernel_revision import revision_paged_decode

        old = revision_paged_decode(args.against)
    engine_args = argparse.Namespace(model=args.model, device="cpu", dtype="auto", batch=args.batch,
                                     input_len=args.input_len, warmup=args.warmup, enforce_eager=False,
                                     kv_cache_dtype=args.kv_cache_dtype, guided=False,
                                     steps=args.rounds * args.steps_per_round)  # 2 x steps decode steps fit
    llm = build_engine(engine_args)
    layers = attention_layers(llm)
    if not layers:
        raise SystemExit("no attention layer decodes through the C++ kernel (LLMD_CPU_KERNELS=0?)")
    start_decoding(llm, engine_args)
    sides = {f"{args.against} (against)": old, "this checkout": new}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            for layer in layers:
                layer.decode_kernel = sides[name]
            for _ in range(args.steps_per_round):
                start = time.perf_counter()
                llm.engine.step()
                seconds[name].append(time.perf_counter() - start)
    llm.engine.shutdown()
    result = {"model": args.model, "batch": args.batch, "input_len": args.input_len, "layers": len(layers),
              "kv_cache_dtype": args.kv_cache_dtype,
              "torch_threads": torch.get_num_threads(), "loadavg_before": load_before,
              "loadavg_after": os.getloadavg()[0],
              "ms_per_step": {name: {"median": statistics.median(s) * 1e3, "min": min(s) * 1e3, "steps": len(s)}
                              for name, s in seconds.items()}}
    old_ms, new_ms = (v["median"] for v in result["ms_per_step"].values())
    result["speedup"] = old_ms / new_ms
    return result


def render(r: dict[str, Any]) -> str:
    lines = [f"decode steps of {r['model']}: batch {r['batch']}, {r['input_len']}-token prompts, {r['layers']} "
             f"attention layers, KV cache {r['kv_cache_dtype']}, torch threads {r['torch_threads']}, "
             f"load average {r['loadavg_before']:.2f} before, {r['loadavg_after']:.2f} after"]
    for name, s in r["ms_per_step"].items():
        lines.append(f"  {name:28s} {s['median']:9.2f} ms/step median  {s['min']:9.2f} min  ({s['steps']} steps)")
    lines.append(f"  this checkout's step: {r['speedup']:.2f}x the speed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="fixture name, model directory or GGUF file")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--against", default=THIS, help="a commit whose paged_decode to time against, or 'this'")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the engine's KV cache elements (both sides read the same cache)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("batch", "input_len", "rounds", "steps_per_round"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    result = run(args)
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
