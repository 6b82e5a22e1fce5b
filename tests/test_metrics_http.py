"""The optional Prometheus listener: `llmd serve --metrics-port N` answers GET /metrics
on 127.0.0.1 only with the same counters as `llmctl metrics` (read with prometheus_client's
parser), 404 for other paths, 405 for other methods, 400 for garbage; a busy port is
reported before the model loads; a rebinding Host (a page's own name pointed at
127.0.0.1) is refused."""
from __future__ import annotations

import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client import parser

from daemon_util import LLMD, Daemon, RawConn
from llmd_tools.make_model import fixture_path

TINY = str(fixture_path("tiny-llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(text: str) -> dict[str, float]:
    return {s.name: s.value for family in parser.text_string_to_metric_families(text)
            for s in family.samples if "finished_reason" not in s.labels and "le" not in s.labels}


def get(url: str, method: str = "GET") -> tuple[int, dict, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_metrics_over_http():
    port = free_port()
    d = Daemon(TINY, Path(tempfile.mkdtemp(prefix="llmd-h-")) / "s.sock", "--metrics-port", str(port)).wait_ready()
    try:
        with RawConn(d.sock) as conn:
            conn.send({"type": "submit", "id": "q", "token_ids": [7] * 10,
                       "sampling": {"max_tokens": 5, "ignore_eos": True}})
            conn.until_final("q")
        url = f"http://127.0.0.1:{port}"
        status, headers, text = get(url + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        got = values(text)
        assert got["llmd:generation_tokens_total"] == 5 and got["llmd:prompt_tokens_total"] == 10
        assert got["process_cpu_seconds_total"] > 0  # the standard process collector's names
        assert got["process_resident_memory_bytes"] > 10 << 20
        with RawConn(d.sock) as conn:  # the same figures as over the socket
            conn.send({"type": "metrics"})
            over_socket = values(conn.recv()["text"])
        assert over_socket["llmd:generation_tokens_total"] == 5
        assert get(url + "/metrics?x=1")[0] == 200
        assert get(url + "/")[0] == 404 and get(url + "/metrics/extra")[0] == 404
        status, headers, _ = get(url + "/metrics", method="POST")
        assert status == 405 and headers["Allow"] == "GET"
        assert raw_request(port, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        # What a browser sends after DNS rebinding: the attacker's name in Host.
        for host, code in [("evil.example", 403), ("evil.example:%d" % port, 403), ("localhost:%d" % port, 200),
                           ("127.0.0.1", 200), ("[::1]:%d" % port, 200), ("app.localhost", 200)]:
            reply = raw_request(port, f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert reply.startswith(f"HTTP/1.1 {code} ".encode()), (host, reply[:80])
            assert (b"llmd:generation_tokens_total" in reply) == (code == 200)
        two_hosts = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nHOST: evil.example\r\n\r\n"
        assert raw_request(port, two_hosts).startswith(b"HTTP/1.1 400 ")
        listening = [c.laddr for c in psutil.Process(d.proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]
    finally:
        assert d.stop() == 0, d.stderr()


def test_busy_port_fails_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([*LLMD, "serve", "--model", TINY, "--socket", str(tmp_path / "s.sock"),
                              "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"cannot listen for metrics on 127.0.0.1:{port}" in out.stderr
    assert not (tmp_path / "s.sock").exists()


def test_metrics_port_is_validated():
    out = subprocess.run([*LLMD, "serve", "--metrics-port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--metrics-port" in out.stderr
    from llmd.daemon_config import load_settings
    with pytest.raises(ValueError, match="metrics_port"):
        load_settings(None, {"metrics_port": 70000})
    assert load_settings(None, {})[0].metrics_port is None  # off by default
