"""What guided decoding costs: decode throughput with a JSON-schema grammar on every
request vs the same requests unconstrained, at batch 1 and 32 in the same run, with the
grammar rows filled before each step is launched (what a CPU engine does) and while its
forward runs (what a GPU engine does), and where the bitmask time goes: the time spent
filling each step's rows, and the time sampling waited for them (the part of the fill
the forward did not hide; none when they were filled before the launch).

The schema is an array of at least 10,000 "person" objects, so no guided request ends
before max_tokens: both runs decode exactly the same number of tokens (the unguided
ones with ignore_eos), and the figure compares like with like. The grammar is compiled
before timing starts (its compile time is printed on its own). The plain run and the
guided ones take turns, `--rounds` rounds per batch size (the order rotating): a cost is
the median over the rounds of 1 - guided/plain, so a shared machine's load weighs on
the runs of a round alike. An engine from before the overlap (an A/B run against an
older commit) has one guided way, before the launch, and no wait figure.

    python -m llmd_tools.bench_guided [--model small-llama] [--dtype float32] [--tokens 64] [--rounds 3]
                                      [--cpu-threads N] [--apply]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

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


@dataclass
class Run:
    tokens_per_s: float  # decode throughput, prefill excluded
    steps: int
    fill_s: float  # time spent filling bitmask rows
    # Time sampling waited for rows still being filled; None from an engine that filled
    # them before launching the step (commits before the overlap, for A/B runs).
    wait_s: float | None


# How a guided run has its rows filled: the engine's BitmaskFiller.beside_forward.
WAYS = {"before the launch": False, "beside the forward": True}


def run(llm: LLM, batch: int, tokens: int, way: str | None) -> Run:
    """One run of `batch` requests (way None: unguided)."""
    engine = llm.engine
    guided = way is not None
    filler = getattr(engine.structured, "filler", None)
    if guided and filler is not None:
        filler.beside_forward = WAYS[way]
    rng = random.Random(0)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=tokens, ignore_eos=True,
                            guided=GuidedDecodingParams(json_schema=SCHEMA) if guided else None)
    for i in range(batch):
        engine.add_request(f"{guided}-{i}", [rng.randrange(5, 1000) for _ in range(64)], params)
    while engine.scheduler.waiting_for_grammar or engine.scheduler.waiting:
        engine.step()  # the prefill (and the grammar, compiled before any timing)
    structured = engine.structured
    fill_before, wait_before = structured.fill_seconds, getattr(structured, "wait_seconds", None)
    steps = generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        generated += sum(len(o.outputs[0].new_token_ids) for o in outputs)
    elapsed = time.perf_counter() - start
    return Run(generated / elapsed, steps, structured.fill_seconds - fill_before,
               None if wait_before is None else structured.wait_seconds - wait_before)


def measure(llm: LLM, batch: int, tokens: int, rounds: int) -> list[str]:
    """The table's rows for one batch size: each guided way against the plain runs of
    the same rounds."""
    ways = list(WAYS) if hasattr(llm.engine.structured, "filler") else ["before the launch"]
    kinds: list[str | None] = [None, *ways]
    for kind in kinds:
        run(llm, batch, 8, kind)  # warm-up at this batch size
    runs: dict[str | None, list[Run]] = {kind: [] for kind in kinds}
    for i in range(rounds):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            runs[kind].append(run(llm, batch, tokens, kind))
    plain = runs[None]
    plain_tps = statistics.median(r.tokens_per_s for r in plain)
    lines = []
    for way in ways:
        guided = runs[way]
        guided_tps = statistics.median(r.tokens_per_s for r in guided)
        cost = 1 - statistics.median(g.tokens_per_s / p.tokens_per_s for g, p in zip(guided, plain))
        steps = sum(r.steps for r in guided)
        fill_ms = 1e3 * sum(r.fill_s for r in guided) / steps
        wait = "-" if not WAYS[way] or guided[0].wait_s is None else \
            f"{1e3 * sum(r.wait_s for r in guided) / steps:.3f}"
        lines.append(f"{batch:>5} {way:>18} {plain_tps:12.1f} {guided_tps:13.1f} {cost:7.1%} "
                     f"{1e3 * batch / guided_tps:8.2f} {fill_ms:13.3f} {wait:>13}")
    return lines


def apply_costs(llm: LLM, batch: int, tokens: int, repeats: int = 5) -> dict[str, float]:
    """Milliseconds to apply one step's grammar rows to [batch, vocab] float32 logits on the
    engine's device, three ways, with the rows a guided run really filled (JSON masks
    mostly allow few tokens, which is what slows the branchy ways down)."""
    import torch
    import xgrammar as xgr

    from llmd.gpu.sample.metadata import SamplingMetadata, unpack_bitmask

    filler = llm.engine.structured.filler
    filled: list[bytes] = []
    fill = filler.fill
    filler.fill = lambda groups: filled.append(fill(groups)) or filled[-1]
    try:
        run(llm, batch, tokens, "beside the forward")
    finally:
        del filler.fill  # the method again
    device, vocab = llm.engine.device, llm.engine.vocab_size
    md = SamplingMetadata.build([SamplingParams()] * batch, [[1]] * batch, [[]] * batch, valid_vocab_size=vocab)
    logits = torch.randn(batch, vocab, device=device)
    ways = {
        "0/-inf bias (llmd)": lambda: md.mask_grammar(logits),
        "masked_fill, bool mask": lambda: logits.masked_fill(~unpack_bitmask(md.grammar_bitmask, vocab), float("-inf")),
        "xgrammar kernel, on a copy": lambda: xgr.apply_token_bitmask_inplace(
            logits.clone(), md.grammar_bitmask, vocab_size=vocab),
    }
    seconds = dict.fromkeys(ways, 0.0)
    steps = [data for data in filled if len(data) == batch * 4 * ((vocab + 31) // 32)]
    for data in steps:
        md.set_grammar_bitmask(list(range(batch)), data, device)
        for name, apply in ways.items():
            start = time.perf_counter()
            for _ in range(repeats):
                apply()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[name] += (time.perf_counter() - start) / repeats
    return {name: 1e3 * total / len(steps) for name, total in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of a plain run and each guided way per batch size")
    ap.add_argument("--cpu-threads", type=int, default=None, help="the model's torch threads on the CPU")
    ap.add_argument("--apply", action="store_true", help="also time ways to apply a step's rows (batch 32)")
    args = ap.parse_args(argv)
    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    llm = LLM(model=model, dtype=args.dtype, max_model_len=512, max_num_seqs=32, cpu_threads=args.cpu_threads,
              kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    start = time.perf_counter()
    llm.generate(["warm"], SamplingParams(max_tokens=2, guided=GuidedDecodingParams(json_schema=SCHEMA)))
    print(f"model {model}, {args.dtype}, {args.tokens} tokens per request, {args.rounds} rounds; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"first guided request (tokenizer info + compile + 2 tokens): {time.perf_counter() - start:.2f} s")
    print(f"{'batch':>5} {'rows filled':>18} {'plain tok/s':>12} {'guided tok/s':>13} {'cost':>7} {'step ms':>8} "
          f"{'fill ms/step':>13} {'wait ms/step':>13}")
    for batch in (1, 32):
        print("\n".join(measure(llm, batch, args.tokens, args.rounds)))
    if args.apply:
        costs = apply_costs(llm, 32, args.tokens)
        print("applying one step's rows at batch 32: " + ", ".join(f"{k} {v:.3f} ms" for k, v in costs.items()))
    print(f"load avg {os.getloadavg()[0]:.2f} at the end")
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
