"""One GGUF file, several engines, side by side: batch-1 decode speed, time to first
token and peak memory of llmd running the file packed (gguf_quant; float32 activations
meeting the packed weights in two int8 passes, or bfloat16 with `llmd-packed-bf16`;
`llmd-3p`: three passes, float32's precision; `llmd-int8`: the engine setting
cpu_int8_activations, one int8 pass over x, as llama.cpp; `-kv16`: a float16 KV cache, as
llama.cpp's default; `llmd-no-x16`: the float32 kernel; `llmd-no-greedy-head`: greedy rows'
logits at two passes, as before layers/greedy_head), llmd with every weight dequantized at load
(float32 and bfloat16), and llama.cpp through
llama-cpp-python when it is installed (the optional peer: `pip install -e '.[llamacpp]'`,
best with CMAKE_ARGS="-DGGML_NATIVE=ON" so it is built for this CPU).

    python -m llmd_tools.bench_gguf [--model PATH] [--rounds 3] [--prompt 128] [--tokens 128]
        [--threads 2] [--engines llmd llmd-packed-bf16 llmd-f32 llmd-bf16 llama.cpp]
        [--batch 32 [--batch-prompt N] [--batch-only]] [--baseline REV] [--json]
    python -m llmd_tools.bench_gguf --kernels [--model PATH] [--rows 1] [--calls 300] [--threads 2]
        [--passes 1 2 3] [--shape 1536x768 ... [--types Q4_K Q6_K ...]] [--json]

Each measurement runs in a fresh process (so its peak RSS is its own), the engines in
alternated rounds; reported: the median over rounds of decode tokens/s (the tokens after
the first over the time after the first), TTFT (a prompt of `--prompt` random token ids,
no prefix cache), peak RSS over the run, and the peak and the RSS once the model is
loaded (before the first token), with the machine's other load while it ran. Greedy, end
of text ignored, the same prompt for every engine (random ids among the file's normal
tokens). Default model: the built-in one; a 1B-class one of real shapes:
`python -m llmd_tools.make_gguf --name llama3.2-1b`.

`--batch N`: also N prompts (`--batch-prompt` tokens each) at once, `--tokens` each, in
the same alternated rounds: llmd's engine with max_num_seqs=N against llama.cpp's batched
decoding (one llama_decode per step for all sequences, as its `batched` example):
throughput (every generated token over the run's wall time), the time until every
sequence has its first token, decode tokens/s after that, and the same RSS figures
(bench_gguf_child says exactly what each engine runs). Each run's figures go to stderr as
one JSON line as soon as it ends. Both modes also report `same
tokens`: how much of each sequence's greedy output equals the first engine's (same_tokens).
`--baseline REV`: first of the engines, llmd as commit REV has it (`llmd@REV`: its code
imported from a temporary worktree, bench_commits.checkouts; its C++ kernels built there
at its first start, ~50 s on 2 cores, the worktree's paths being part of their build's
key), so that a change is measured against its parent in one run.

`--kernels`: the packed matmul alone, for each distinct (type, shape) of the file's
quantized weights: one call on `--rows` rows of float32 x of the float32 kernel over the
GGUF layout (`gguf_mm`, cpu_quant.cpp), of the int8 kernel over the x16 layout
(`gguf_mm_x16`, cpu_quant_x16.cpp: AVX-512 VNNI, or AVX2 where the CPU lacks it or
LLMD_GGUF_X16_ISA=avx2 says so) in each of `--passes`, and of
F.linear on the weight dequantized to float32 (the dense anchor), calls alternated (each
timed call right after an untimed one of the same: the weight in cache, as far as it
fits), medians, with the packed bytes read per second. `--shape NxK` (repeatable) times weights
of random blocks of that shape instead, one per type of `--types` (default: every packed
type).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

# Each run's figures: decode speed, time to first token, peak RSS over the whole run, and
# after the load (before the first token): the peak so far (VmHWM) and the RSS then. A
# llama.cpp model is memory-mapped: its RSS after the load counts the pages read so far.
FIGURES = ("decode_tok_s", "ttft_s", "peak_rss_mib", "load_peak_rss_mib", "loaded_rss_mib")
# A batched run's (--batch): every generated token over the run's wall time, the time
# until every sequence has its first token, the tokens after those over the time after.
BATCH_FIGURES = ("throughput_tok_s", "batch_ttft_s", "batch_decode_tok_s", "peak_rss_mib", "load_peak_rss_mib",
                 "loaded_rss_mib")
NORMAL_TOKEN = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL (tokenizer.ggml.token_type)
ENGINES = ("llmd", "llmd-kv16", "llmd-packed-bf16", "llmd-int8", "llmd-int8-kv16", "llmd-no-x16", "llmd-3p",
           "llmd-no-greedy-head", "llmd-f32", "llmd-bf16", "llama.cpp")
# Packed engines with another x16 setting (gguf_quant, cpu_kernels.X16_ENV): the float32
# kernel over the GGUF layout; three passes over x (float32's precision).
ENGINE_ENV = {"llmd-no-x16": {"LLMD_GGUF_X16": "0"}, "llmd-3p": {"LLMD_GGUF_X16": "3"}}


def available(engine: str) -> bool:
    if engine != "llama.cpp":
        return True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def measure(engine: str, model: str, prompts: Path, tokens: int, threads: int,
            trees: dict[str, Path] | None = None) -> dict:
    """One run of bench_gguf_child in a fresh process: `prompts` is a JSON file of token
    id lists (one: batch 1; several: all at once). `llmd@REV`: llmd as commit REV has it,
    imported from `trees[REV]` (bench_commits.checkouts)."""
    env, name = dict(os.environ, OMP_NUM_THREADS=str(threads), **ENGINE_ENV.get(engine, {})), engine
    if "@" in engine:
        from llmd_tools.bench_commits import env_for

        engine, rev = engine.split("@", 1)
        env = dict(env_for((trees or {})[rev]), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-m", "llmd_tools.bench_gguf_child", engine, model, str(prompts),
                          str(tokens), str(threads)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), engine=name)


def bench_prompts(model: str, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` random token ids, drawn from the file's normal tokens
    (tokenizer.ggml.token_type 1: no control, byte, unused or padding ids; a fixture's
    padded vocabulary rows are zeros), the same for every engine."""
    import numpy as np

    from llmd.gpu.models.gguf_file import GGUFFile

    g = GGUFFile(model)
    types = g.get("tokenizer.ggml.token_type")
    normal = (np.arange(len(g.require("tokenizer.ggml.tokens"))) if types is None
              else np.flatnonzero(np.asarray(types) == NORMAL_TOKEN))
    if len(normal) == 0:
        raise SystemExit(f"{model}: no normal tokens in its vocabulary to make prompts of")
    rng = np.random.default_rng(seed)
    return rng.choice(normal, size=(count, length)).tolist()


