"""What guided decoding costs: decode throughput with a JSON-schema grammar on every
request vs the same requests unconstrained, at batch 1 and 32, and the scheduler-side
time spent filling bitmasks per step.

The schema is an array of at least 10,000 "person" objects, so no guided request ends
before max_tokens: both runs decode exactly the same number of tokens (the unguided
ones with ignore_eos), and the figure compares like with like. The grammar is compiled
before timing starts (its compile time is printed on its own).

    python -m llmd_tools.bench_guided [--model small-llama] [--dtype float32] [--tokens 64]
"""
from __future__ import annotations

import argparse
import os
import random
import time

from llmd import LLM, GuidedDecodingParams, SamplingParams
from llmd_tools.make_model import fixture_path

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 10_000}


def run(llm: LLM, batch: int, tokens: int, guided: bool) -> tuple[float, int, float]:
    """Decode throughput (tokens/s, prefill excluded), steps, and mask-fill seconds."""
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=tokens, ignore_eos=True,
                            guided=GuidedDecodingParams(json_schema=SCHEMA) if guided else None)
    for i in range(batch):
        engine.add_request(f"{guided}-{i}", [rng.randrange(5, 1000) for _ in range(64)], params)
    while engine.scheduler.waiting_for_grammar or engine.scheduler.waiting:
        engine.step()  # the prefill (and the grammar, compiled before any timing)
    fill_before = engine.structured.fill_seconds
    steps = generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        generated += sum(len(o.outputs[0].new_token_ids) for o in outputs)
    elapsed = time.perf_counter() - start
    return generated / elapsed, steps, engine.structured.fill_seconds - fill_before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    args = ap.parse_args(argv)
    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    llm = LLM(model=model, dtype=args.dtype, max_model_len=512, max_num_seqs=32,
              kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    start = time.perf_counter()
    llm.generate(["warm"], SamplingParams(max_tokens=2, guided=GuidedDecodingParams(json_schema=SCHEMA)))
    print(f"model {model}, {args.dtype}, {args.tokens} tokens per request; load avg {os.getloadavg()[0]:.2f}")
    print(f"first guided request (tokenizer info + compile + 2 tokens): {time.perf_counter() - start:.2f} s")
    print(f"{'batch':>5} {'plain tok/s':>12} {'guided tok/s':>13} {'cost':>7} {'mask ms/step':>13} {'share':>7}")
    for batch in (1, 32):
        run(llm, batch, 8, guided=False)  # warm-up at this batch size
        plain, _, _ = run(llm, batch, args.tokens, guided=False)
        guided, steps, fill = run(llm, batch, args.tokens, guided=True)
        step_ms = 1e3 * batch * args.tokens / guided / steps
        fill_ms = 1e3 * fill / steps
        print(f"{batch:>5} {plain:12.1f} {guided:13.1f} {1 - guided / plain:7.1%} {fill_ms:13.3f} "
              f"{fill_ms / step_ms:7.1%}")
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
