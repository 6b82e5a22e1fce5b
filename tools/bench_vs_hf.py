"""Offline throughput: llmd's engine vs HF transformers `generate`, same process, same
workload (issue 2's: N prompts of 96-160 random tokens, 128 new tokens, greedy,
ignore_eos), at batch 1 and batch 32, fp32 and bf16.

    python -m llmd_tools.bench_vs_hf [--model small-llama] [--dtype float32 bfloat16]
        [--batch 1 32] [--rounds 1] [--before] [--threads N] [--clock wall|cpu] [--json]

Prints output tokens/s of both and the ratio, plus llmd's step breakdown (model forward
vs everything else: scheduling, input prep, sampling, detokenization).

`--before` also runs llmd with its CPU step as it was before oneDNN-packed linears, the
C++ decode kernel and the C++ fused layer ops (profile_decode's `before` variant), in the same rounds, and prints
now / before. `--rounds N` runs llmd and HF alternately N times per row and reports the medians and
the spread of the per-round ratio. `--clock cpu` times both with this thread's CPU time instead of the wall clock; with
`--threads 1` every operator of both runs on this thread, so a busy machine's other
processes do not count (their memory and cache traffic still does). The figures to
publish are wall-clock ones on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import psutil
import torch

from llmd import LLM, SamplingParams
from llmd_tools.bench.hf import run_hf
from llmd_tools.bench.workloads import make_prompts
from llmd_tools.make_model import fixture_path
from llmd_tools.profile_decode import before

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


class StepTimer:
    """Wraps the engine's executor and model to split step time into model vs rest."""

    def __init__(self, llm: LLM, clock) -> None:
        self.forward_s = 0.0
        self.steps = 0
        model = llm.engine.executor.runner.model
        inner = model.forward

        def timed_forward(*args, **kwargs):
            t = clock()
            out = inner(*args, **kwargs)
            self.forward_s += clock() - t
            self.steps += 1
            return out

        model.forward = timed_forward


def run_llmd(model: str, dtype: str, prompts: list[list[int]], batch: int, new_tokens: int,
             clock=time.perf_counter, adjust=None) -> dict:
    """`adjust(model)`, if given, changes the loaded model first (an A/B variant)."""
    llm = LLM(model=model, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=max(2048, 160 * batch),
              max_model_len=512, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    if adjust is not None:
        adjust(llm.engine.executor.runner.model)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    timer = StepTimer(llm, clock)
    start = clock()
    outputs = llm.generate(prompts, params)
    elapsed = clock() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(prompts) * new_tokens
    return {"tokens": generated, "seconds": elapsed, "tok_s": generated / elapsed,
            "steps": timer.steps, "forward_s": timer.forward_s,
            "overhead_frac": 1 - timer.forward_s / elapsed}


def measure(args: argparse.Namespace, model: str, dtype: str, batch: int, prompts: list[list[int]], clock) -> dict:
    """One row: llmd and HF alternately, args.rounds times; medians, and the per-round ratios."""
    ours, refs, olds = [], [], []
    for _ in range(args.rounds):
        ours.append(run_llmd(model, dtype, prompts, batch, args.new_tokens, clock))
        if args.before:
            olds.append(run_llmd(model, dtype, prompts, batch, args.new_tokens, clock, adjust=before))
        if not args.no_hf:
            hf = run_hf(model, DTYPES[dtype], "cpu", prompts, [args.new_tokens] * len(prompts), batch, clock=clock)
            refs.append({"tokens": hf.output_tokens, "seconds": hf.seconds, "tok_s": hf.tok_s})
    median = ours[sorted(range(len(ours)), key=lambda i: ours[i]["tok_s"])[len(ours) // 2]]
    row = {"dtype": dtype, "batch": batch, "prompts": len(prompts), "llmd": median, "hf": None, "ratio": None,
           "rounds": [{"llmd_tok_s": o["tok_s"], "hf_tok_s": r["tok_s"] if r else None}
                      for o, r in zip(ours, refs or [None] * len(ours))]}
    if olds:
        row["before_tok_s"] = statistics.median(o["tok_s"] for o in olds)
        row["now_vs_before"] = statistics.median(o["tok_s"] / b["tok_s"] for o, b in zip(ours, olds))
    if refs:
        row["hf"] = {"tok_s": statistics.median(r["tok_s"] for r in refs), "tokens": refs[0]["tokens"]}
        ratios = [o["tok_s"] / r["tok_s"] for o, r in zip(ours, refs)]
        row["ratio"] = statistics.median(ratios)
        row["ratio_range"] = (min(ratios), max(ratios))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama", help="fixture name or model directory")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts for batch 1 (HF is slow there)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="llmd and HF alternately, this many times per row")
    ap.add_argument("--before", action="store_true", help="also llmd's CPU step before packing and the C++ kernels")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: this thread's CPU time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]

    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(args.num_prompts, 96, 160, min(vocab, 1000), seed=0)
    load = os.getloadavg()[0]
    rows = []
    for dtype in args.dtype:
        for batch in args.batch:
            subset = prompts[:args.batch1_prompts] if batch == 1 else prompts
            rows.append(measure(args, model, dtype, batch, subset, clock))
    meta = {"model": model, "torch_threads": torch.get_num_threads(), "clock": args.clock, "cpu_count": os.cpu_count(),
            "loadavg_before": load, "cpu_percent_other": psutil.cpu_percent(interval=0.5)}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return 0
    print(f"model {model}; torch threads {meta['torch_threads']}; {args.clock} clock; load avg before {load:.2f}")
    print(f"{'dtype':9} {'batch':>5} {'prompts':>7} {'llmd tok/s':>11} {'HF tok/s':>9} {'ratio':>6} "
          f"{'steps':>6} {'fwd ms/step':>11} {'overhead':>8} {'ratio min..max':>15}")
    for r in rows:
        o = r["llmd"]
        hf = f"{r['hf']['tok_s']:9.1f}" if r["hf"] else f"{'-':>9}"
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] else f"{'-':>6}"
        spread = f"{r['ratio_range'][0]:.2f}..{r['ratio_range'][1]:.2f}" if r["ratio"] else "-"
        old = (f"  before {r['before_tok_s']:.1f} tok/s, now / before {r['now_vs_before']:.2f}"
               if "before_tok_s" in r else "")
        print(f"{r['dtype']:9} {r['batch']:>5} {r['prompts']:>7} {o['tok_s']:11.1f} {hf} {ratio} "
              f"{o['steps']:>6} {1000 * o['forward_s'] / max(o['steps'], 1):11.2f} {o['overhead_frac']:8.1%} "
              f"{spread:>15}{old}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