def kernel_weights(model: str, shapes: list[tuple[int, int]], types: list[str]) -> Iterator[tuple[str, str, Any]]:
    """(name, type, packed rows [N, row bytes]) of each weight to time: the first tensor of
    each distinct (type, shape) of the file, or random blocks of each type and shape."""
    import numpy as np
    import torch

    from llmd.gpu.layers.gguf_quant import FORMATS
    from llmd.gpu.models.gguf_file import GGUFFile
    from llmd_tools.gguf_blocks import random_blocks

    if shapes:
        for quant in types:
            if quant not in FORMATS:
                raise SystemExit(f"--types: {quant!r} is not a packed type ({', '.join(FORMATS)})")
            for n, k in shapes:
                if k % FORMATS[quant].block:
                    raise SystemExit(f"--shape {n}x{k}: {quant} rows are whole blocks of {FORMATS[quant].block}")
                yield f"random {n}x{k}", quant, random_blocks(quant, n, k)
        return
    seen = set()
    g = GGUFFile(model)
    for t in g.tensors.values():
        quant, shape = t.tensor_type.name, tuple(t.torch_shape)
        if quant not in FORMATS or len(shape) != 2 or (quant, shape) in seen:
            continue
        seen.add((quant, shape))
        yield t.name, quant, torch.from_numpy(np.array(g.tensor_data(t), dtype=np.uint8).reshape(shape[0], -1))


