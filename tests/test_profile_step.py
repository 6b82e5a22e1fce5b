"""llmd_tools.profile_step: end to end on CPU (tiny-llama, a few decode steps at batch 2),
its JSON report against what the run must show (the steps it ran, each in its own profiler
range; busy time inside the wall time; the roofline's arithmetic); and its CUDA figures
(kernel union, launches, graph replay, memcpys, host syncs) from a hand-made trace whose
answers are known, since no GPU is here to make a real one."""
from __future__ import annotations

import json

import pytest

from llmd_tools import profile_step
from llmd_tools.profile_step import STEP_RANGE, render, summarize, union_us

STEPS = 3


@pytest.fixture(scope="module")
def cpu_report() -> dict:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        rc = profile_step.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--batch", "2",
                                "--steps", str(STEPS), "--input-len", "8", "--warmup", "1", "--top", "5", "--json"])
    assert rc == 0
    return json.loads(out.getvalue())


def test_cpu_run_reports_its_steps_and_times(cpu_report: dict) -> None:
    r = cpu_report
    assert (r["device"], r["dtype"], r["batch"], r["cuda_graphs"]) == ("cpu", "float32", 2, False)
    assert r["steps"] == STEPS and r["profiled_steps"] == STEPS  # one profiler range per engine step
    for wall in (r["wall_ms"], r["profiled_wall_ms"]):
        assert 0 < wall["min"] <= wall["median"] <= wall["max"]
    # The ops run inside the steps: their union cannot exceed the steps' wall time.
    assert 0 < r["busy_ms"] <= r["profiled_wall_ms"]["mean"] * 1.02
    assert r["kernels_per_step"] >= 1 and 1 <= len(r["top_kernels"]) <= 5
    assert sum(k["per_step"] for k in r["top_kernels"]) <= r["kernels_per_step"]
    assert sum(k["total_ms"] for k in r["top_kernels"]) <= r["busy_ms"] * STEPS * 1.001  # top-level ops are disjoint
    assert "memcpy" not in r and "graph_replay" not in r  # CUDA-only figures


def test_cpu_roofline_is_the_bytes_over_the_measured_copy(cpu_report: dict) -> None:
    roof = cpu_report["roofline"]
    assert roof["bandwidth_gbs"] > 0 and roof["weight_bytes"] > 0 and roof["kv_bytes_per_step"] > 0
    seconds = (roof["weight_bytes"] + roof["kv_bytes_per_step"]) / (roof["bandwidth_gbs"] * 1e9)
    assert roof["roofline_ms"] == pytest.approx(seconds * 1e3)
    assert roof["step_ms"] == pytest.approx(cpu_report["wall_ms"]["mean"])
    assert roof["fraction"] == pytest.approx(roof["roofline_ms"] / roof["step_ms"])
    # 8 prompt tokens, the first token and 1 warm-up token, then steps 0..2: mean context 11.
    assert roof["mean_context"] == pytest.approx(8 + 1 + 1 + (STEPS - 1) / 2)


def test_cpu_report_renders(cpu_report: dict) -> None:
    text = render(cpu_report)
    assert "wall per step" in text and "CPU busy per step" in text and "of the roofline" in text
    assert "cudaGraphLaunch" not in text


def _event(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


CUDA_TRACE = [
    _event("user_annotation", STEP_RANGE, 0, 50), _event("user_annotation", STEP_RANGE, 60, 50),
    _event("kernel", "gemm", 0, 10), _event("kernel", "rms_norm", 5, 10),  # overlapping streams: 15 us
    _event("kernel", "gemm", 100, 10),
    _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 20, 1, bytes=8),
    _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 120, 1, bytes=8),
    _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 61, 1, bytes=100),
    _event("cuda_runtime", "cudaGraphLaunch", 1, 2), _event("cuda_runtime", "cudaGraphLaunch", 61, 2),
    _event("cuda_runtime", "cudaLaunchKernel", 3, 1), _event("cuda_driver", "cuLaunchKernel", 63, 1),
    _event("cuda_runtime", "cudaMemcpyAsync", 4, 1), _event("cuda_runtime", "cudaStreamSynchronize", 5, 10),
    _event("cuda_runtime", "cudaStreamSynchronize", 65, 10), _event("cpu_op", "aten::argmax", 2, 1),
]


def test_cuda_figures_from_a_known_trace() -> None:
    s = summarize(CUDA_TRACE, steps=2, cuda=True, top=10)
    assert s["profiled_steps"] == 2
    assert s["busy_ms"] == pytest.approx(25 / 1e3 / 2)  # [0, 15] and [100, 110]
    assert s["kernels_per_step"] == 1.5
    assert [(k["name"], k["per_step"], k["total_ms"]) for k in s["top_kernels"]] == [
        ("gemm", 1.0, 0.02), ("rms_norm", 0.5, 0.01)]
    assert s["launch_calls_per_step"] == 1.0 and s["graph_launches_per_step"] == 1.0 and s["graph_replay"]
    assert s["host_syncs_per_step"] == {"cudaStreamSynchronize": 1.0}  # an async memcpy does not block
    assert s["memcpy"] == {"DtoH": {"count_per_step": 1.0, "bytes_per_step": 8.0},
                           "HtoD": {"count_per_step": 0.5, "bytes_per_step": 50.0}}
    eager = summarize([e for e in CUDA_TRACE if e["name"] != "cudaGraphLaunch"], steps=2, cuda=True, top=10)
    assert not eager["graph_replay"]


def test_cuda_report_renders() -> None:
    s = summarize(CUDA_TRACE, steps=2, cuda=True, top=10)
    wall = {"mean": 0.06, "median": 0.06, "min": 0.05, "max": 0.07}
    report = {"model": "m", "device": "GPU", "dtype": "bfloat16", "batch": 1, "input_len": 32, "steps": 2,
              "warmup": 5, "cuda_graphs": True, "fused_ops": "auto", "loadavg": 0.1, "wall_ms": wall,
              "profiled_wall_ms": wall, **s, "busy_fraction": s["busy_ms"] / 0.06,
              "roofline": {"bandwidth_gbs": 2980.0, "weight_bytes": 2.2e9, "kv_bytes_per_step": 1e6,
                           "mean_context": 40.0, "roofline_ms": 0.74, "step_ms": 2.95, "fraction": 0.25}}
    text = render(report)
    assert "the forward replays a CUDA graph" in text
    assert "DtoH 1.0 x, 8 B" in text and "cudaStreamSynchronize 1.0" in text and "25.0% of the roofline" in text


def test_union_counts_overlaps_once() -> None:
    assert union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert union_us([]) == 0
