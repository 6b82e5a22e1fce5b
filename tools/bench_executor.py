"""What the process boundary costs: decode steps/s with the multiprocess executor vs
the in-process one, same engine settings, same workload (batch 1 and 32, prompts of
96-160 random tokens), and the bytes each step sends to the worker.

    python -m llmd_tools.bench_executor [--model small-llama] [--dtype float32] [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path


def measure(model: str, backend: str, dtype: str, batch: int, steps: int) -> dict:
    llm = LLM(model=model, dtype=dtype, distributed_executor_backend=backend, max_model_len=512,
              max_num_seqs=batch, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    try:
        for i in range(batch):
            prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(96, 160))]
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
        for _ in range(4):  # prefill and warm-up
            engine.step()
        times, sent = [], []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            sent.append(getattr(engine.executor, "bytes_sent_last_step", 0))
        return {"step_ms": statistics.median(times) * 1e3, "bytes": statistics.median(sent)}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    print(f"model {model}, {args.dtype}, median of {args.steps} decode steps; load avg {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>5} {'in-process ms':>14} {'worker ms':>10} {'cost':>7} {'steps/s in/worker':>18} {'bytes/step':>10}")
    for batch in (1, 32):
        uni = measure(model, "uni", args.dtype, batch, args.steps)
        mp = measure(model, "mp", args.dtype, batch, args.steps)
        cost = mp["step_ms"] / uni["step_ms"] - 1
        print(f"{batch:>5} {uni['step_ms']:14.2f} {mp['step_ms']:10.2f} {cost:7.1%} "
              f"{1000 / uni['step_ms']:8.1f} / {1000 / mp['step_ms']:<7.1f} {mp['bytes']:>10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
