"""Where one decode step's time goes: wall time against kernel time, kernel and memcpy
counts, graph replay, and the bandwidth roofline beside the measured step.

    python -m llmd_tools.profile_step [--model tiny-llama|DIR] [--device auto|cpu|cuda]
        [--dtype auto|float32|bfloat16|float16] [--batch 1] [--steps 20] [--input-len 32]
        [--warmup 5] [--enforce-eager] [--guided] [--top 15] [--trace FILE] [--json]

It builds the offline engine, prefills `--batch` prompts of `--input-len` random tokens
(greedy, ignore_eos, long enough that none finishes; with `--guided` each under
bench_guided's JSON schema, which no request can complete), runs `--warmup` decode steps, then
`--steps` decode steps twice: first timed with the host clock around engine.step() (the
wall time per step), then under torch.profiler (CUDA and CPU activities on CUDA, CPU
only on CPU), each step inside a `llmd_step` range. From the profiled steps it prints:

- GPU busy per step: the union of the kernel intervals (overlapping streams counted
  once), beside the wall time of the same profiled steps: the gap is launch overhead,
  host work and waiting;
- kernels executed per step, launch calls per step (cudaLaunchKernel, cuLaunchKernel)
  and cudaGraphLaunch calls per step: a forward replayed from a CUDA graph shows one
  graph launch and few launch calls;
- the top kernels by total time, with their counts per step;
- memcpys per step by kind (DtoH, HtoD, DtoD) with their bytes, and the host's blocking
  calls (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize, blocking
  cudaMemcpy): a step at the hardware's limit reads back one small buffer, not more;
- the memory-bandwidth roofline: the weights (from the safetensors headers: every
  tensor but an untied input embedding, so a MoE model's idle experts count too) plus
  the KV cache the step reads (batch x mean context x K/V bytes per token), over the
  bandwidth of a large device-to-device copy measured here (bytes read + written), as a
  time, and that time over the measured wall time per step: the fraction of the roofline
  reached (issue 13's batch-1 figure: 0.69 ms of 2.98 ms, 23%).

On CPU there are no kernels: the "kernels" are the top-level torch operators (ops not
inside another op on the same thread), busy is the union of their intervals, there are
no memcpy or graph figures, and the roofline's bandwidth is a host memory copy's (a
model small enough to stay in the CPU caches can beat it: a fraction above 1).

LLMD_FUSED_OPS (llmd.gpu.layers.fused_ops) passes through to the engine: run with =0 and
unset for the fused ops' A/B. The profiler costs host time per op, so the profiled
wall is longer than the timed one; kernel durations are not affected.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from llmd import LLM, GuidedDecodingParams, SamplingParams
from llmd.config import KV_CACHE_DTYPES, read_model_info
from llmd_tools.bench.roofline import device_bandwidth, weight_elements
from llmd_tools.bench.workloads import make_prompts
from llmd_tools.make_model import fixture_path

STEP_RANGE = "llmd_step"
BLOCK_SIZE = 16  # KV block size (the engine's default)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
HOST_COPY_BYTES = 64 << 20  # the CPU roofline's copy: past the caches, quick on a busy machine
HOST_COPY_REPEATS = 5


# --- the engine, decoding -----------------------------------------------------------------------------


def build_engine(args: argparse.Namespace) -> LLM:
    """The offline engine sized for `--batch` requests of the prompt plus every step: a
    KV pool of just their blocks (the CPU's default sizing would take a quarter of the RAM)."""
    model = args.model if os.path.exists(args.model) else str(fixture_path(args.model))
    max_len = args.input_len + args.warmup + 2 * args.steps + 16
    blocks = args.batch * -(-max_len // BLOCK_SIZE) + 1
    return LLM(model=model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=max_len,
               max_num_batched_tokens=max(2048, args.batch * args.input_len), enforce_eager=args.enforce_eager,
               enable_prefix_caching=False, block_size=BLOCK_SIZE, num_gpu_blocks_override=blocks,
               kv_cache_dtype=args.kv_cache_dtype)


def start_decoding(llm: LLM, args: argparse.Namespace) -> None:
    """Prefill the batch's prompts (steps until every request has its first token), then
    the warm-up decode steps; afterwards every step is one decode step of the batch."""
    engine = llm.engine
    vocab = min(len(llm.tokenizer), engine.vocab_size)
    guided = None
    if args.guided:  # bench_guided's schema: no request can end before max_tokens
        from llmd_tools.bench_guided import SCHEMA

        guided = GuidedDecodingParams(json_schema=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=args.warmup + 2 * args.steps + 8, ignore_eos=not args.guided,
                            guided=guided)
    ids = [engine.add_request(f"profile-{i}", prompt, params)
           for i, prompt in enumerate(make_prompts(args.batch, args.input_len, args.input_len, vocab, seed=0))]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    for _ in range(args.warmup):
        engine.step()


def timed_steps(llm: LLM, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps, by the host clock around step()."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def profiled_steps(llm: LLM, steps: int, cuda: bool, trace_path: Path) -> tuple[list[float], list[dict]]:
    """(wall seconds of each step, the trace's complete events) of `steps` engine steps
    under torch.profiler, each inside a STEP_RANGE range."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    seconds = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            with torch.profiler.record_function(STEP_RANGE):
                llm.engine.step()  # returns once the host has the step's tokens: no sync added
            seconds.append(time.perf_counter() - start)
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    return seconds, [e for e in events if e.get("ph") == "X" and "dur" in e]


# --- the trace --------------------------------------------------------------------------------------------


def _category(event: dict) -> str:
    return str(event.get("cat", "")).lower()


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Microseconds covered by (start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def top_level_ops(events: list[dict]) -> list[dict]:
    """The CPU operators not inside another operator on the same thread: on CPU, what a
    kernel is on CUDA (disjoint per thread, their times add up)."""
    by_thread: dict[Any, list[dict]] = defaultdict(list)
    for event in events:
        if _category(event) == "cpu_op":
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    top = []
    for ops in by_thread.values():
        end = float("-inf")
        for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
            if op["ts"] >= end:
                top.append(op)
                end = op["ts"] + op["dur"]
    return top


def memcpy_kind(name: str) -> str:
    """"DtoH", "HtoD", "DtoD", ... of a gpu_memcpy event's name ("Memcpy DtoH (Device -> Pinned)")."""
    match = re.search(r"Memcpy (\w+)", name)
    return match.group(1) if match else name


def kernel_table(kernels: list[dict], steps: int, top: int) -> list[dict]:
    """The `top` kernels by total time: name, count per step, total ms, mean µs."""
    total: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for kernel in kernels:
        total[kernel["name"]] += kernel["dur"]
        count[kernel["name"]] += 1
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:top]
    return [{"name": name, "per_step": count[name] / steps, "total_ms": total[name] / 1e3,
             "mean_us": total[name] / count[name]} for name in ranked]


def runtime_calls(events: list[dict], steps: int) -> dict[str, Any]:
    """Per step: launch calls, graph launches, blocking host calls by name (CUDA runtime
    and driver events)."""
    calls = Counter(e["name"] for e in events if _category(e) in ("cuda_runtime", "cuda_driver"))
    syncs = {name: n / steps for name, n in sorted(calls.items())
             if name.startswith(SYNC_CALLS) or name == "cudaMemcpy"}
    return {"launch_calls_per_step": sum(n for name, n in calls.items() if name.startswith(LAUNCH_CALLS)) / steps,
            "graph_launches_per_step": sum(n for name, n in calls.items() if name.startswith("cudaGraphLaunch")) / steps,
            "host_syncs_per_step": syncs}


def memcpys(events: list[dict], steps: int) -> dict[str, dict[str, float]]:
    """Per memcpy kind: copies and bytes per step."""
    kinds: dict[str, dict[str, float]] = {}
    for event in events:
        if _category(event) == "gpu_memcpy":
            kind = kinds.setdefault(memcpy_kind(event["name"]), {"count_per_step": 0.0, "bytes_per_step": 0.0})
            kind["count_per_step"] += 1 / steps
            kind["bytes_per_step"] += event.get("args", {}).get("bytes", 0) / steps
    return kinds


def summarize(events: list[dict], steps: int, cuda: bool, top: int) -> dict[str, Any]:
    """The per-step figures of a profiled run (module docstring)."""
    ranges = [e for e in events if e["name"] == STEP_RANGE and _category(e) == "user_annotation"]
    kernels = [e for e in events if _category(e) == "kernel"] if cuda else top_level_ops(events)
    summary = {"profiled_steps": len(ranges),
               "busy_ms": union_us((k["ts"], k["ts"] + k["dur"]) for k in kernels) / 1e3 / steps,
               "kernels_per_step": len(kernels) / steps,
               "top_kernels": kernel_table(kernels, steps, top)}
    if cuda:
        calls = runtime_calls(events, steps)
        summary.update(calls, graph_replay=calls["graph_launches_per_step"] >= 1, memcpy=memcpys(events, steps))
    return summary


# --- the roofline -----------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large copy on the device (each byte read and written): CUDA's
    timed with events (llmd_tools.bench.roofline), the CPU's with the host clock, the
    best of a few copies (the others' load only slows a copy down)."""
    if device.type == "cuda":
        return device_bandwidth(device)
    src = torch.ones(HOST_COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(HOST_COPY_REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * HOST_COPY_BYTES / best


def roofline(llm: LLM, batch: int, mean_context: float, step_s: float) -> dict[str, Any] | None:
    """The step's bytes (weights + the KV it reads) over the measured copy bandwidth, and
    that time over `step_s`; None when the model has no safetensors to count."""
    engine = llm.engine
    model_dir = Path(engine.model_dir)
    elements = weight_elements(model_dir) if model_dir.is_dir() else 0
    if not elements:
        return None
    itemsize = engine.dtype.itemsize
    tp = engine.config.tensor_parallel_size
    info = read_model_info(model_dir)
    kv_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * itemsize
    weight_bytes = elements * itemsize / tp
    kv_bytes = batch * mean_context * kv_per_token / tp
    bandwidth = copy_bandwidth(engine.device)
    roofline_s = (weight_bytes + kv_bytes) / bandwidth
    return {"bandwidth_gbs": bandwidth / 1e9, "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
            "mean_context": mean_context, "roofline_ms": roofline_s * 1e3, "step_ms": step_s * 1e3,
            "fraction": roofline_s / step_s}


# --- the report -------------------------------------------------------------------------------------------


def _ms_stats(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "min": min(ms), "max": max(ms)}


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm up, time, profile: the report as a dict (what --json prints)."""
    llm = build_engine(args)
    engine = llm.engine
    cuda = engine.device.type == "cuda"
    start_decoding(llm, args)
    wall = timed_steps(llm, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(args.trace) if args.trace else Path(tmp) / "trace.json"
        profiled_wall, events = profiled_steps(llm, args.steps, cuda, trace_path)
    summary = summarize(events, args.steps, cuda, args.top)
    # The timed steps' context: the prompt, the first token and the warm-up tokens, then one more each step.
    mean_context = args.input_len + 1 + args.warmup + (args.steps - 1) / 2
    report = {
        "model": str(engine.model_dir), "device": torch.cuda.get_device_name(engine.device) if cuda else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."), "batch": args.batch, "input_len": args.input_len,
        "steps": args.steps, "warmup": args.warmup, "cuda_graphs": cuda and not engine.config.enforce_eager,
        "fused_ops": os.environ.get("LLMD_FUSED_OPS", "auto"), "guided": args.guided,
        "torch_threads": None if cuda else torch.get_num_threads(), "loadavg": os.getloadavg()[0],
        "wall_ms": _ms_stats(wall), "profiled_wall_ms": _ms_stats(profiled_wall), **summary,
        "roofline": roofline(llm, args.batch, mean_context, statistics.fmean(wall)),
    }
    report["busy_fraction"] = report["busy_ms"] / report["profiled_wall_ms"]["mean"]
    engine.shutdown()
    return report


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _device_lines(r: dict[str, Any]) -> list[str]:
    """The CUDA-only lines: launches, graph replay, memcpys, host syncs."""
    replay = "the forward replays a CUDA graph" if r["graph_replay"] else "no graph replay (eager)"
    copies = ", ".join(f"{kind} {c['count_per_step']:.1f} x, {_bytes(c['bytes_per_step'])}"
                       for kind, c in sorted(r["memcpy"].items())) or "none"
    syncs = ", ".join(f"{name} {n:.1f}" for name, n in r["host_syncs_per_step"].items()) or "none"
    return [f"launches per step   {r['launch_calls_per_step']:.1f} kernel launch calls, "
            f"{r['graph_launches_per_step']:.1f} cudaGraphLaunch: {replay}",
            f"memcpy per step     {copies}",
            f"host syncs per step {syncs}"]


def render(r: dict[str, Any]) -> str:
    """The report as text."""
    cuda = "memcpy" in r
    wall, profiled = r["wall_ms"], r["profiled_wall_ms"]
    unit = "kernels" if cuda else "top-level CPU ops"
    lines = [f"profile_step: {r['model']}",
             f"{r['device']}, {r['dtype']}, batch {r['batch']}, {r['steps']} decode steps after {r['input_len']}-token "
             f"prompts and {r['warmup']} warm-up steps; CUDA graphs {'on' if r['cuda_graphs'] else 'off'}, "
             f"LLMD_FUSED_OPS={r['fused_ops']}, "
             + ("every request guided by a JSON schema, " if r.get("guided") else "")
             + (f"torch threads {r['torch_threads']}, " if r.get("torch_threads") else "")
             + f"load avg {r['loadavg']:.2f}",
             f"wall per step       {wall['mean']:.3f} ms (median {wall['median']:.3f}, min {wall['min']:.3f}, "
             f"max {wall['max']:.3f}); under the profiler {profiled['mean']:.3f} ms",
             f"{'GPU' if cuda else 'CPU'} busy per step   {r['busy_ms']:.3f} ms = {r['busy_fraction']:.0%} of the "
             f"profiled wall (union of the {unit}' intervals)",
             f"{unit} per step  {r['kernels_per_step']:.1f}"]
    if cuda:
        lines += _device_lines(r)
    roof = r["roofline"]
    if roof is not None:
        lines.append(f"roofline            weights {_bytes(roof['weight_bytes'])} + KV {_bytes(roof['kv_bytes_per_step'])}"
                     f" per step at {roof['bandwidth_gbs']:.0f} GB/s (measured copy) = {roof['roofline_ms']:.3f} ms; "
                     f"measured {roof['step_ms']:.3f} ms: {roof['fraction']:.1%} of the roofline")
    lines.append(f"top {unit} ({r['steps']} steps):  total ms  per step  mean us  name")
    lines += [f"  {k['total_ms']:10.3f} {k['per_step']:9.1f} {k['mean_us']:8.1f}  {k['name'][:100]}"
              for k in r["top_kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="fixture name or model directory")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--guided", action="store_true", help="every request guided by bench_guided's JSON schema")
    ap.add_argument("--top", type=int, default=15, help="kernels (CPU: operators) in the table")
    ap.add_argument("--trace", default=None, help="also keep the profiler's Chrome trace in this file")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.input_len < 1 or args.warmup < 0:
        ap.error("--batch, --steps and --input-len must be >= 1, --warmup >= 0")
    report = profile(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
