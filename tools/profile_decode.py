"""Decode-step breakdown at batch 32 on the `small` fixture: step time, model forward,
and the top operators (torch profiler).

    python -m llmd_tools.profile_decode [THREADS] [DTYPE]
"""
from __future__ import annotations

import random
import sys
import time

import torch

from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    torch.set_num_threads(threads)
    rng = random.Random(0)
    llm = LLM(model=str(fixture_path("small-llama")), dtype=dtype, max_model_len=512, max_num_seqs=32,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    engine = llm.engine
    for i in range(32):
        prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(96, 160))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(4):  # prefill, then a few decode steps
        engine.step()
    runner = engine.executor.runner
    forward_s = 0.0
    inner = runner.model.forward

    def timed(*args, **kwargs):
        nonlocal forward_s
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        forward_s += time.perf_counter() - start
        return out

    runner.model.forward = timed
    steps = 20
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    print(f"{dtype} threads={threads}: decode step {elapsed / steps * 1e3:.1f} ms, "
          f"model forward {forward_s / steps * 1e3:.1f} ms, {32 * steps / elapsed:.0f} tok/s")
    with torch.profiler.profile() as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
