"""Load, sleep, wake and unload a model in a running `llmd serve`, again and again, and
watch the memory of the daemon and its worker processes (psutil, resident set size; on
CUDA also the device's free memory, torch.cuda.mem_get_info): asleep at level 1 the KV
cache must be gone, at level 2 the weights too, and after the unload the memory must be
back close to where it was before the load (the model's weights, KV pool and worker
processes released, the freed heap handed back to the system). Also times each load,
sleep, wake and unload, as the client sees them (`client.load` / `sleep` / `wake` /
`unload`, each returning once done).

    python -m llmd_tools.bench_model_pool [--model DIR] [--executor uni|mp] [--device cpu|cuda] [--cycles 3] [--json]

The daemon serves a tiny default model (built if needed) and DIR as `[models.bench]`;
the default model answers one request first, so the code both use is already warm. Each
cycle: load; a request with a PROMPT_TOKENS-token prompt (its KV cache written, so the
KV pool's pages are resident); sleep level 1; wake; sleep level 2; wake; one short
request; unload."""
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
PROMPT_TOKENS = 768


@dataclass
class Cycle:
    before_mib: float  # the daemon and its children, before the load
    loaded_mib: float  # after the load and one long request to the model
    level1_mib: float  # asleep at level 1
    level2_mib: float  # asleep at level 2
    woken_mib: float  # woken from level 2, after a short request
    after_mib: float  # after the unload
    load_s: float
    sleep1_s: float
    wake1_s: float
    sleep2_s: float
    wake2_s: float
    unload_s: float
    model_mib: float  # what the daemon says the model held (weights and KV pool)
    kv_written_mib: float  # the KV cache the long request wrote
    # CUDA: the device's free memory at before / loaded / level1 / level2 / after (GiB); None on CPU.
    device_free_gib: list[float] | None = None


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


def start_daemon(model: str, executor: str, device: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    config = workdir / "llmd.toml"
    config.write_text(f'[models.bench]\npath = "{model}"\nkeep_alive = -1\n'
                      f'distributed_executor_backend = "{executor}"\nnum_gpu_blocks_override = 256\n'
                      f'max_model_len = {PROMPT_TOKENS + 256}\n')
    sock = str(workdir / "s.sock")
    log = (workdir / "llmd.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "llmd.cli", "serve", "--model", str(fixture_path("tiny-llama")),
                             "--socket", sock, "--config", str(config), "--max-model-len", "256",
                             "--num-gpu-blocks-override", "128", "--no-http", "--device", device],
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


def device_free(device: str) -> float | None:
    """The GPU's free memory in GiB (every process's allocations counted), None on CPU."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.mem_get_info()[0] / 2**30


def timed(call) -> tuple[object, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def measure(model: str, executor: str = "uni", cycles: int = 3, device: str = "cpu") -> list[Cycle]:
    """`cycles` load / request / sleep / wake / unload rounds of `model` in a fresh daemon."""
    prompt = [(7 * i) % 1000 + 3 for i in range(PROMPT_TOKENS)]
    with tempfile.TemporaryDirectory(prefix="llmd-pool-bench-") as tmp:
        proc, sock = start_daemon(model, executor, device, Path(tmp))
        out = []
        try:
            with Client(sock) as client:
                client.generate("def f(x):", max_tokens=8, temperature=0)  # the default model, warm
                for _ in range(cycles):
                    rss, free = [settled_rss(proc.pid)], [device_free(device)]
                    status, load_s = timed(lambda: client.load("bench"))
                    client.generate(token_ids=prompt, max_tokens=16, temperature=0, model="bench")
                    rss.append(settled_rss(proc.pid))
                    free.append(device_free(device))
                    _, sleep1_s = timed(lambda: client.sleep("bench", level=1))
                    rss.append(settled_rss(proc.pid))
                    free.append(device_free(device))
                    _, wake1_s = timed(lambda: client.wake("bench"))
                    _, sleep2_s = timed(lambda: client.sleep("bench", level=2))
                    rss.append(settled_rss(proc.pid))
                    free.append(device_free(device))
                    _, wake2_s = timed(lambda: client.wake("bench"))
                    client.generate(token_ids=prompt[:16], max_tokens=4, temperature=0, model="bench")
                    rss.append(settled_rss(proc.pid))
                    _, unload_s = timed(lambda: client.unload("bench"))
                    rss.append(settled_rss(proc.pid))
                    free.append(device_free(device))
                    kv_per_token = status.memory.kv_cache / (status.kv_blocks_total * 16)
                    out.append(Cycle(*(r / MIB for r in rss), load_s, sleep1_s, wake1_s, sleep2_s, wake2_s, unload_s,
                                     status.memory_bytes / MIB, (PROMPT_TOKENS + 16) * kv_per_token / MIB,
                                     None if free[0] is None else free))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the model to load and unload (default: small-llama)")
    parser.add_argument("--executor", choices=["uni", "mp"], default="uni")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = args.model or str(fixture_path("small-llama"))
    load_before = os.getloadavg()[0]
    cycles = measure(model, args.executor, args.cycles, args.device)
    if args.json:
        print(json.dumps([asdict(c) for c in cycles]))
        return 0
    print(f"model {Path(model).name}, executor {args.executor}, device {args.device}, "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| cycle | RSS before | loaded | asleep 1 | asleep 2 | woken | after unload | after - before "
          "| KV written | model holds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, c in enumerate(cycles, 1):
        print(f"| {i} | {c.before_mib:.0f} MiB | {c.loaded_mib:.0f} MiB | {c.level1_mib:.0f} MiB | "
              f"{c.level2_mib:.0f} MiB | {c.woken_mib:.0f} MiB | {c.after_mib:.0f} MiB | "
              f"{c.after_mib - c.before_mib:+.0f} MiB | {c.kv_written_mib:.0f} MiB | {c.model_mib:.0f} MiB |")
    print()
    print("| cycle | load | sleep 1 | wake 1 | sleep 2 | wake 2 | unload |")
    print("|---|---|---|---|---|---|---|")
    for i, c in enumerate(cycles, 1):
        print(f"| {i} | {c.load_s:.2f} s | {c.sleep1_s:.2f} s | {c.wake1_s:.2f} s | {c.sleep2_s:.2f} s | "
              f"{c.wake2_s:.2f} s | {c.unload_s:.2f} s |")
    if cycles and cycles[0].device_free_gib is not None:
        print()
        print("| cycle | GPU free before | loaded | asleep 1 | asleep 2 | after unload |")
        print("|---|---|---|---|---|---|")
        for i, c in enumerate(cycles, 1):
            print(f"| {i} | " + " | ".join(f"{g:.2f} GiB" for g in c.device_free_gib) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
