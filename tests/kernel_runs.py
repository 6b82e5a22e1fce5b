"""Running a Triton kernel cases script (triton_attention_cases.py, fused_moe_cases.py,
test_fused_ops.py) in fresh processes, where its cases build their inputs on CPU and run
them on one device:

- "cpu": in Triton's interpreter (TRITON_INTERPRET=1, chosen when triton is first
  imported, so a fresh process): what every machine can check;
- "cuda": the same cases compiled for the GPU (no interpreter), where one is present:
  the kernels' real code generation, launch grids and dtypes, which the interpreter
  does not exercise (it widens bf16, runs every program one after another).

A script takes `--device cpu|cuda` among its arguments (`script_device` reads it) and
prints one JSON line per case; `run_case_scripts` starts them side by side and gathers
the lines.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICES = ("cpu", "cuda")


def script_device(args: list[str]) -> torch.device:
    """The device a cases script runs on: `--device NAME` removed from args (default
    cpu). CPU needs the interpreter; CUDA must not have it (it would run on the CPU)."""
    name = "cpu"
    if "--device" in args:
        i = args.index("--device")
        name = args[i + 1]
        del args[i:i + 2]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if name == "cpu" and not interpreted:
        sys.exit("run with TRITON_INTERPRET=1 (on CPU the kernels need Triton's interpreter), or --device cuda")
    if name == "cuda" and interpreted:
        sys.exit("--device cuda runs the compiled kernels: unset TRITON_INTERPRET")
    return torch.device(name)


def run_case_scripts(jobs: list[tuple[Path, list[str]]], device: str, timeout: float = 600) -> dict[str, dict]:
    """case name -> result, from each (script, args) run on `device` in its own process,
    side by side. On "cuda" it skips (the calling test) where no GPU is present."""
    pytest.importorskip("triton")
    env = {**os.environ}
    env.pop("LLMD_FUSED_OPS", None)
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    procs = [subprocess.Popen([sys.executable, str(script), *args, "--device", device], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for script, args in jobs]
    results = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-4000:]
            for line in stdout.splitlines():
                if line.startswith("{"):
                    result = json.loads(line)
                    results[result["case"]] = result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def case_result(results: dict[str, dict], name: str) -> dict:
    """One case's result, failing on a case the script reported as an error (or never ran)."""
    assert name in results, f"case {name} did not run"
    result = results[name]
    assert "error" not in result, result["error"]
    return result