def kernel_figures(model: str, rows: int, calls: int = 300, passes: tuple[int, ...] = (1, 2, 3),
                   shapes: list[tuple[int, int]] | None = None, types: list[str] | None = None) -> list[dict]:
    """Per weight (kernel_weights): median µs of the float32 kernel (`packed_us`), of the
    x16 kernel in each of `passes` (`x16_us`: {passes: µs}; empty without it or with
    rows not in groups of 16) and of the dense F.linear, calls alternated."""
    import torch

    from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
    from llmd.gpu.layers.gguf_quant import FORMATS, PACKED_TYPES, X16_GROUP, dequantize

    ops = gguf_ops()
    if ops is None:
        raise SystemExit("the CPU kernels cannot be built here")
    figures = []
    for name, quant, w in kernel_weights(model, shapes or [], types or list(PACKED_TYPES)):
        code, n = FORMATS[quant].code, w.shape[0]
        cols = w.shape[1] // FORMATS[quant].block_bytes * FORMATS[quant].block
        dense = dequantize(w, quant, cols)
        x = torch.randn(rows, cols)
        runs: dict[str, Callable[[], Any]] = {"packed": lambda: ops.mm(x, w, code, cols),
                                              "dense": lambda: torch.nn.functional.linear(x, dense)}
        if ops.x16 and n % X16_GROUP == 0:
            w16 = ops.repack_x16(w, code, cols)
            for p in passes:
                runs[f"x16_{p}"] = lambda p=p: ops.mm_x16(x, w16, code, cols, p)
        times: dict[str, list[float]] = {key: [] for key in runs}
        for i in range(calls + 10):
            for key, run in runs.items():
                run()  # the weight back in cache after the others' (the dense one evicts it): hot figures
                start = time.perf_counter()
                run()
                if i >= 10:  # warm-up
                    times[key].append(time.perf_counter() - start)
        us = {key: statistics.median(t) * 1e6 for key, t in times.items()}
        figures.append({"tensor": name, "quant": quant, "rows": n, "cols": cols, "packed_us": us["packed"],
                        "x16_us": {p: us[f"x16_{p}"] for p in passes if f"x16_{p}" in us},
                        "dense_f32_us": us["dense"], "packed_gb_s": w.numel() / us["packed"] / 1e3})
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a .gguf file (default: the built-in model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--batch", type=int, default=0,
                        help="also N sequences at once (throughput against llama.cpp's batched decoding)")
    parser.add_argument("--batch-prompt", type=int, default=0, help="--batch: each prompt's tokens (default --prompt)")
    parser.add_argument("--batch-only", action="store_true", help="--batch: skip the batch-1 runs")
    parser.add_argument("--baseline", default="", metavar="REV",
                        help="also llmd as commit REV has it (engine llmd@REV, a temporary worktree), alternated")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="time the packed matmul alone (module doc)")
    parser.add_argument("--rows", type=int, default=1, help="--kernels: rows of x")
    parser.add_argument("--calls", type=int, default=300, help="--kernels: timed calls of each")
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                        help="--kernels: the x16 kernel's passes over x to time")
    parser.add_argument("--shape", type=_shape, action="append", default=[],
                        help="--kernels: time random blocks of this NxK (rows x cols) instead of the file's weights")
    parser.add_argument("--types", nargs="+", default=None, help="--kernels --shape: the packed types (default: all)")
    args = parser.parse_args(argv)
    model = args.model
    if not model:
        from llmd.builtin_model import builtin_model_path

        model = str(builtin_model_path())
    if args.kernels:
        return _report_kernels(model, args)
    if args.batch_only and not args.batch:
        parser.error("--batch-only needs --batch N")
    engines = [e for e in args.engines if available(e)]
    skipped = sorted(set(args.engines) - set(engines))
    if args.baseline:
        from llmd_tools.bench_commits import checkouts

        engines.insert(0, f"llmd@{args.baseline}")
        with checkouts([args.baseline], "bench_gguf-baseline-") as trees:
            return _run(args, model, engines, skipped, trees)
    return _run(args, model, engines, skipped, {})


