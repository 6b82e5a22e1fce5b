"""Who owns a loopback TCP connection, and what finding out costs the event loop (issue 25).

The uid of a TCP client comes from one NETLINK_SOCK_DIAG query for the connection's
4-tuple (the /proc/net/tcp scan is the fallback); both must give the same answer for a
live connection, IPv4, IPv6 and an IPv4 client of a dual-stack listener, and -1 for a
connection that is gone. End to end: a burst of 2,000 keyless `/health` requests on
fresh TCP connections, with the machine's TCP table padded to the issue's ~5,200 rows,
must not stall a socket client's stream (the old code scanned the table on the event
loop for every new connection, /health included).

Run as a script to print the figures in docs/benchmarks.md:
    python tests/test_peer_lookup.py [--daemon-path DIR]
(`--daemon-path` puts another copy of the llmd/llmd_client packages first on the
daemon's PYTHONPATH: the "before" measurement)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # daemon_util when run as a script

from daemon_util import Daemon, RawConn  # noqa: E402
from llmd.actors import peer_credentials  # noqa: E402
from llmd.actors.peer_credentials import tcp_peer_uid, tcp_peer_uid_proc, tcp_peer_uid_sock_diag  # noqa: E402

NOBODY = 65534
API_KEY = "test-key-25"
PAD_CONNECTIONS = 2600  # 5,200 rows in /proc/net/tcp: the machine had 5,241 lines
BURST_REQUESTS = 2000
BURST_CONCURRENCY = 32
MAX_MODEL_LEN = 1024
STREAM_TOKENS = 400


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _owned_by(uid: int):
    """Sockets created inside are owned by `uid` (root switches its effective uid for
    the moment; anyone else owns their sockets already)."""
    if os.geteuid() != 0 or uid == os.geteuid():
        yield
        return
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)


@contextlib.contextmanager
def _loopback_pair(listen_host: str, connect_host: str, owner: int):
    """(client socket, server-side peer address, server-side local address)."""
    family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
    with socket.socket(family) as server:
        if listen_host == "::":
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind((listen_host, 0))
        server.listen(1)
        with _owned_by(owner):
            client = socket.socket(socket.AF_INET6 if ":" in connect_host else socket.AF_INET)
        with client:
            client.connect((connect_host, server.getsockname()[1]))
            conn, peer = server.accept()
            with conn:
                yield client, peer, conn.getsockname()


def _expected_owner() -> int:
    # As root, a client owned by nobody tells a real answer from the 0 of a time-wait row.
    return NOBODY if os.geteuid() == 0 else os.geteuid()


CASES = [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("::", "127.0.0.1")]


@pytest.mark.parametrize("listen_host,connect_host", CASES, ids=["ipv4", "ipv6", "ipv4-on-dual-stack"])
def test_sock_diag_equals_proc_scan(listen_host, connect_host):
    if ":" in listen_host and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    owner = _expected_owner()
    with _loopback_pair(listen_host, connect_host, owner) as (_client, peer, local):
        assert tcp_peer_uid_sock_diag(peer, local) == tcp_peer_uid_proc(peer, local) == owner
        assert tcp_peer_uid(peer, local) == owner
        # Not the client's socket: another port, or our own end of the connection.
        other = (peer[0], peer[1] ^ 1, *peer[2:])
        assert tcp_peer_uid_sock_diag(other, local) == tcp_peer_uid_proc(other, local) == -1
        # Our own end (on a dual-stack listener an IPv6 socket, which /proc lists in tcp6
        # under its ::ffff: address; sock_diag answers for it all the same).
        assert tcp_peer_uid_sock_diag(local, peer) == os.geteuid()
        if listen_host != "::":
            assert tcp_peer_uid_proc(local, peer) == os.geteuid()


def test_an_ipv6_socket_in_an_ipv4_connection_is_found():
    # A client with an AF_INET6 socket connecting to ::ffff:127.0.0.1 reaches an IPv4
    # listener; the kernel answers for it as an IPv6 socket with mapped addresses.
    if not _ipv6_loopback():
        pytest.skip("no IPv6 here")
    with _loopback_pair("127.0.0.1", "::ffff:127.0.0.1", _expected_owner()) as (_client, peer, local):
        assert tcp_peer_uid_sock_diag(peer, local) == _expected_owner()


def test_a_listening_socket_on_the_clients_port_is_not_the_client():
    # The kernel's exact lookup falls back to a listener on the port when no connection
    # matches; the reply's 4-tuple tells them apart.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        peer, local = listener.getsockname(), ("127.0.0.1", 1)
        assert tcp_peer_uid_sock_diag(peer, local) == tcp_peer_uid_proc(peer, local) == -1


def test_a_closed_client_is_unknown_not_root():
    # A client that closed its end leaves a time-wait row whose uid reads 0 (root, an
    # administrator): that is no answer, in either lookup.
    with _loopback_pair("127.0.0.1", "127.0.0.1", _expected_owner()) as (client, peer, local):
        client.close()
        time.sleep(0.05)
        assert tcp_peer_uid_sock_diag(peer, local) == tcp_peer_uid_proc(peer, local) == -1


def test_a_gone_client_keeps_netlink_in_use(monkeypatch):
    monkeypatch.setattr(peer_credentials, "_sock_diag_usable", True)
    with _loopback_pair("127.0.0.1", "127.0.0.1", _expected_owner()) as (_client, peer, local):
        assert tcp_peer_uid((peer[0], peer[1] ^ 1), local) == -1
    assert peer_credentials._sock_diag_usable


def test_netlink_that_finds_no_tcp_socket_gives_way_to_the_proc_scan(monkeypatch, caplog):
    # A kernel without tcp_diag answers every query "no such socket", as for a gone one.
    monkeypatch.setattr(peer_credentials, "tcp_peer_uid_sock_diag", lambda peer, local: -1)
    monkeypatch.setattr(peer_credentials, "_sock_diag_usable", True)
    with caplog.at_level(logging.WARNING, "llmd.peer"):
        with _loopback_pair("127.0.0.1", "127.0.0.1", _expected_owner()) as (_client, peer, local):
            assert tcp_peer_uid(peer, local) == _expected_owner()
    assert not peer_credentials._sock_diag_usable
    assert any("NETLINK_SOCK_DIAG is unavailable" in r.message for r in caplog.records)


def test_the_proc_scan_is_the_fallback_when_netlink_is_unavailable(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise peer_credentials.SockDiagUnavailable("blocked")

    monkeypatch.setattr(peer_credentials, "tcp_peer_uid_sock_diag", refuse)
    monkeypatch.setattr(peer_credentials, "_sock_diag_usable", True)
    with caplog.at_level(logging.WARNING, "llmd.peer"):
        with _loopback_pair("127.0.0.1", "127.0.0.1", _expected_owner()) as (_client, peer, local):
            assert tcp_peer_uid(peer, local) == _expected_owner()
            assert not peer_credentials._sock_diag_usable  # asked once, then never again
            assert tcp_peer_uid(peer, local) == _expected_owner()
    assert sum("NETLINK_SOCK_DIAG is unavailable" in r.message for r in caplog.records) == 1


# --- the HTTP intake: which requests look the peer up, and where ----------------------

class _Metrics:
    def send(self, query) -> None:
        query.reply.set_result((True, "ok") if query.kind == "health" else "# nothing\n")


def test_only_routes_that_need_an_owner_look_it_up_once_per_connection_off_the_loop(monkeypatch):
    import threading
    import types

    import aiohttp
    from aiohttp import web

    from llmd.actors import http_intake

    calls: list[tuple[int, tuple, tuple]] = []

    def counting_lookup(peer, local):
        calls.append((threading.get_ident(), peer, local))
        return tcp_peer_uid(peer, local)

    monkeypatch.setattr(http_intake, "tcp_peer_uid", counting_lookup)

    async def whoami(request: web.Request) -> web.Response:
        return web.json_response({"uid": request["uid"]})

    async def scenario() -> dict:
        actor = http_intake.HttpIntakeActor([], types.SimpleNamespace(draining=False), _Metrics(), models=None,
                                            api_keys=[API_KEY])
        app = actor.make_app()
        app.router.add_route("GET", "/whoami", whoami)  # a route outside the anonymous set
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
        auth = {"Authorization": f"Bearer {API_KEY}"}
        seen = {}
        try:
            fresh = aiohttp.TCPConnector(force_close=True)  # a new TCP connection per request
            async with aiohttp.ClientSession(connector=fresh) as session:
                for path, headers in [("/health", {}), ("/health", auth), ("/metrics", auth), ("/", auth),
                                      ("/api/version", auth), ("/nowhere", auth), ("/whoami", {})]:
                    for _ in range(20):
                        async with session.get(base + path, headers=headers) as response:
                            seen.setdefault(path, set()).add(response.status)
                seen["anonymous_lookups"] = len(calls)
            reuse = aiohttp.TCPConnector(limit=1)  # one keep-alive connection
            async with aiohttp.ClientSession(connector=reuse) as session:
                for _ in range(5):
                    async with session.get(base + "/whoami", headers=auth) as response:
                        seen.setdefault("uids", []).append((response.status, (await response.json())["uid"]))
            seen["loop_thread"] = threading.get_ident()
        finally:
            await runner.cleanup()
            actor._lookups.shutdown(wait=True)
        return seen

    seen = asyncio.run(scenario())
    assert seen["/health"] == {200} and seen["/metrics"] == {200} and seen["/nowhere"] == {404}
    assert seen["/whoami"] == {401}  # no key: refused before anyone looks
    assert seen["anonymous_lookups"] == 0
    assert seen["uids"] == [(200, os.geteuid())] * 5
    assert len(calls) == 1  # once for the keep-alive connection's five requests
    assert calls[0][0] != seen["loop_thread"]  # in the lookup pool, not on the event loop


# --- end to end: a /health burst beside a streaming socket client ---------------------

@contextlib.contextmanager
def padded_tcp_table(connections: int):
    """`connections` idle loopback connections (two rows each in /proc/net/tcp)."""
    held: list[socket.socket] = []
    try:
        server = socket.socket()
        held.append(server)
        server.bind(("127.0.0.1", 0))
        server.listen(connections)
        for _ in range(connections):
            client = socket.create_connection(server.getsockname())
            held.append(client)
            held.append(server.accept()[0])
        yield
    finally:
        for sock in held:
            sock.close()


BURST = r"""
import asyncio, json, sys, time
host, port, total, concurrency = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()

