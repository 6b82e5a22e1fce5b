"""`llmd bench serve` against a real daemon on the tiny fixture: every request is
accounted for (completed + failed + aborted = sent), token counts equal what was asked
for, percentiles are in order, goodput is at most the request throughput; a shared
prefix is served from the prefix cache; cancelled requests leave nothing running."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from daemon_util import Daemon, RawConn
from llmd_tools.bench.serve import _Record, summarize
from llmd_tools.make_model import fixture_path


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(str(fixture_path("tiny-llama")), Path(tempfile.mkdtemp(prefix="llmd-b-")) / "s.sock").wait_ready()
    yield d
    assert d.stop() == 0, d.stderr()


def bench_serve(d: Daemon, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmd.cli", "bench", "serve", "--socket", d.sock, *args, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + d.stderr()
    return json.loads(out.stdout)


def check_run(run: dict, output_len: int) -> None:
    assert run["completed"] + run["failed"] + run["aborted"] == run["sent"]
    assert run["failed"] == 0 and run["errors"] == []
    assert run["total_output_tokens"] == run["completed"] * output_len
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = run[key]
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], key
    assert run["ttft_ms"]["max"] <= run["e2e_ms"]["max"]
    assert run["request_throughput"] == pytest.approx(run["completed"] / run["duration_s"])
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])
    if run["goodput"] is not None:
        assert 0 <= run["goodput"] <= run["request_throughput"]


def test_random_workload_sweep(daemon):
    r = bench_serve(daemon, "--num-prompts", "10", "--input-len", "16", "--output-len", "6",
                    "--request-rate", "inf,40", "--goodput", "ttft:60000,tpot:60000", "--data-seed", "11")
    assert r["benchmark"] == "serve" and r["model"] == Path(fixture_path("tiny-llama")).name
    assert [run["request_rate"] for run in r["runs"]] == [None, 40.0]
    for run in r["runs"]:
        assert run["sent"] == run["completed"] == 10
        assert run["total_input_tokens"] == 10 * 16
        check_run(run, 6)
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # SLOs no run can miss


def test_impossible_slo_gives_zero_goodput(daemon):
    r = bench_serve(daemon, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                    "--goodput", "ttft:0.000001", "--max-concurrency", "2", "--data-seed", "12")
    check_run(r["runs"][0], 4)
    assert r["runs"][0]["goodput"] == 0.0


def test_shared_prefix_hits_the_prefix_cache(daemon):
    # One at a time, so every request after the first of its prefix finds it cached:
    # 6 of 8 requests reuse a 64-token (4-block) prefix.
    r = bench_serve(daemon, "--workload", "shared-prefix", "--num-prompts", "8", "--num-prefixes", "2",
                    "--prefix-len", "64", "--input-len", "8", "--output-len", "4", "--max-concurrency", "1",
                    "--data-seed", "13")
    run = r["runs"][0]
    check_run(run, 4)
    assert run["total_input_tokens"] == 8 * 72
    assert run["cached_prompt_tokens"] == 6 * 64


def test_abort_workload_counts_cancelled_requests_apart(daemon):
    r = bench_serve(daemon, "--workload", "abort", "--abort-fraction", "0.5", "--num-prompts", "10",
                    "--input-len", "8", "--output-len", "24", "--data-seed", "14")
    run = r["runs"][0]
    check_run(run, 24)
    assert run["aborted"] >= 1 and run["completed"] >= 1
    assert 0 < run["aborted_output_tokens"] < run["aborted"] * 24
    deadline = time.monotonic() + 10
    while True:  # the daemon finishes cancelled requests: nothing is left running
        with RawConn(daemon.sock) as conn:
            conn.send({"type": "status"})
            status = conn.recv()
        if status["num_running"] == status["num_waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["num_running"] == status["num_waiting"] == 0


def test_socket_and_openai_backends_in_one_run(daemon):
    r = bench_serve(daemon, "--backend", "socket,openai", "--num-prompts", "6", "--input-len", "12",
                    "--output-len", "5", "--request-rate", "inf,50", "--data-seed", "15")
    assert [(run["backend"], run["request_rate"]) for run in r["runs"]] == [
        ("socket", None), ("openai", None), ("socket", 50.0), ("openai", 50.0)]
    assert r["runs"][1]["target"].endswith("s-http.sock")
    for run in r["runs"]:
        assert run["sent"] == run["completed"] == 6
        check_run(run, 5)
        assert run["cached_prompt_tokens"] == 0  # each backend's run has prompts of its own


def test_openai_backend_abort_workload_leaves_nothing_running(daemon):
    r = bench_serve(daemon, "--backend", "openai", "--workload", "abort", "--abort-fraction", "0.5",
                    "--num-prompts", "8", "--input-len", "8", "--output-len", "24", "--data-seed", "16")
    run = r["runs"][0]
    check_run(run, 24)
    assert run["aborted"] >= 1 and run["completed"] >= 1
    deadline = time.monotonic() + 10
    while True:
        with RawConn(daemon.sock) as conn:
            conn.send({"type": "status"})
            status = conn.recv()
        if status["num_running"] == status["num_waiting"] == status["kv_blocks_used"] == 0 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["num_running"] == status["num_waiting"] == status["kv_blocks_used"] == 0


def test_summary_of_known_records():
    # Two completed requests with known timings, one failure, one abort.
    a = _Record(prompt_tokens=4, sent=0.0, end=0.5, times=[0.1, 0.3, 0.5], counts=[1, 1, 2], completion_tokens=4)
    b = _Record(prompt_tokens=4, sent=0.2, end=0.6, times=[0.4, 0.6], counts=[1, 1], completion_tokens=2)
    f = _Record(prompt_tokens=4, sent=0.0, outcome="failed", error="RequestError: boom")
    x = _Record(prompt_tokens=4, sent=0.0, end=0.2, times=[0.2], counts=[3], outcome="aborted")
    rep = summarize([a, b, f, x], 2.0, 0.0, 1.0, {"ttft": 150.0})
    assert (rep.sent, rep.completed, rep.failed, rep.aborted) == (4, 2, 1, 1)
    assert rep.errors == ["RequestError: boom"] and rep.aborted_output_tokens == 3
    assert (rep.total_input_tokens, rep.total_output_tokens) == (8, 6)
    assert rep.ttft_ms.min == pytest.approx(100.0) and rep.ttft_ms.max == pytest.approx(200.0)
    assert rep.tpot_ms.min == pytest.approx(400 / 3) and rep.tpot_ms.max == pytest.approx(200.0)
    assert sorted([rep.itl_ms.min, rep.itl_ms.max]) == pytest.approx([200.0, 200.0])
    assert rep.goodput == pytest.approx(1.0)  # only `a` meets TTFT <= 150 ms
    assert rep.peak_output_throughput == 9.0  # the whole run fell within its first second
