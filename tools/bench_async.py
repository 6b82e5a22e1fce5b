"""What async scheduling buys: output tokens/s of the same greedy workload with
`async_scheduling` off (the baseline) and on, in the same process, for the in-process
executor and the worker-process one, at batch 1 and 32. Tokens are checked equal
before any figure is printed.

With async scheduling the scheduler, output processing and (offline) detokenization of
step N run while step N+1 computes; what it can hide is that non-model time, so the
gain is largest where steps are short (small batches, a GPU).

    python -m llmd_tools.bench_async [--model small-llama] [--dtype float32] [--tokens 64] [--cpu-threads N]
"""
from __future__ import annotations

import argparse
import os
import random
import time

from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, list]:
    """(output tokens/s, wall seconds per launched step, outputs)."""
    engine = llm.engine
    steps_before = engine.pipeline.stats.steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.pipeline.stats.steps - steps_before
    return tokens / elapsed, elapsed / max(steps, 1), outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per setting (the best is shown)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the model (CPU)")
    args = ap.parse_args(argv)
    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    print(f"model {model}, {args.dtype}, {args.tokens} tokens per request, cpu_threads {args.cpu_threads}; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"{'executor':>8} {'batch':>5} {'sync tok/s':>11} {'async tok/s':>12} {'speed-up':>9} "
          f"{'sync ms/step':>13} {'async ms/step':>14}")
    for backend in ("uni", "mp"):
        engines = {mode: LLM(model=model, dtype=args.dtype, max_model_len=512, max_num_seqs=32,
                             kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
                             distributed_executor_backend=backend, async_scheduling=mode,
                             cpu_threads=args.cpu_threads)
                   for mode in (False, True)}
        for batch in (1, 32):
            prompts = [[rng.randrange(5, 1000) for _ in range(32)] for _ in range(batch)]
            best: dict[bool, tuple[float, float]] = {}
            outputs = {}
            for mode, llm in engines.items():
                llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
                for _ in range(args.repeats):
                    rate, per_step, outs = timed(llm, prompts, params)
                    if mode not in best or rate > best[mode][0]:
                        best[mode] = (rate, per_step)
                    outputs[mode] = [o.outputs[0].token_ids for o in outs]
            if outputs[True] != outputs[False]:
                raise SystemExit(f"async scheduling changed the output ({backend}, batch {batch})")
            (sync_rate, sync_step), (async_rate, async_step) = best[False], best[True]
            print(f"{backend:>8} {batch:>5} {sync_rate:11.1f} {async_rate:12.1f} {async_rate / sync_rate:8.2f}x "
                  f"{1e3 * sync_step:13.2f} {1e3 * async_step:14.2f}")
        for llm in engines.values():
            llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