async def one(gate, statuses):
    async with gate:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        reply = await reader.read()
        writer.close()
        statuses.append(reply[9:12].decode())

async def main():
    gate, statuses = asyncio.Semaphore(concurrency), []
    start = time.monotonic()
    await asyncio.gather(*(one(gate, statuses) for _ in range(total)))
    end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "ok": statuses.count("200"), "total": total}))

asyncio.run(main())
"""


def _stream(conn: RawConn, ident: str) -> list[float]:
    """Submit one long greedy stream; the arrival time of each of its outputs."""
    conn.send({"type": "submit", "id": ident, "prompt": "def parse(path):", "stream": True,
               "sampling": {"temperature": 0, "max_tokens": STREAM_TOKENS, "ignore_eos": True}})
    times = []
    while True:
        message = conn.recv()
        if message.get("id") != ident:
            continue
        if message["type"] == "error":
            raise AssertionError(message)
        if message["type"] == "output":
            times.append(time.monotonic())
            if message.get("usage") is not None:
                return times


def _gaps(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """Gaps between consecutive outputs of one stream that overlap [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]


def measure(model: str, workdir: Path, rounds: int = 3, *, daemon_args: tuple[str, ...] = (),
            daemon_env: dict | None = None, timeout: float = 300.0, concurrency: int = BURST_CONCURRENCY) -> dict:
    """Start a daemon with HTTP on a loopback port; then, `rounds` times, a stream alone
    (the baseline), streams back to back while a subprocess sends the /health burst, and
    a stream alone again (the machine's other load changes by the second). Every process
    started here is stopped on every path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    deadline = time.monotonic() + timeout
    d = Daemon(model, workdir / "llmd.sock", "--max-model-len", str(MAX_MODEL_LEN), "--http-port", str(port),
               "--api-key", API_KEY, *daemon_args, env=daemon_env)
    burst = None
    figures = []
    try:
        d.wait_ready(timeout=180)
        with padded_tcp_table(PAD_CONNECTIONS), RawConn(d.sock, timeout=60) as conn:
            with open("/proc/net/tcp") as f:
                table_rows = sum(1 for _ in f) - 1
            _stream(conn, "warm-up")
            for r in range(rounds):
                alone = _stream(conn, f"alone-{r}")
                burst = subprocess.Popen([sys.executable, "-c", BURST, "127.0.0.1", str(port), str(BURST_REQUESTS),
                                          str(concurrency)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                streams = []
                while burst.poll() is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the /health burst did not finish in time")
                    streams.append(_stream(conn, f"during-{r}-{len(streams)}"))
                out, err = burst.communicate()
                assert burst.returncode == 0, err.decode()
                result = json.loads(out)
                after = _stream(conn, f"after-{r}")
                start, end = result["start"], result["end"]
                during = [(b - a, a - start) for times in streams for a, b in zip(times, times[1:])
                          if b >= start and a <= end]
                alone_gaps = _gaps(alone) + _gaps(after)
                worst, worst_at = max(during)
                figures.append({
                    "burst_s": round(end - start, 3), "burst_ok": result["ok"],
                    "alone_max_gap_s": round(max(alone_gaps), 4),
                    "alone_median_gap_s": round(statistics.median(alone_gaps), 4),
                    "during_max_gap_s": round(worst, 4), "worst_gap_began_s": round(worst_at, 3),
                    "during_median_gap_s": round(statistics.median(g for g, _ in during), 4),
                    "during_outputs": len(during), "excess_s": round(worst - max(alone_gaps), 4)})
        return {"table_rows": table_rows, "rounds": figures}
    finally:
        if burst is not None and burst.poll() is None:
            burst.kill()
            burst.wait()
        d.stop()


# The target is 100 ms, and the figures in docs/benchmarks.md (the script's run,
# on a quiet machine) show it met: 39-94 ms. This test is the regression guard, not the
# measurement: the daemon, the burst's client and this reader share two cores with
# whatever else runs there (in CI, another test file's daemon), and a plain busy loop
# beside the stream (no HTTP at all) already made 87-93 ms gaps here; CI saw a 115 ms gap
# with the fixed code. The model gets one thread (--cpu-threads 1): with both cores in its
# OpenMP team, any other busy process stalls its barriers. The bound is on the excess, the
# burst's largest gap beyond the largest gap of the same stream alone just before and just
# after it, and on its median over three rounds, so that one spike of someone else's load
# does not decide. The old code (a /proc/net/tcp scan on the loop for every new
# connection) slowed the stream to a crawl for the burst's whole length: 0.6-1.0 s gaps,
# a 21-40 s burst where the fixed code's takes 0.8-2.8 s. Both bounds sit between.
ALLOWANCE_S = 0.250
BURST_ALLOWANCE_S = 10.0
TEST_DAEMON_ARGS = ("--cpu-threads", "1")


def test_health_burst_does_not_stall_a_streaming_socket_client(tmp_path):
    from llmd_tools.make_model import fixture_path

    figures = measure(str(fixture_path("tiny-llama")), tmp_path, rounds=3, daemon_args=TEST_DAEMON_ARGS)
    print(json.dumps(figures))
    rounds = figures["rounds"]
    assert figures["table_rows"] >= 2 * PAD_CONNECTIONS
    assert all(r["burst_ok"] == BURST_REQUESTS for r in rounds), rounds
    assert all(r["during_outputs"] >= 5 for r in rounds), rounds  # the stream really ran beside the burst
    assert statistics.median(r["excess_s"] for r in rounds) < ALLOWANCE_S, figures
    assert statistics.median(r["burst_s"] for r in rounds) < BURST_ALLOWANCE_S, figures


if __name__ == "__main__":
    import argparse
    import tempfile

    from llmd_tools.make_model import fixture_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemon-path", help="a folder holding other llmd/llmd_client packages for the daemon")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=BURST_CONCURRENCY)
    parser.add_argument("--cpu-threads", type=int, default=1, help="the model's threads (0: the daemon's default)")
    parser.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.daemon_env)
    if args.daemon_path:
        env["PYTHONPATH"] = args.daemon_path
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(str(fixture_path("tiny-llama")), Path(tmp), args.rounds, timeout=900, daemon_env=env,
                          daemon_args=("--cpu-threads", str(args.cpu_threads)) if args.cpu_threads else (),
                          concurrency=args.concurrency)
    print(json.dumps(figures, indent=1))
