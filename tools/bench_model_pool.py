"""Load and unload a model in a running `llmd serve`, again and again, and watch the
memory of the daemon and its worker processes (psutil, resident set size): it must come
back close to where it was before the load (the unloaded model's weights, KV pool and
worker processes released, the freed heap handed back to the system). Also times each
load and unload, as the client sees them (`llmctl load` / `llmctl unload`).

    python -m llmd_tools.bench_model_pool --model DIR [--executor uni|mp] [--cycles 3] [--json]

The daemon serves a tiny default model (built if needed) and DIR as `[models.bench]`;
the default model answers one request first, so the code both use is already warm."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from llmd_client import Client
from llmd_tools.make_model import fixture_path

MIB = 1 << 20


@dataclass
class Cycle:
    before_mib: float  # the daemon and its children, before the load
    loaded_mib: float  # after the load and one request to the model
    after_mib: float  # after the unload
    load_s: float
    unload_s: float
    model_mib: float  # what the daemon says the model held (weights and KV pool)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def settled_rss(pid: int, seconds: float = 1.0) -> int:
    """The tree's RSS once exiting workers are gone and the figure stops moving."""
    time.sleep(seconds)
    return tree_rss(pid)


def start_daemon(model: str, executor: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    config = workdir / "llmd.toml"
    config.write_text(f'[models.bench]\npath = "{model}"\nkeep_alive = -1\n'
                      f'distributed_executor_backend = "{executor}"\nnum_gpu_blocks_override = 256\n')
    sock = str(workdir / "s.sock")
    log = (workdir / "llmd.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "llmd.cli", "serve", "--model", str(fixture_path("tiny-llama")),
                             "--socket", sock, "--config", str(config), "--max-model-len", "256",
                             "--num-gpu-blocks-override", "128", "--no-http", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited: {(workdir / 'llmd.log').read_text()[-2000:]}")
        try:
            with Client(sock) as client:
                if client.status().engine_state == "serving":
                    return proc, sock
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError("the daemon did not start")


def measure(model: str, executor: str = "uni", cycles: int = 3) -> list[Cycle]:
    """`cycles` load / request / unload rounds of `model` in a fresh daemon."""
    with tempfile.TemporaryDirectory(prefix="llmd-pool-bench-") as tmp:
        proc, sock = start_daemon(model, executor, Path(tmp))
        out = []
        try:
            with Client(sock) as client:
                client.generate("def f(x):", max_tokens=8, temperature=0)  # the default model, warm
                for _ in range(cycles):
                    before = settled_rss(proc.pid)
                    started = time.monotonic()
                    status = client.load("bench")
                    load_s = time.monotonic() - started
                    client.generate("def f(x):", max_tokens=16, temperature=0, model="bench")
                    loaded = settled_rss(proc.pid)
                    started = time.monotonic()
                    client.unload("bench")
                    unload_s = time.monotonic() - started
                    after = settled_rss(proc.pid)
                    out.append(Cycle(before / MIB, loaded / MIB, after / MIB, load_s, unload_s,
                                     status.memory_bytes / MIB))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the model to load and unload (default: small-llama)")
    parser.add_argument("--executor", choices=["uni", "mp"], default="uni")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = args.model or str(fixture_path("small-llama"))
    cycles = measure(model, args.executor, args.cycles)
    if args.json:
        print(json.dumps([asdict(c) for c in cycles]))
        return 0
    print(f"model {Path(model).name}, executor {args.executor}, load average {os.getloadavg()[0]:.1f}")
    print("| cycle | RSS before | loaded | after unload | after - before | model holds | load | unload |")
    print("|---|---|---|---|---|---|---|---|")
    for i, c in enumerate(cycles, 1):
        print(f"| {i} | {c.before_mib:.0f} MiB | {c.loaded_mib:.0f} MiB | {c.after_mib:.0f} MiB | "
              f"{c.after_mib - c.before_mib:+.0f} MiB | {c.model_mib:.0f} MiB | {c.load_s:.2f} s | {c.unload_s:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
