"""A packed LM head's greedy rows (layers/greedy_head.py) against its full product: the
head alone at each row count, on the model's own hidden states (a short greedy batch
first), two passes over x against one pass plus the refinement, and how many 16-row
groups a row refines.

    python -m llmd_tools.bench_greedy_head [--model FILE] [--rows 1 2 4 8 16 32] [--rounds 5]
        [--threads 2] [--json]

Each figure is the best of `--rounds` alternated calls; the two results' argmax is checked
equal on every row.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

PROMPTS = [f"Write a story number {i} about a {w} and the sea." for i, w in
           enumerate(["cat", "dog", "ship", "king", "tree", "moon", "fox", "bird"] * 4)]


def hidden_states(llm, steps: int = 16) -> torch.Tensor:
    """The final hidden states of a greedy batch's last decode steps (the LM head's input)."""
    from llmd import SamplingParams

    model = llm.engine.executor.runner.model
    caught, compute = [], model.compute_logits

    def grab(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        caught.append(hidden.detach().float().clone())
        return compute(hidden, *args, **kwargs)

    model.compute_logits = grab
    try:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=steps))
    finally:
        model.compute_logits = compute
    return torch.cat(caught)[-len(PROMPTS) * 8:].contiguous()


def measure(model_path: str | None, rows_list: list[int], rounds: int, threads: int) -> list[dict]:
    from llmd import LLM
    from llmd.gpu.layers import greedy_head

    llm = LLM(model=model_path, max_model_len=512, cpu_threads=threads) if model_path else \
        LLM(max_model_len=512, cpu_threads=threads)
    head = llm.engine.executor.runner.model.lm_head
    greedy = getattr(head.kernel, "greedy", None)
    if greedy is None:
        raise SystemExit("this model's LM head has no greedy path (not packed for the x16 kernel at >= 2 passes)")
    hidden = hidden_states(llm)
    w, code, cols, n = greedy.weight, greedy.code, greedy.cols, greedy.weight.shape[0]
    greedy_head.GREEDY_MIN_ROWS = 1
    results = []
    for rows in rows_list:
        x = hidden[:rows].contiguous()
        best = {"two_passes_ms": float("inf"), "greedy_ms": float("inf")}
        before = greedy.refined_groups
        full = torch.empty(rows, n)  # (the greedy path writes the head's own buffer)
        for _ in range(rounds):
            start = time.perf_counter()
            greedy.ops.mm_x16_into(x, w, code, cols, greedy.passes, "", full)
            best["two_passes_ms"] = min(best["two_passes_ms"], 1e3 * (time.perf_counter() - start))
            start = time.perf_counter()
            got = greedy.logits(x, list(range(rows)), head.vocab_size)
            best["greedy_ms"] = min(best["greedy_ms"], 1e3 * (time.perf_counter() - start))
            limit = head.vocab_size
            if not torch.equal(got[:, :limit].argmax(1), full[:, :limit].argmax(1)):
                raise SystemExit(f"rows {rows}: the greedy head's argmax differs from the full product's")
        groups = (greedy.refined_groups - before) / (rounds * rows)
        results.append(dict(rows=rows, **best, speedup=best["two_passes_ms"] / best["greedy_ms"],
                            groups_per_row=groups, groups=n // 16))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmd_tools.bench_greedy_head", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the built-in model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = measure(args.model, args.rows, args.rounds, args.threads)
    load = os.getloadavg()[0]  # every tenant's, this benchmark's own threads included
    if args.json:
        print(json.dumps({"load_average_1min_end": load, "figures": results}))
        return 0
    print(f"{args.threads} thread(s), best of {args.rounds} alternated calls; load average {load:.2f} at the end")
    print(f"{'rows':>5} {'two passes ms':>14} {'one + refine ms':>16} {'speed-up':>9} {'groups a row':>13}")
    for r in results:
        print(f"{r['rows']:>5} {r['two_passes_ms']:>14.2f} {r['greedy_ms']:>16.2f} {r['speedup']:>8.2f}x "
              f"{r['groups_per_row']:>6.1f} / {r['groups']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
