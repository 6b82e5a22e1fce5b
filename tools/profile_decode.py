"""Where a model step's time goes, and engine variants compared in one process.

    python -m llmd_tools.profile_decode [--model small-llama] [--dtype float32] [--threads 2]
        [--batch 32] [--prompt-len 96 160] [--steps 10] [--rounds 3]
        [--variants default] [--prefill] [--table 15] [--clock wall|cpu]

Every variant is its own engine on the same weights with the same requests (greedy,
`ignore_eos`). After the prefill, the variants take turns: each round runs `--steps`
decode steps on every variant, so load from other processes and the contexts' growth
weigh on all of them alike. Per variant it prints the median decode step over the rounds
and its parts: the model forward split into linear layers, attention and the rest
(norms, rotary, activation, residual adds, glue), the LM head, and the host's share
(scheduling, input preparation, sampling, output processing), then the host's parts. With `--prefill` it also
times the prefill steps, and `--table N` prints the torch profiler's top N operators of
a few decode steps of each variant.

`--clock cpu` times with the calling thread's CPU time instead of the wall clock: with
`--threads 1` every operator runs on that thread, so time the scheduler gave to other
processes does not count (for A/B runs on a busy machine; memory and cache contention
still do).

Variants: `default` (the engine as configured), `python-layers` (batch-1 decode steps
through the Python layers instead of the C++ ones, cpu/cpu_decode_layers; every other
variant implies it), `mkl` (linear layers through F.linear, as before oneDNN packing:
cpu_linear.unpack_linears), `torch-attention` (decode
attention on TorchAttention's gather-and-GEMM path instead of the C++ kernel), `before`
(both: the CPU step before either).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmd import LLM, SamplingParams
from llmd.gpu.layers.attention import AttentionLayer, TorchAttention
from llmd.gpu.layers.cpu.cpu_linear import unpack_linears
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps
from llmd.gpu.layers.linear import LinearBase
from llmd_tools.bench.workloads import make_prompts
from llmd_tools.make_model import fixture_path


def python_layers(model: nn.Module) -> None:
    """Batch-1 decode steps through the Python layers (no C++ DecodeLayers:
    cpu/cpu_decode_layers); every variant that changes the layers implies it."""
    model.decode_layers = None


def mkl(model: nn.Module) -> None:
    """Linear layers through F.linear (cpu_linear.unpack_linears)."""
    python_layers(model)
    unpack_linears(model)


def torch_attention(model: nn.Module) -> None:
    """Decode attention back on TorchAttention's gather-and-GEMM path (no C++ kernel)."""
    python_layers(model)
    for module in model.modules():
        if isinstance(getattr(module, "attn", None), TorchAttention):
            module.attn.decode_kernel = None


def unfused(model: nn.Module) -> None:
    """The layers' norms, rotary, K/V write and activation back on their torch ops (no
    C++ fused ops; what LLMD_FUSED_OPS=0 loads)."""
    python_layers(model)
    for module in model.modules():
        if isinstance(getattr(module, "ops", None), LayerOps):
            module.ops = UNFUSED


def before(model: nn.Module) -> None:
    """The CPU step as it was before issue 13: no oneDNN packing, C++ decode kernel or
    fused ops."""
    python_layers(model)
    unpack_linears(model)
    torch_attention(model)
    unfused(model)


