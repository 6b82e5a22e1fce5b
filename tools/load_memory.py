"""Where the memory of loading a model goes.

    python -m llmd_tools.load_memory [--model PATH] [--dtype float32] [--blocks 64] [--max-model-len 256] [--json]
    python -m llmd_tools.load_memory --serve [--executor uni|mp] [same options]

Steps (the default): this process loads the model with `LLM(...)` and reports, after
each step of the load (config, tokenizer, weights, the GGUF reader released, oneDNN
packing, the CPU kernels attached, the whole engine), its RSS and the step's own peak
(VmHWM, reset before the step through /proc/self/clear_refs), RssAnon and RssFile, in
MiB; the last row is the loaded engine (KV cache allocated) and the whole load's peak.
Run it as its own process: the first row is what the imports cost. Linux only.

`--serve`: starts `llmd serve --model PATH` on a temporary socket and reports VmHWM and
VmRSS of the daemon and of each of its worker processes once it serves, then stops it.
Default model: the built-in one.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The loader's steps, as llmd.gpu.models.loader names them.
STEPS = ("load_hf_config", "load_tokenizer", "load_weights", "release_gguf_readers", "pack_linears",
         "attach_cpu_kernels", "attach_gguf_kernels")
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def proc_status(pid: int | str = "self") -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon and RssFile of a process, MiB."""
    figures = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                figures[key] = int(value.split()[0]) / 1024
    return figures


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def measure_steps(model: str, dtype: str, blocks: int, max_model_len: int) -> list[dict[str, Any]]:
    """One row per step of an in-process load: {step, rss, peak, anon, file} in MiB."""
    import numpy  # noqa: F401  (what any load imports first: its cost is the first row)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import llmd.gpu.models.loader as loader

    rows: list[dict[str, Any]] = [_row("imports")]

    def timed(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            _reset_peak()
            result = step(*args, **kwargs)
            rows.append(_row(name))
            return result
        return run

    for name in STEPS:
        setattr(loader, name, timed(name, getattr(loader, name)))
    from llmd import LLM

    _reset_peak()
    LLM(model=model, dtype=dtype, num_gpu_blocks_override=blocks, max_model_len=max_model_len)
    loaded = _row("loaded: the whole load's peak")
    loaded["peak"] = max([loaded["peak"]] + [r["peak"] for r in rows[1:]])  # each step reset the peak
    rows.append(loaded)
    return rows


def _row(step: str) -> dict[str, Any]:
    s = proc_status()
    return {"step": step, "rss": s["VmRSS"], "peak": s["VmHWM"], "anon": s["RssAnon"], "file": s["RssFile"]}


def measure_serve(model: str, dtype: str, blocks: int, max_model_len: int, executor: str,
                  timeout: float = 900.0) -> dict[str, Any]:
    """VmHWM / VmRSS of `llmd serve` and its workers once it serves."""
    import psutil

    from llmd_client import Client, LlmdError

    with tempfile.TemporaryDirectory(prefix="llmd-load-memory-") as tmp:
        sock, log = str(Path(tmp) / "llmd.sock"), Path(tmp) / "llmd.log"
        cmd = [sys.executable, "-m", "llmd.cli", "serve", "--model", model, "--socket", sock, "--dtype", dtype,
               "--num-gpu-blocks-override", str(blocks), "--max-model-len", str(max_model_len),
               "--distributed-executor-backend", executor]
        with log.open("wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        started = time.monotonic()
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"llmd serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                if time.monotonic() - started > timeout:
                    raise SystemExit(f"llmd serve was not serving after {timeout:.0f} s")
                try:
                    if os.path.exists(sock) and Client(sock, timeout=10).status().engine_state != "loading":
                        break
                except (LlmdError, OSError):
                    pass
                time.sleep(0.2)
            ready_s = time.monotonic() - started
            workers = [proc_status(c.pid) for c in psutil.Process(proc.pid).children(recursive=True)]
            return {"executor": executor, "ready_s": ready_s, "daemon": proc_status(proc.pid), "workers": workers}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model directory or .gguf file (default: the built-in model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blocks", type=int, default=64, help="KV cache blocks (num_gpu_blocks_override)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--serve", action="store_true", help="measure `llmd serve` instead (module doc)")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni", help="--serve: where the model runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = args.model
    if not model:
        from llmd.builtin_model import builtin_model_path

        model = str(builtin_model_path())
    if args.serve:
        report: Any = measure_serve(model, args.dtype, args.blocks, args.max_model_len, args.executor)
        if args.json:
            print(json.dumps(report))
            return 0
        print(f"llmd serve --model {model} ({args.executor} executor): serving after {report['ready_s']:.1f} s")
        for name, s in [("daemon", report["daemon"])] + [(f"worker {i}", w) for i, w in enumerate(report["workers"])]:
            print(f"{name:<10} peak {s['VmHWM']:7.0f} MiB  now {s['VmRSS']:7.0f} MiB  "
                  f"(anon {s['RssAnon']:.0f}, file {s['RssFile']:.0f})")
        return 0
    rows = measure_steps(model, args.dtype, args.blocks, args.max_model_len)
    if args.json:
        print(json.dumps({"model": model, "steps": rows}))
        return 0
    print(f"{model}: RSS after each step of the load and the step's own peak (MiB)")
    print(f"{'step':<44} {'RSS':>7} {'peak':>7} {'anon':>7} {'file':>7}")
    for r in rows:
        print(f"{r['step']:<44} {r['rss']:>7.0f} {r['peak']:>7.0f} {r['anon']:>7.0f} {r['file']:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
