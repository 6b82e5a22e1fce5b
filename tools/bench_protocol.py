"""Protocol cost of the daemon: Status round trips per second on one connection, and
the time from Submit to the first streamed Output minus the engine's own first step
(prefill + sample of the same prompt, measured in-process in the same run).

    python -m llmd_tools.bench_protocol [--model tiny-llama] [--round-trips 2000] [--requests 50]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from llmd_tools.make_model import fixture_path


class Conn:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.buf = b""

    def send(self, message: dict) -> None:
        body = msgspec.msgpack.encode(message)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def recv(self) -> dict:
        while True:
            if len(self.buf) >= 4:
                (size,) = struct.unpack(">I", self.buf[:4])
                if len(self.buf) >= 4 + size:
                    body, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
                    return msgspec.msgpack.decode(body)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--round-trips", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=50)
    args = ap.parse_args(argv)
    model = args.model if os.path.isdir(args.model) else str(fixture_path(args.model))
    prompts = [[5 + (i * 7 + j) % 900 for j in range(64)] for i in range(args.requests)]

    # The engine's own first step for the same prompts, in this process.
    from llmd import LLM, SamplingParams
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=256, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("warm", prompts[0], params)
    while engine.has_unfinished_requests():
        engine.step()
    step_times = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()

    tmp = Path(tempfile.mkdtemp())
    path = str(tmp / "bench.sock")
    proc = subprocess.Popen([sys.executable, "-m", "llmd.cli", "serve", "--model", model, "--socket", path,
                             "--max-model-len", "256", "--num-gpu-blocks-override", "256",
                             "--no-enable-prefix-caching", "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = Conn(path)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("daemon did not start")
                time.sleep(0.05)
        conn.send({"type": "status"})
        conn.recv()
        start = time.perf_counter()
        for _ in range(args.round_trips):
            conn.send({"type": "status"})
            conn.recv()
        rtt = time.perf_counter() - start
        ttfb = []
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            conn.send({"type": "submit", "id": f"q{i}", "token_ids": prompt,
                       "sampling": {"temperature": 0, "max_tokens": 1}})
            while conn.recv()["type"] != "output":  # max_tokens=1: this Output is also the last
                pass
            ttfb.append(time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(30)
    step_ms = statistics.median(step_times) * 1e3
    ttfb_ms = statistics.median(ttfb) * 1e3
    print(f"model {model}")
    print(f"Status round trips: {args.round_trips / rtt:,.0f}/s ({rtt / args.round_trips * 1e6:.0f} us each)")
    print(f"Submit -> first Output: median {ttfb_ms:.2f} ms; engine first step in-process: median {step_ms:.2f} ms; "
          f"protocol + actors: {ttfb_ms - step_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