def _run(args: argparse.Namespace, model: str, engines: list[str], skipped: list[str],
         trees: dict[str, Path]) -> int:
    with tempfile.TemporaryDirectory(prefix="bench_gguf-") as tmp:
        workloads = {}  # mode -> (prompts file, tokens per sequence)
        if not args.batch_only:
            workloads["single"] = _prompts_file(Path(tmp) / "single.json", bench_prompts(model, 1, args.prompt))
        if args.batch:
            workloads["batched"] = _prompts_file(Path(tmp) / "batched.json",
                                                 bench_prompts(model, args.batch, args.batch_prompt or args.prompt,
                                                               seed=1))
        runs: dict[str, dict[str, list[dict]]] = {mode: {e: [] for e in engines} for mode in workloads}
        _other_load()  # starts each process's CPU counter
        started = time.monotonic()
        others = []
        for i in range(args.rounds):
            for mode, prompts in workloads.items():
                for engine in engines:  # alternated: each round runs every engine once in each mode
                    run = measure(engine, model, prompts, args.tokens, args.threads, trees)
                    runs[mode][engine].append(run)
                    others.append(_other_load())
                    # as it comes (a long run cut short keeps what it measured)
                    print(json.dumps({"round": i + 1, "mode": mode, "load_average_1min": os.getloadavg()[0],
                                      **{k: v for k, v in run.items() if k != "tokens"}}), file=sys.stderr)
    report = {"model": model, "threads": args.threads, "prompt": args.prompt, "tokens": args.tokens,
              "rounds": args.rounds, "skipped": skipped, "seconds": round(time.monotonic() - started, 1),
              "other_load_cores_max": max(others, default=0.0), "load_average_1min_end": os.getloadavg()[0]}
    if "single" in runs:
        report["engines"] = _medians(runs["single"], FIGURES)
    if "batched" in runs:
        report.update(batch=args.batch, batch_prompt=args.batch_prompt or args.prompt,
                      batched=_medians(runs["batched"], BATCH_FIGURES))
    if args.json:
        print(json.dumps(report))
        return 0
    _print_report(report)
    return 0


