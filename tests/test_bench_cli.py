"""`llmd bench latency|throughput` on the tiny fixture: each report adds up (tokens equal
what was asked for, percentiles in order, rates equal counts over time), bad flags get
clear errors, and `llmd serve` never imports the benchmark code."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from llmd.cli import main
from llmd_tools.bench import roofline as rl
from llmd_tools.bench import workloads
from llmd_tools.bench.report import Stats
from llmd_tools.fixture_config import param_count
from llmd_tools.make_model import fixture_path

TINY = str(fixture_path("tiny-llama"))
TINY_VOCAB = 1024
SMALL_ENGINE = ["--max-model-len", "256", "--num-gpu-blocks-override", "64"]


def bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmd.cli", "bench", *args, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def assert_ordered(stats: dict) -> None:
    assert stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert stats["min"] <= stats["mean"] <= stats["max"]


def test_latency_report_adds_up():
    r = bench("latency", "--model", TINY, "--batch-size", "4", "--input-len", "16", "--output-len", "8",
              "--num-iters-warmup", "1", "--num-iters", "3", *SMALL_ENGINE)
    assert r["benchmark"] == "latency" and r["batch_size"] == 4
    assert r["output_tokens"] == 3 * 4 * 8
    assert len(r["latencies_s"]) == 3
    assert_ordered(r["latency_s"])
    assert r["latency_s"]["max"] == max(r["latencies_s"])
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / sum(r["latencies_s"]))
    assert r["steps"] >= 3 * 8  # at least one step per token of a sequence
    assert r["roofline"] is None  # CPU: no roofline
    assert r["env"]["device"] == "cpu" and r["env"]["dtype"] == "float32"


def check_throughput(r: dict, reqs: list[workloads.Req]) -> None:
    assert r["num_requests"] == len(reqs)
    assert r["total_input_tokens"] == sum(len(q.prompt) for q in reqs)
    assert r["total_output_tokens"] == r["requested_output_tokens"] == sum(q.output_len for q in reqs)
    t = r["elapsed_s"]
    assert r["requests_per_s"] == pytest.approx(len(reqs) / t)
    assert r["output_tokens_per_s"] == pytest.approx(r["total_output_tokens"] / t)
    assert r["total_tokens_per_s"] == pytest.approx(r["input_tokens_per_s"] + r["output_tokens_per_s"])
    assert r["roofline"] is None


def test_throughput_nano_mixed_lengths():
    r = bench("throughput", "--model", TINY, "--dataset", "nano", "--num-prompts", "4", "--max-len", "104",
              "--data-seed", "3", *SMALL_ENGINE)
    reqs = workloads.nano(4, 104, TINY_VOCAB, seed=3)
    assert len({q.output_len for q in reqs}) > 1  # the workload really is mixed
    check_throughput(r, reqs)
    assert r["hf"] is None


def test_throughput_random_with_hf_baseline():
    r = bench("throughput", "--model", TINY, "--dataset", "random", "--num-prompts", "4", "--input-len", "12",
              "--output-len", "6", "--hf-baseline", "--hf-batch-size", "2", *SMALL_ENGINE)
    check_throughput(r, workloads.fixed(4, 12, 6, TINY_VOCAB, seed=0))
    hf = r["hf"]
    assert hf["batch_size"] == 2 and hf["generated_tokens"] == 4 * 6  # equal lengths: no waste
    assert hf["output_tokens_per_s"] == pytest.approx(24 / hf["seconds"])
    assert hf["speedup"] == pytest.approx(r["total_tokens_per_s"] / hf["total_tokens_per_s"])


@pytest.mark.parametrize("args, message", [
    (["throughput", "--dataset", "nano", "--input-len", "5"], "--input-len only applies to --dataset random"),
    (["throughput", "--max-len", "500"], "--max-len only applies to --dataset nano"),
    (["throughput", "--dataset", "nano", "--max-len", "50"], "50 is not in the range x>=100"),
    (["throughput", "--hf-batch-size", "4"], "--hf-batch-size only applies with --hf-baseline"),
    (["latency", "--num-iters", "0"], "0 is not in the range x>=1"),
    (["serve", "--request-rate", "0"], "must be > 0"),
    (["serve", "--request-rate", "fast"], "'fast' is not a number"),
    (["serve", "--goodput", "ttft:500,latency:3"], "expected METRIC:MILLISECONDS"),
    (["serve", "--goodput", "tpot:-1"], "expected METRIC:MILLISECONDS"),
    (["serve", "--prefix-len", "64"], "--prefix-len only applies to --workload shared-prefix"),
    (["serve", "--abort-fraction", "0.5"], "--abort-fraction only applies to --workload abort"),
    (["serve", "--workload", "abort", "--output-len", "1"], "at least 2 output tokens"),
    (["serve", "--base-url", "http://127.0.0.1:1/v1"], "--base-url only applies to --backend openai"),
    (["serve", "--backend", "socket,grpc"], "must be one of socket, openai"),
])
def test_bad_flags_are_usage_errors(args, message):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_unreachable_daemon_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["bench", "serve", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1
    assert "none.sock" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", "serve", "--backend", "openai", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1
    assert "none-http.sock" in result.output and "Traceback" not in result.output


def test_workload_longer_than_max_model_len_is_refused():
    result = CliRunner().invoke(main, ["bench", "latency", "--model", TINY, "--max-model-len", "20",
                                       "--input-len", "16", "--output-len", "8", "--num-gpu-blocks-override", "8"])
    assert result.exit_code == 1
    assert "needs 24 tokens" in result.output and "max_model_len is 20" in result.output


def test_plot_without_matplotlib_says_how_to_get_it():
    from llmd_tools.bench import plot
    if plot.available():
        pytest.skip("matplotlib is installed")
    result = CliRunner().invoke(main, ["bench", "serve", "--plot", "out.png"])
    assert result.exit_code == 2 and "pip install 'llmd[bench]'" in result.output


def test_serve_does_not_import_benchmark_code():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom llmd.cli import main\n"
            "assert CliRunner().invoke(main, ['serve', '--help']).exit_code == 0\n"
            "print(sorted(m for m in sys.modules if m.startswith('llmd_tools.bench')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert "bench" in CliRunner().invoke(main, ["--help"]).output


def test_stats_are_ordered_and_empty_is_none():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0], scale=10)
    assert (s.min, s.p50, s.max, s.mean) == (10.0, 30.0, 50.0, 30.0)
    assert s.p50 <= s.p90 <= s.p99 <= s.max
    assert Stats.of([]) is None


def test_workloads():
    nano = workloads.nano(50, 120, TINY_VOCAB, seed=1)
    assert all(100 <= len(q.prompt) <= 120 and 100 <= q.output_len <= 120 for q in nano)
    assert nano == workloads.nano(50, 120, TINY_VOCAB, seed=1)  # seeded
    shared = workloads.shared_prefix(6, 2, 32, 4, 8, TINY_VOCAB, seed=0)
    assert shared[0].prompt[:32] == shared[2].prompt[:32] != shared[1].prompt[:32]
    assert len({tuple(q.prompt) for q in shared}) == 6 and all(len(q.prompt) == 36 for q in shared)
    assert all(workloads.FIRST_ID <= t < TINY_VOCAB for q in shared for t in q.prompt)


def test_roofline_counts():
    # prompt 2, output 3: tokens 2 and 3 come from decode steps over 2 + 1 and 2 + 2 tokens.
    assert rl.decode_kv_tokens([(2, 3), (5, 1)]) == 7
    # The untied input embedding is gathered, not streamed: every other weight counts.
    hidden = json.loads((fixture_path("tiny-llama") / "config.json").read_text())["hidden_size"]
    assert rl.weight_elements(TINY) == param_count("llama", "tiny") - TINY_VOCAB * hidden


def test_roofline_arithmetic(monkeypatch):
    # No GPU here: a CUDA-looking engine and a fixed bandwidth check the sums; a CPU
    # engine gets no roofline at all.
    monkeypatch.setattr(rl, "device_bandwidth", lambda device: 1e9)
    engine = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, model_dir=TINY,
                             config=SimpleNamespace(tensor_parallel_size=1))
    r = rl.roofline(engine, steps=10, kv_tokens=100, seconds=2.0)
    kv_per_token = 2 * 3 * 2 * 16 * 2  # K and V, 3 layers, 2 KV heads, head_dim 16, bf16
    total = rl.weight_elements(TINY) * 2 * 10 + kv_per_token * 100
    assert r.bytes_per_step == pytest.approx(total / 10)
    assert r.roofline_s == pytest.approx(total / 1e9)
    assert r.achieved_gbs == pytest.approx(total / 2.0 / 1e9)
    assert r.fraction_of_peak == pytest.approx(total / 2.0 / 1e9)
    assert rl.roofline(SimpleNamespace(device=torch.device("cpu")), 10, 100, 2.0) is None
