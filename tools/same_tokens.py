"""Do two commits generate the same tokens? For changes meant to move code, not output.

    python -m llmd_tools.same_tokens OLD NEW [--model PATH] [--prompts 48] [--max-tokens 48]

Checks both commits out into temporary worktrees (as bench_commits does) and runs one
random workload through each commit's offline engine, in a fresh process per commit and
setting: prompts of random lengths, each with its own sampling parameters (greedy;
seeded and unseeded random with top-k/top-p/min-p; repetition, presence and frequency
penalties; min_tokens; logprobs; n = 2), at most 8 sequences at once so the batch keeps
changing, with and without async scheduling. Prints, per setting, how many requests'
tokens (and logprobs, to 1e-5) agree; exits 1 when any differs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from llmd_tools.bench_commits import checkouts, env_for

# Run inside each commit's process: only the public offline API, which both commits share.
_WORKLOAD = r"""
import json, random, sys
from llmd import LLM, SamplingParams
model, prompts, max_tokens, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
rng = random.Random(0)
llm = LLM(model, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8, seed=0, **extra)
def params(i):
    common = dict(max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.5)
    kind = i % 6
    if kind == 0:
        return SamplingParams(temperature=0.0, **common)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_k=20, seed=rng.randrange(1000), logprobs=2, **common)
    if kind == 2:
        return SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, **common)
    if kind == 3:
        return SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3,
                              presence_penalty=0.2, seed=rng.randrange(1000), **common)
    if kind == 4:
        return SamplingParams(temperature=0.0, min_tokens=min(4, common["max_tokens"]), repetition_penalty=1.3,
                              **common)
    return SamplingParams(temperature=1.0, n=2, seed=rng.randrange(1000), **common)
token_prompts = [[rng.randrange(10, 900) for _ in range(rng.randint(1, 120))] for _ in range(prompts)]
outs = llm.generate(token_prompts, [params(i) for i in range(prompts)])
result = []
for out in outs:
    for c in out.outputs:
        lps = [[[t, v.logprob] for t, v in sorted(step.items())] for step in (c.logprobs or [])]
        result.append({"tokens": list(c.token_ids), "logprobs": lps})
print(json.dumps(result))
"""


def _run(path: Path, model: str, prompts: int, max_tokens: int, extra: dict) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", _WORKLOAD, model, str(prompts), str(max_tokens), json.dumps(extra)],
                         capture_output=True, text=True, env=env_for(path))
    if out.returncode != 0:
        raise SystemExit(f"the workload failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _close(a: list, b: list) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    return a == b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--model", default="", help="a model directory or .gguf (default: the built-in model)")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    settings = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True}}
    failed = False
    with checkouts((args.old, args.new), "llmd-same-tokens-") as paths:
        for name, extra in settings.items():
            old, new = (_run(paths[rev], args.model, args.prompts, args.max_tokens, extra)
                        for rev in (args.old, args.new))
            same = sum(a["tokens"] == b["tokens"] for a, b in zip(old, new))
            close = sum(_close(a["logprobs"], b["logprobs"]) for a, b in zip(old, new))
            tokens = sum(len(a["tokens"]) for a in old)
            print(f"{name:>6}: {same}/{len(old)} sequences with the same tokens ({tokens} tokens), "
                  f"{close}/{len(old)} with the same logprobs")
            failed |= same != len(old) or close != len(old) or len(old) != len(new)
    print("identical" if not failed else "DIFFERENT")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