def _prompts_file(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text(json.dumps(prompts))
    return path


def _medians(runs: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per engine: the median over rounds of each figure, and `same_tokens` (same_tokens)."""
    same = same_tokens(runs)
    return {e: {**{key: statistics.median(r[key] for r in rs) for key in keys}, "same_tokens": same[e]}
            for e, rs in runs.items()}


def same_tokens(runs: dict[str, list[dict]]) -> dict[str, float]:
    """Per engine: the share of each sequence's greedy tokens, up to its first difference,
    equal to the first engine's in the same round (mean over sequences, median over
    rounds): 1.0 where both engines decoded the same; on random weights and quantized
    arithmetic a path may part after a near tie, but a wrong position, sequence or
    prompt parts at once."""
    reference = next(iter(runs.values()))
    shares = {}
    for engine, rounds in runs.items():
        per_round = []
        for run, ref in zip(rounds, reference):
            per_seq = [_common_prefix(a, b) / max(len(b), 1) for a, b in zip(run["tokens"], ref["tokens"])]
            per_round.append(sum(per_seq) / len(per_seq))
        shares[engine] = statistics.median(per_round)
    return shares


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _print_report(report: dict) -> None:
    print(f"{report['model']}: {report['threads']} threads, {report['rounds']} alternated rounds (medians); other "
          f"load up to {report['other_load_cores_max']:.2f} cores (processes seen), load average "
          f"{report['load_average_1min_end']:.2f} at the end (every tenant)")
    if "engines" in report:
        print(f"batch 1: prompt {report['prompt']}, {report['tokens']} greedy tokens")
        print(f"{'engine':<16} {'decode tok/s':>13} {'TTFT ms':>9} {'peak RSS MiB':>13} {'load peak MiB':>14} "
              f"{'RSS loaded MiB':>15} {'same tokens':>12}")
        for engine, r in report["engines"].items():
            print(f"{engine:<16} {r['decode_tok_s']:>13.1f} {r['ttft_s'] * 1000:>9.1f} {r['peak_rss_mib']:>13.0f} "
                  f"{r['load_peak_rss_mib']:>14.0f} {r['loaded_rss_mib']:>15.0f} {r['same_tokens']:>12.0%}")
    if "batched" in report:
        print(f"{report['batch']} sequences at once: prompts of {report['batch_prompt']}, {report['tokens']} greedy "
              "tokens each")
        print(f"{'engine':<16} {'tok/s':>9} {'all first ms':>13} {'decode tok/s':>13} {'peak RSS MiB':>13} "
              f"{'RSS loaded MiB':>15} {'same tokens':>12}")
        for engine, r in report["batched"].items():
            print(f"{engine:<16} {r['throughput_tok_s']:>9.1f} {r['batch_ttft_s'] * 1000:>13.0f} "
                  f"{r['batch_decode_tok_s']:>13.1f} {r['peak_rss_mib']:>13.0f} {r['loaded_rss_mib']:>15.0f} "
                  f"{r['same_tokens']:>12.0%}")
    if report["skipped"]:
        print(f"not run (not installed): {', '.join(report['skipped'])}")


def _report_kernels(model: str, args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    _other_load()
    passes = tuple(sorted(set(args.passes)))
    figures = kernel_figures(model, args.rows, args.calls, passes, args.shape, args.types)
    other, load = _other_load(), os.getloadavg()[0]
    if args.json:
        print(json.dumps({"model": model, "threads": args.threads, "x_rows": args.rows, "other_load_cores": other,
                          "load_average_1min_end": load, "kernels": figures}))
        return 0
    print(f"{model if not args.shape else 'random blocks'}: x float32 [{args.rows}, cols], {args.threads} threads, "
          f"medians of alternated calls (us); other load {other:.2f} cores (processes seen), load average "
          f"{load:.2f} at the end (every tenant)")
    x16_heads = "".join(f" {f'x16 {p}p':>8}" for p in passes)
    print(f"{'weight (first tensor)':<26} {'type':<5} {'rows x cols':>13} {'f32 kernel':>10}{x16_heads} "
          f"{'dense f32':>10} {'f32 kernel GB/s':>16}")
    for f in figures:
        x16 = "".join(f" {f['x16_us'][p]:>8.1f}" if p in f["x16_us"] else f" {'-':>8}" for p in passes)
        print(f"{f['tensor']:<26} {f['quant']:<5} {f['rows']:>6} x {f['cols']:<5} {f['packed_us']:>10.1f}{x16} "
              f"{f['dense_f32_us']:>10.1f} {f['packed_gb_s']:>16.2f}")
    return 0


def _shape(text: str) -> tuple[int, int]:
    """"1536x768" -> (1536, 768)."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is ROWSxCOLS, e.g. 1536x768, got {text!r}") from None
    if n <= 0 or k <= 0:
        raise argparse.ArgumentTypeError(f"a shape's rows and cols are positive, got {text!r}")
    return n, k


def _other_load() -> float:
    """Cores busy with processes other than this one and its children, sampled now."""
    me = psutil.Process()
    mine = {me.pid, *(c.pid for c in me.children(recursive=True))}
    busy = 0.0
    for proc in psutil.process_iter(["pid", "cpu_percent"]):
        if proc.info["pid"] not in mine and proc.info["cpu_percent"]:
            busy += proc.info["cpu_percent"] / 100
    return busy


if __name__ == "__main__":
    sys.exit(main())
