"""`llmd bench latency`: how long one batch takes, end to end. Each iteration generates
exactly `output_len` greedy tokens (ignore_eos) for `batch_size` prompts of `input_len`
random tokens, fresh ones every iteration so the prefix cache never helps."""
from __future__ import annotations

import time

import msgspec

from llmd import LLM
from llmd_tools.bench import workloads
from llmd_tools.bench.offline import StepCounter, check_fits, env_of, greedy, vocab_size
from llmd_tools.bench.report import Env, Stats, footer, progress, rate
from llmd_tools.bench.roofline import Roofline, decode_kv_tokens, roofline


class LatencyReport(msgspec.Struct, kw_only=True):
    benchmark: str = "latency"
    model: str
    batch_size: int
    input_len: int
    output_len: int
    num_iters_warmup: int
    num_iters: int
    latency_s: Stats  # of one batch
    latencies_s: list[float]
    output_tokens: int  # generated in the timed iterations
    output_tokens_per_s: float
    steps: int  # engine steps in the timed iterations
    roofline: Roofline | None = None  # CUDA only
    env: Env

    def text(self) -> str:
        lines = [f"llmd bench latency: {self.model}",
                 f"batch {self.batch_size} x ({self.input_len} in, {self.output_len} out), "
                 f"{self.num_iters} iterations after {self.num_iters_warmup} warm-up",
                 self.latency_s.row("batch latency", "s"),
                 f"{'output tokens':<24} {self.output_tokens} in {self.steps} steps, "
                 f"{self.output_tokens_per_s:.1f} tok/s"]
        return "\n".join(lines + footer(self.roofline, self.env))


def run_latency(llm: LLM, *, batch_size: int, input_len: int, output_len: int, num_iters_warmup: int,
                num_iters: int, seed: int) -> LatencyReport:
    vocab = vocab_size(llm)
    batches = [[r.prompt for r in workloads.fixed(batch_size, input_len, output_len, vocab, seed + i)]
               for i in range(num_iters_warmup + num_iters)]
    check_fits(llm, [workloads.Req(batches[0][0], output_len)])
    params = greedy(output_len)
    env = env_of(llm)
    for prompts in batches[:num_iters_warmup]:
        llm.generate(prompts, params)
    counter = StepCounter(llm)
    bar = progress(num_iters, "latency")
    latencies, output_tokens = [], 0
    for prompts in batches[num_iters_warmup:]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        latencies.append(time.perf_counter() - start)
        output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        bar.update()
    bar.close()
    seconds = sum(latencies)
    kv_tokens = num_iters * decode_kv_tokens([(input_len, output_len)] * batch_size)
    return LatencyReport(
        model=llm.engine.model_dir, batch_size=batch_size, input_len=input_len, output_len=output_len,
        num_iters_warmup=num_iters_warmup, num_iters=num_iters, latency_s=Stats.of(latencies),
        latencies_s=latencies, output_tokens=output_tokens, output_tokens_per_s=rate(output_tokens, seconds),
        steps=counter.steps, roofline=roofline(llm.engine, counter.steps, kv_tokens, seconds), env=env)
