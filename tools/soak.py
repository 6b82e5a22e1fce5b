"""Soak test: many concurrent streaming clients, each on its own connection, for a long
time, against a daemon it starts on the tiny fixture (or a running one). Every request
must end with its final message; the daemon's memory must stay flat once warm.

    python -m llmd_tools.soak --clients 256 --minutes 10 [--socket PATH] [--json]

Reports completed / lost (no final message, or the connection dropped) / refused
requests, tokens streamed, and the daemon's RSS: after the warm-up (the anchor), at its
peak, and at the end, with the growth from the anchor."""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil

from llmd_client import AsyncClient
from llmd_client.errors import ConnectionLost, LlmdError, RequestError


class SoakReport(msgspec.Struct, kw_only=True):
    clients: int
    duration_s: float
    completed: int
    lost: int
    refused: int
    tokens: int
    rss_after_warmup_bytes: int
    rss_peak_bytes: int
    rss_end_bytes: int
    errors: list[str]

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_end_bytes - self.rss_after_warmup_bytes

    def text(self) -> str:
        mib = 1 << 20
        return "\n".join([
            f"soak: {self.clients} streaming clients for {self.duration_s:.0f} s",
            f"requests   {self.completed} completed, {self.lost} lost, {self.refused} refused; "
            f"{self.tokens} tokens streamed ({self.tokens / self.duration_s:.0f} tok/s)",
            f"daemon RSS {self.rss_after_warmup_bytes / mib:.0f} MiB after warm-up (anchor), peak "
            f"{self.rss_peak_bytes / mib:.0f} MiB, end {self.rss_end_bytes / mib:.0f} MiB: "
            f"growth {self.rss_growth_bytes / mib:+.1f} MiB",
            *(f"error: {e}" for e in self.errors[:5]),
        ])


@dataclass
class _Tally:
    completed: int = 0
    lost: int = 0
    refused: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def _client(socket: str, deadline: float, tally: _Tally, rng: random.Random) -> None:
    async with AsyncClient(socket) as client:
        while time.monotonic() < deadline:
            words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "x", "y")) for _ in range(rng.randint(4, 40)))
            got_final = False
            try:
                async for delta in client.stream(words, max_tokens=rng.randint(8, 64), temperature=0.8,
                                                 seed=rng.randrange(1 << 30)):
                    tally.tokens += len(delta.token_ids)
                    got_final = got_final or delta.usage is not None
            except RequestError as exc:
                tally.refused += 1
                if len(tally.errors) < 5:
                    tally.errors.append(f"refused: {exc}")
                await asyncio.sleep(0.1)
                continue
            except (ConnectionLost, LlmdError) as exc:
                tally.lost += 1
                if len(tally.errors) < 5:
                    tally.errors.append(f"lost: {exc}")
                continue
            if got_final:
                tally.completed += 1
            else:
                tally.lost += 1


async def _rss_sampler(pid: int, stop: asyncio.Event, samples: list[tuple[float, int]]) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        samples.append((time.monotonic(), process.memory_info().rss))
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except TimeoutError:
            pass


async def soak(socket: str, pid: int, clients: int, seconds: float, warmup_s: float, seed: int) -> SoakReport:
    tally = _Tally()
    start = time.monotonic()
    deadline = start + seconds
    stop, samples = asyncio.Event(), []
    sampler = asyncio.create_task(_rss_sampler(pid, stop, samples))
    await asyncio.gather(*(_client(socket, deadline, tally, random.Random(seed * 100_003 + i)) for i in range(clients)))
    duration = time.monotonic() - start
    stop.set()
    await sampler
    warm = [rss for t, rss in samples if t - start >= warmup_s] or [samples[-1][1]]
    return SoakReport(clients=clients, duration_s=duration, completed=tally.completed, lost=tally.lost,
                      refused=tally.refused, tokens=tally.tokens, rss_after_warmup_bytes=warm[0],
                      rss_peak_bytes=max(rss for _, rss in samples), rss_end_bytes=samples[-1][1], errors=tally.errors)


def _start_daemon(workdir: Path) -> tuple[subprocess.Popen, str]:
    from llmd_tools.make_model import fixture_path

    sock = str(workdir / "llmd.sock")
    config = workdir / "llmd.toml"
    # Every client here is the same user: lift the per-user connection cap above them.
    config.write_text("max_connections_per_user = 4096\n")
    log = open(workdir / "llmd.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "llmd.cli", "serve", "--model", str(fixture_path("tiny-llama")),
                             "--socket", sock, "--max-model-len", "256", "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not start; see {workdir / 'llmd.log'}")
        time.sleep(0.1)
    return proc, sock


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=60.0, help="RSS after this long is the anchor.")
    ap.add_argument("--socket", default=None, help="A running daemon (its pid is found from the socket's peer).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    proc = None
    if args.socket is None:
        proc, sock = _start_daemon(Path(tempfile.mkdtemp(prefix="llmd-soak-")))
        pid = proc.pid
    else:
        sock, pid = args.socket, _daemon_pid(args.socket)
    try:
        report = asyncio.run(soak(sock, pid, args.clients, args.minutes * 60, args.warmup_s, args.seed))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(msgspec.json.encode(report).decode() if args.json else report.text())


def _daemon_pid(sock_path: str) -> int:
    import socket
    import struct

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]


if __name__ == "__main__":
    main()
