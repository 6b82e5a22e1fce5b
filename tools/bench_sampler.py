"""Top-p filtering cost: the windowed fast path vs the full-sort rule it must equal
(the baseline, same process), on peaked and flat logits.

    python -m llmd_tools.bench_sampler [--rows 32] [--vocab 8192] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from llmd.gpu.sample.filters import apply_top_k_top_p_sorted, apply_top_k_top_p


def timed(fn, reps: int = 30) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    top_p = torch.full((args.rows, 1), args.top_p)
    print(f"N={args.rows} V={args.vocab} top_p={args.top_p} threads={args.threads} "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"{'logits':16} {'full sort ms':>12} {'fast path ms':>12} {'speed-up':>8}")
    for name, std in (("peaked (std 8)", 8.0), ("medium (std 4)", 4.0), ("flat (std 1)", 1.0)):
        logits = torch.randn(args.rows, args.vocab, generator=gen) * std
        assert torch.equal(apply_top_k_top_p(logits.clone(), None, 0, top_p).isinf(),
                           apply_top_k_top_p_sorted(logits.clone(), None, top_p).isinf())
        base = timed(lambda: apply_top_k_top_p_sorted(logits.clone(), None, top_p))
        fast = timed(lambda: apply_top_k_top_p(logits.clone(), None, 0, top_p))
        print(f"{name:16} {base:12.2f} {fast:12.2f} {base / fast:7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
