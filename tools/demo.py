"""The main job, end to end: start `llmd serve` on the built-in demo model, answer a
prompt through `llmctl`, show `llmctl status`, stop the daemon with SIGTERM.

    python -m llmd_tools.demo ["prompt"]

The demo model has random weights (nothing can be downloaded here), so its text is
gibberish; what the demo shows is the whole path a real model takes.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmd_tools.make_model import demo_model_path


def run(cmd: list[str]) -> int:
    print("$ " + " ".join(cmd[:3] + [repr(a) if " " in a else a for a in cmd[3:]]), flush=True)
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prompt = argv[0] if argv else "def main():"
    bindir = Path(sys.executable).parent
    llmd, llmctl = str(bindir / "llmd"), str(bindir / "llmctl")
    demo_model_path()  # build the demo model once (a few seconds) before timing anything
    tmp = Path(tempfile.mkdtemp(prefix="llmd-demo-"))
    sock = str(tmp / "llmd.sock")
    serve = [llmd, "serve", "--socket", sock, "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)]
    print("$ " + " ".join(serve) + " &", flush=True)
    daemon = subprocess.Popen(serve, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([llmctl, "--socket", sock, "status"], capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                print(daemon.stderr.read() if daemon.poll() is not None else "daemon did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
        code = run([llmctl, "--socket", sock, "submit", prompt, "--max-tokens", "48", "--temperature", "0.8",
                    "--seed", "0", "--no-stream"])
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
