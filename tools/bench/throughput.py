"""`llmd bench throughput`: every request at once through the offline engine; requests,
input, output and total tokens per second. With an HF baseline, the same workload then
runs through transformers' `generate` in this process (after the engine is shut down,
so the two never share the device)."""
from __future__ import annotations

import gc
import sys
import time

import msgspec

from llmd import LLM
from llmd_tools.bench import workloads
from llmd_tools.bench.hf import run_hf
from llmd_tools.bench.offline import StepCounter, check_fits, env_of, greedy, vocab_size
from llmd_tools.bench.report import Env, footer, progress, rate
from llmd_tools.bench.roofline import Roofline, decode_kv_tokens, roofline

DATASETS = ("random", "nano")


class HfBaseline(msgspec.Struct, kw_only=True):
    batch_size: int
    seconds: float
    generated_tokens: int  # static batching computes past shorter requests' ends
    output_tokens_per_s: float  # requested tokens only
    total_tokens_per_s: float
    speedup: float  # llmd's total tokens/s over HF's (same workload, so a time ratio)


class ThroughputReport(msgspec.Struct, kw_only=True):
    benchmark: str = "throughput"
    model: str
    dataset: str
    num_requests: int
    total_input_tokens: int
    requested_output_tokens: int
    total_output_tokens: int  # what the engine generated
    elapsed_s: float
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    steps: int
    hf: HfBaseline | None = None
    roofline: Roofline | None = None  # CUDA only
    env: Env

    def text(self) -> str:
        lines = [f"llmd bench throughput: {self.model}, dataset {self.dataset}",
                 f"{self.num_requests} requests, {self.total_input_tokens} input + {self.total_output_tokens} "
                 f"output tokens in {self.elapsed_s:.2f} s ({self.steps} steps)",
                 f"{'requests/s':<16} {self.requests_per_s:10.2f}",
                 f"{'input tok/s':<16} {self.input_tokens_per_s:10.1f}",
                 f"{'output tok/s':<16} {self.output_tokens_per_s:10.1f}",
                 f"{'total tok/s':<16} {self.total_tokens_per_s:10.1f}"]
        if self.hf is not None:
            lines.append(f"HF transformers generate (batch {self.hf.batch_size}): {self.hf.total_tokens_per_s:.1f} "
                         f"total tok/s, {self.hf.output_tokens_per_s:.1f} output tok/s in {self.hf.seconds:.2f} s; "
                         f"llmd / HF = {self.hf.speedup:.2f}")
        return "\n".join(lines + footer(self.roofline, self.env))


def make_workload(llm: LLM, dataset: str, num_prompts: int, input_len: int, output_len: int,
                  max_len: int, seed: int) -> list[workloads.Req]:
    vocab = vocab_size(llm)
    if dataset == "nano":
        return workloads.nano(num_prompts, max_len, vocab, seed)
    if dataset == "random":
        return workloads.fixed(num_prompts, input_len, output_len, vocab, seed)
    raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")


def run_throughput(llm: LLM, reqs: list[workloads.Req], dataset: str, hf_batch_size: int | None = None) -> ThroughputReport:
    check_fits(llm, reqs)
    env = env_of(llm)
    llm.generate(workloads.make_prompts(2, 16, 16, vocab_size(llm), seed=workloads.WARM_UP_SEED), greedy(4))  # warm-up
    bar = progress(len(reqs), "llmd")
    counter = StepCounter(llm, bar)
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in reqs], [greedy(r.output_len) for r in reqs])
    elapsed = time.perf_counter() - start
    bar.close()
    n_in = sum(len(r.prompt) for r in reqs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    kv_tokens = decode_kv_tokens((len(r.prompt), r.output_len) for r in reqs)
    report = ThroughputReport(
        model=llm.engine.model_dir, dataset=dataset, num_requests=len(reqs), total_input_tokens=n_in,
        requested_output_tokens=sum(r.output_len for r in reqs), total_output_tokens=n_out,
        elapsed_s=elapsed, requests_per_s=rate(len(reqs), elapsed), input_tokens_per_s=rate(n_in, elapsed),
        output_tokens_per_s=rate(n_out, elapsed), total_tokens_per_s=rate(n_in + n_out, elapsed),
        steps=counter.steps, roofline=roofline(llm.engine, counter.steps, kv_tokens, elapsed), env=env)
    if hf_batch_size:
        # llmd's figures first (stderr, beside the progress bars): an HF run cut short by a
        # time limit still leaves them.
        print(report.text(), file=sys.stderr, flush=True)
        report.hf = _hf_baseline(llm, reqs, hf_batch_size, report.total_tokens_per_s)
    return report


def _hf_baseline(llm: LLM, reqs: list[workloads.Req], batch: int, llmd_total_tok_s: float) -> HfBaseline:
    engine = llm.engine
    engine.shutdown()  # frees the KV cache (and the device) before HF loads its copy
    gc.collect()
    bar = progress(len(reqs), "HF")
    run = run_hf(engine.model_dir, engine.dtype, engine.device, [r.prompt for r in reqs],
                 [r.output_len for r in reqs], batch, bar)
    bar.close()
    total = sum(len(r.prompt) for r in reqs) + run.output_tokens
    hf_total = rate(total, run.seconds)
    return HfBaseline(batch_size=batch, seconds=run.seconds, generated_tokens=run.generated_tokens,
                      output_tokens_per_s=run.tok_s, total_tokens_per_s=hf_total,
                      speedup=llmd_total_tok_s / hf_total)
