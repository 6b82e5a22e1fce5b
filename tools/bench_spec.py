"""What speculative decoding buys on a code-editing workload: each prompt holds a piece
of code and asks for it again with small edits, so the output largely repeats text the
prompt contains. Output tokens/s with n-gram speculation vs plain decoding, greedy, at
batch 1 and 16, with the mean accepted length.

The fixture models have random weights: they never copy their prompt, so n-gram drafts
are (almost) never accepted and that row measures the pure cost of proposing and
verifying. The "oracle" row stands in for a model that does copy: its drafts are the
plain run's own output with every 8th draft token wrong (87% correct, as an edit-heavy
rewrite might be; `--oracle-every 4`: 75%), through the same verification path. Greedy
outputs of all three runs are checked equal before any figure is printed (in float32; in
bf16/fp16 a verify step's k+1-token forward may round differently from one-token steps,
so a difference there is counted and printed instead of stopping the run).

The "draft" row runs draft-model speculation. With a fixture target and no --draft, the
draft is a tiny model of the target's architecture built with the target's tokenizer:
random weights again, so its drafts are (almost) never accepted and the row measures
what running a small draft model costs per step.

CUDA graphs: `--graphs on` (the default; rows "default": captured where the device and
settings allow, i.e. on CUDA), `off` (rows "eager": enforce_eager) or `both` (the whole
table each way, in one process: the A/B a GPU session reports). The "plain graphs" and
"spec graphs" columns say how many of a run's steps replayed a decode graph, so a verify
step that fell back to eager shows there. On CPU graphs are never captured;
`--emulate-graphs` runs them emulated (tests' mode: a check of the path, not a speed
figure).

    python -m llmd_tools.bench_spec [--model small-llama] [--draft DIR] [--dtype float32] [--device auto]
                                    [--k 4] [--tokens 96] [--batches 1,16] [--graphs on|off|both]
                                    [--oracle-every 8]
    # on a GPU (tools/gpu_session.sh builds /tmp/tinyllama):
    python -m llmd_tools.bench_spec --model /tmp/tinyllama --device cuda --dtype bfloat16 --graphs both
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

from llmd import LLM, SamplingParams
from llmd.core.spec_decode import SpecDecodeStats
from llmd_tools.make_model import build_model, fixture_path

SNIPPET = '''def load_rows(path, sep=","):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rows.append([field.strip() for field in line.split(sep)])
    return rows
'''


def edit_prompt(i: int) -> str:
    names = ["load_rows", "read_table", "parse_csv", "rows_of"]
    return (f"# Rename the function to {names[i % 4]}_{i} and keep everything else.\n"
            f"{SNIPPET}\n# Result:\n{SNIPPET.replace('load_rows', f'{names[i % 4]}_{i}')[:40]}")


class OracleDrafts:
    """Drafts from a known output, every `every`-th position wrong."""

    def __init__(self, llm: LLM, prompts: list[str], refs: list[list[int]], k: int, every: int = 8) -> None:
        tok = llm.engine.tokenizer
        self.known = [(tok(p).input_ids, r) for p, r in zip(prompts, refs)]
        self.k, self.every = k, every

    def propose(self, token_ids: list[int], req_id: str | None = None) -> list[int]:
        for prompt, ref in self.known:
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                return [t if (done + i) % self.every != self.every - 1 else (t + 1) % 1000
                        for i, t in enumerate(ref[done:done + self.k])]
        return []

    def forget(self, req_id: str) -> None:
        pass


def tiny_draft_for(model: str, out_dir: str) -> str:
    """A tiny model with the fixture `model`'s architecture, tokenizer and vocab size."""
    meta_path = Path(model) / "llmd_fixture.json"
    if not meta_path.is_file():
        raise SystemExit(f"{model} is not a llmd fixture: give the draft model with --draft")
    meta = json.loads(meta_path.read_text())
    return str(build_model(Path(out_dir), meta["arch"], "tiny", tokenizer_vocab=meta["tokenizer_vocab_size"],
                           vocab_size=meta["model_vocab_size"], tokenizer_flavour=meta["tokenizer_flavour"]))


def emulate_graphs(llm: LLM) -> None:
    """CPU: the decode graphs emulated on the runner (and its draft model)."""
    runner = llm.engine.executor.runner
    runner.init_decode_graphs(emulate=True)
    if runner.drafter is not None and runner.drafter.decode_graphs is None:
        runner.drafter.init_decode_graphs(runner.decode_graphs.sizes, emulate=True)