VARIANTS: dict[str, tuple[dict[str, Any], Callable[[nn.Module], None] | None]] = {
    "default": ({}, None),
    "python-layers": ({}, python_layers),
    "mkl": ({}, mkl),
    "torch-attention": ({}, torch_attention),
    "unfused": ({}, unfused),
    "before": ({}, before),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


# The host's parts of a step: (name, path from the engine to the object, its method).
HOST_PARTS = (("schedule", "scheduler", "schedule"), ("update", "scheduler", "update_from_output"),
              ("outputs", "output_processor", "process"), ("inputs", "executor.runner.batch", "prepare"),
              ("inputs", "executor.runner.batch", "eager_inputs"), ("sampling", "executor.runner.sampling", "sample"))


class Probe:
    """Seconds spent in a model's linear layers, attention, forward and LM head, and in
    the host's parts of the step (HOST_PARTS)."""

    def __init__(self, model: nn.Module, engine: Any) -> None:
        self.seconds = {"forward": 0.0, "linear": 0.0, "attention": 0.0, "lm_head": 0.0}
        for key, path, method in HOST_PARTS:
            owner = engine
            for name in path.split("."):
                owner = getattr(owner, name)
            setattr(owner, method, self._timed(getattr(owner, method), key))
            self.seconds[key] = 0.0
        for module in model.modules():
            if isinstance(module, (nn.Linear, LinearBase)) and module is not getattr(model, "lm_head", None):
                module.forward = self._timed(module.forward, "linear")
            if isinstance(getattr(module, "attn", None), AttentionLayer):
                module.attn = _TimedCall(module.attn, self._timed(module.attn, "attention"))
        model.forward = self._timed(model.forward, "forward")
        model.compute_logits = self._timed(model.compute_logits, "lm_head")

    def _timed(self, fn: Callable, key: str) -> Callable:
        def timed(*args, **kwargs):
            start = clock()
            out = fn(*args, **kwargs)
            self.seconds[key] += clock() - start
            return out
        return timed

    def take(self) -> dict[str, float]:
        taken = dict(self.seconds)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return taken


class _TimedCall:
    """An attention layer whose calls go through a timer; other attributes are its own."""

    def __init__(self, inner: Any, call: Callable) -> None:
        self.inner = inner
        self.call = call

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Variant:
    def __init__(self, name: str, args: argparse.Namespace, model: str, prompts: list[list[int]]) -> None:
        settings, adjust = VARIANTS[name]
        self.name = name
        longest = max(len(p) for p in prompts) + args.rounds * args.steps + args.steps + 8
        self.llm = LLM(model=model, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=longest,
                       max_num_batched_tokens=max(2048, args.prefill_chunk), kv_cache_memory_bytes=args.kv_bytes,
                       enable_prefix_caching=False, **settings)
        self.engine = self.llm.engine
        self.model = self.engine.executor.runner.model
        if adjust is not None:
            adjust(self.model)
        self.probe = Probe(self.model, self.engine)
        params = SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            self.engine.add_request(f"{name}-{i}", prompt, params)
        self.rounds: list[dict[str, float]] = []

    def prefill(self, num_requests: int) -> dict[str, float]:
        """Steps until every request has its first token: their time and parts."""
        started: set[str] = set()
        self.probe.take()
        start, steps = clock(), 0
        while len(started) < num_requests:
            started.update(o.request_id for o in self.engine.step() if o.outputs[0].token_ids)
            steps += 1
        return {"step": clock() - start, "steps": steps, **self.probe.take()}

    def decode_round(self, steps: int) -> None:
        self.engine.step()  # untimed: the first step after another variant's warms caches back up
        self.probe.take()
        start = clock()
        for _ in range(steps):
            self.engine.step()
        parts = {k: v / steps for k, v in self.probe.take().items()}
        self.rounds.append({"step": (clock() - start) / steps, **parts})

    def median(self) -> dict[str, float]:
        return {key: statistics.median(r[key] for r in self.rounds) for key in self.rounds[0]}


def breakdown(parts: dict[str, float]) -> str:
    """ms of the step and its parts (median over rounds)."""
    other = parts["forward"] - parts["linear"] - parts["attention"]
    host = parts["step"] - parts["forward"] - parts["lm_head"]
    return (f"{1e3 * parts['step']:8.2f} {1e3 * parts['forward']:8.2f} {1e3 * parts['linear']:7.2f} "
            f"{1e3 * parts['attention']:7.2f} {1e3 * other:7.2f} {1e3 * parts['lm_head']:7.2f} {1e3 * host:6.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama", help="fixture name or model directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[96, 160], metavar=("LO", "HI"))
    ap.add_argument("--steps", type=int, default=10, help="decode steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    ap.add_argument("--prefill", action="store_true", help="also time the prefill steps")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--kv-bytes", type=int, default=2 << 30, help="kv_cache_memory_bytes of each engine")
    ap.add_argument("--table", type=int, default=0, help="print the profiler's top N operators")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: this thread's CPU time")
    args = ap.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model if os.path.exists(args.model) else str(fixture_path(args.model))
    prompts = make_prompts(args.batch, *args.prompt_len, 1000, seed=0)
    load = os.getloadavg()[0]
    variants = []
    for name in args.variants:
        start = time.perf_counter()
        variants.append(Variant(name, args, model, prompts))
        print(f"{name}: engine up in {time.perf_counter() - start:.1f} s")
    for v in variants:
        parts = v.prefill(args.batch)
        if args.prefill:
            print(f"{v.name}: prefill {parts['steps']} steps, {parts['step']:.2f} s: forward {parts['forward']:.2f}, "
                  f"linear {parts['linear']:.2f}, attention {parts['attention']:.2f}, lm head {parts['lm_head']:.3f}")
    for _ in range(args.rounds):
        for v in variants:
            v.decode_round(args.steps)
    print(f"{args.dtype}, batch {args.batch}, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds of {args.steps} steps, "
          f"{args.clock} clock, load avg before {load:.2f}")
    print(f"{'variant':16} {'step ms':>8} {'forward':>8} {'linear':>7} {'attn':>7} {'other':>7} {'lm head':>7} "
          f"{'host':>6} {'tok/s':>7} {'vs first':>8}")
    first = variants[0].median()["step"]
    for v in variants:
        parts = v.median()
        print(f"{v.name:16} {breakdown(parts)} {args.batch / parts['step']:7.0f} {first / parts['step']:8.2f}")
    per_round = " ".join(f"{v.name}: " + ",".join(f"{1e3 * r['step']:.1f}" for r in v.rounds) for v in variants)
    print(f"per round (ms/step): {per_round}")
    for v in variants:
        parts = v.median()
        host = ", ".join(f"{key} {1e3 * parts[key]:.2f}" for key in dict.fromkeys(k for k, _, _ in HOST_PARTS))
        print(f"{v.name}: host parts (ms/step): {host} (sampling includes the sampler's own tensor work)")
    for v in variants if args.table else []:
        with torch.profiler.profile() as prof:
            for _ in range(3):
                v.engine.step()
        print(f"{v.name}: top operators of 3 decode steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
