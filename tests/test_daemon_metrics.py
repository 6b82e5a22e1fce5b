"""After a known workload, the daemon's counters equal the exact numbers: requests by
finish reason, prompt and generated tokens; the TTFT and E2E histograms count every
request. Read back with prometheus_client's parser (an independent reader)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from daemon_util import Daemon, RawConn
from llmd_tools.make_model import fixture_path

parser = pytest.importorskip("prometheus_client.parser")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_counters_equal_the_workload():
    d = Daemon(str(fixture_path("tiny-llama")), Path(tempfile.mkdtemp(prefix="llmd-m-")) / "s.sock").wait_ready()
    try:
        prompts = [[5 + i] * (10 + i) for i in range(6)]  # 10..15 prompt tokens
        max_tokens = [3, 4, 5, 6, 7, 8]
        with RawConn(d.sock) as conn:
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
                conn.send({"type": "submit", "id": f"q{i}", "token_ids": prompt,
                           "sampling": {"max_tokens": n, "ignore_eos": True}})
            finals = {}
            while len(finals) < len(prompts):
                m = conn.recv()
                if m.get("usage"):
                    finals[m["id"]] = m
            # One aborted request: its tokens count too, under finished_reason="abort".
            conn.send({"type": "submit", "id": "ab", "token_ids": [9] * 12,
                       "sampling": {"max_tokens": 200, "ignore_eos": True}})
            assert conn.recv()["type"] == "accepted"
            conn.send({"type": "abort", "id": "ab"})
            aborted = conn.until_final("ab")[-1]
            conn.send({"type": "metrics"})
            text = conn.recv()["text"]
        got = samples(text)
        generated = sum(max_tokens) + aborted["usage"]["completion_tokens"]
        assert got[("llmd:prompt_tokens_total", ())] == sum(len(p) for p in prompts) + 12
        assert got[("llmd:generation_tokens_total", ())] == generated
        assert got[("llmd:request_success_total", (("finished_reason", "length"),))] == 6
        assert got[("llmd:request_success_total", (("finished_reason", "abort"),))] == 1
        assert got[("llmd:e2e_request_latency_seconds_count", ())] == 7
        # TTFT counts requests that produced a token (the aborted one may not have).
        assert got[("llmd:time_to_first_token_seconds_count", ())] in (6, 7)
        assert got[("llmd:num_requests_running", ())] == 0
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in got.items()
                         if k[0] == "llmd:e2e_request_latency_seconds_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        assert buckets[-1][1] == 7
    finally:
        assert d.stop() == 0, d.stderr()