def graph_replays(llm: LLM) -> int:
    graphs = getattr(llm.engine.executor, "runner", None)
    graphs = graphs.decode_graphs if graphs is not None else None
    return graphs.num_replays if graphs is not None else 0


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]], str]:
    """Output tokens/s, the tokens, and "replayed/steps" of the run."""
    steps, replays = llm.engine.pipeline.stats.steps, graph_replays(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    graph_steps = f"{graph_replays(llm) - replays}/{llm.engine.pipeline.stats.steps - steps}"
    return sum(map(len, tokens)) / elapsed, tokens, graph_steps


def make_engines(args: argparse.Namespace, model: str, draft: str | None, eager: bool) -> dict[str, LLM]:
    common = dict(model=model, dtype=args.dtype, device=args.device, max_model_len=1024, max_num_seqs=16,
                  kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False, enforce_eager=eager)
    engines = {"plain": LLM(**common),
               "spec": LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4})}
    if draft is not None:
        engines["draft"] = LLM(**common, speculative_config={"method": "draft_model", "draft_model": draft,
                                                             "num_speculative_tokens": args.k})
    if args.emulate_graphs and not eager:
        for llm in engines.values():
            emulate_graphs(llm)
    return engines


def run_table(args: argparse.Namespace, engines: dict[str, LLM], mode: str) -> None:
    """One row per (batch, drafts): plain and speculative tok/s of the same prompts."""
    plain, spec = engines["plain"], engines["spec"]
    ngram = spec.engine.scheduler.drafts.proposer
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for batch in args.batches:
        prompts = [edit_prompt(i) for i in range(batch)]
        for llm in engines.values():
            llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        base, ref, base_graphs = timed(plain, prompts, params)
        oracle = OracleDrafts(spec, prompts, ref, args.k, args.oracle_every)
        runs = [("ngram", spec, ngram), ("oracle", spec, oracle)]
        if "draft" in engines:
            runs.append(("draft", engines["draft"], None))
        for name, llm, proposer in runs:
            if proposer is not None:
                llm.engine.scheduler.drafts.proposer = proposer
            llm.engine.scheduler.spec_stats = SpecDecodeStats()
            rate, tokens, graph_steps = timed(llm, prompts, params)
            if tokens != ref:
                differ = sum(t != r for t, r in zip(tokens, ref))
                if args.dtype == "float32":
                    raise SystemExit(f"speculative output differs from plain decoding ({name}, batch {batch})")
                print(f"note: {differ} of {len(ref)} outputs differ from plain decoding ({name}, batch {batch}, "
                      f"{args.dtype} rounding)", flush=True)
            stats = llm.engine.scheduler.spec_stats
            # No verifying step at all (no draft ever proposed): no length to average.
            mean_len = f"{stats.mean_accepted_length:9.2f}" if stats.num_drafts else f"{'-':>9}"
            print(f"{mode:>7} {batch:>5} {name:>7} {base:12.1f} {rate:11.1f} {rate / base:8.2f}x "
                  f"{stats.acceptance_rate:9.1%} {mean_len} {stats.num_draft_tokens:>8} "
                  f"{base_graphs:>12} {graph_steps:>12}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--draft", default=None, help="draft model directory (default: a tiny fixture-built one)")
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model row")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16])
    ap.add_argument("--graphs", choices=["on", "off", "both"], default="on",
                    help="CUDA graphs: captured (on), enforce_eager (off), or the table with each")
    ap.add_argument("--emulate-graphs", action="store_true", help="CPU: run the graph path emulated")
    ap.add_argument("--oracle-every", type=int, default=8,
                    help="the oracle's every N-th draft token is wrong (8: 87%% correct, 4: 75%%)")
    args = ap.parse_args(argv)
    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    # "default": graphs wherever the runner captures them (CUDA); "eager": enforce_eager.
    modes = {"on": ["default"], "off": ["eager"], "both": ["default", "eager"]}[args.graphs]
    print(f"model {model}, {args.dtype}, device {args.device}, k={args.k}, {args.tokens} tokens per request; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"{'mode':>7} {'batch':>5} {'drafts':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9} "
          f"{'accepted':>9} {'mean len':>9} {'drafted':>8} {'plain graphs':>12} {'spec graphs':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        draft = None if args.no_draft else args.draft or tiny_draft_for(model, tmp)
        for mode in modes:
            engines = make_engines(args, model, draft, eager=mode == "eager")
            run_table(args, engines, mode)
            for llm in engines.values():
                llm.engine.shutdown()
            del engines
            gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
