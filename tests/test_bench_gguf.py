"""tools/bench_gguf.py runs each engine in a fresh process and reports medians: a tiny
GGUF through the llmd engines it knows (llama.cpp is an optional extra, not run here);
with --kernels it times the packed matmul of each weight shape of the file (or random
blocks of given types and shapes), the float32 kernel beside the x16 one."""
from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_fixtures import write_gguf
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd_tools import bench_gguf
from test_gguf import hf_dirs  # noqa: F401


def test_bench_gguf_reports_every_engine_it_ran(hf_dirs, tmp_path, capsys):  # noqa: F811
    path = write_gguf(hf_dirs("llama"), tmp_path / "q8.gguf", T.Q8_0)
    engines = ["llmd", "llmd-f32"]  # packed and dequantized
    assert bench_gguf.main(["--model", str(path), "--rounds", "1", "--prompt", "16", "--tokens", "4",
                            "--engines", *engines, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(report["engines"]) == engines and report["skipped"] == []
    for figures in report["engines"].values():
        assert figures["decode_tok_s"] > 0 and figures["ttft_s"] > 0 and figures["peak_rss_mib"] > 50
        # VmHWM is read from per-CPU RSS counters the kernel syncs lazily: two reads may
        # be a page apart the wrong way (CI saw 320.957 after 320.961 MiB).
        page_mib = 4 / 1024
        assert figures["peak_rss_mib"] + page_mib >= figures["load_peak_rss_mib"]
        assert figures["load_peak_rss_mib"] + page_mib >= figures["loaded_rss_mib"] > 50


def test_bench_gguf_times_each_packed_weight_shape(hf_dirs, tmp_path, capsys):  # noqa: F811
    path = write_gguf(hf_dirs("llama"), tmp_path / "q4.gguf", T.Q4_0)
    threads = str(torch.get_num_threads())  # as it is: the option sets this process's count
    assert bench_gguf.main(["--model", str(path), "--kernels", "--rows", "2", "--calls", "5", "--threads", threads,
                            "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shapes = {(k["quant"], k["rows"], k["cols"]) for k in report["kernels"]}
    assert len(shapes) == len(report["kernels"]) and {q for q, _, _ in shapes} == {"Q4_0"}
    assert ("Q4_0", 192, 64) in shapes  # blk.N.ffn_gate: intermediate 192 x hidden 64
    assert all(k["packed_us"] > 0 and k["dense_f32_us"] > 0 for k in report["kernels"])


def test_bench_gguf_times_random_blocks_of_each_type_through_both_kernels(capsys):
    threads = str(torch.get_num_threads())
    assert bench_gguf.main(["--kernels", "--shape", "32x256", "--types", "Q4_K", "Q5_0", "--passes", "1", "3",
                            "--calls", "3", "--threads", threads, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(k["quant"], k["rows"], k["cols"]) for k in report["kernels"]] == [("Q4_K", 32, 256), ("Q5_0", 32, 256)]
    ops = gguf_ops()
    for k in report["kernels"]:
        assert k["packed_us"] > 0 and k["dense_f32_us"] > 0
        assert set(k["x16_us"]) == ({"1", "3"} if ops.x16 else set()) and all(v > 0 for v in k["x16_us"].values())
    with pytest.raises(SystemExit, match="Q4_K rows are whole blocks of 256"):
        bench_gguf.main(["--kernels", "--shape", "32x96", "--types", "Q4_K", "--calls", "1", "--threads", threads])


def _batched_report(path, engines, capsys) -> dict:
    assert bench_gguf.main(["--model", str(path), "--rounds", "1", "--prompt", "12", "--tokens", "6", "--batch", "3",
                            "--batch-only", "--engines", *engines, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "engines" not in report and report["batch"] == 3 and list(report["batched"]) == engines
    for figures in report["batched"].values():
        assert figures["throughput_tok_s"] > 0 and figures["batch_ttft_s"] > 0 and figures["batch_decode_tok_s"] > 0
        assert figures["peak_rss_mib"] >= figures["loaded_rss_mib"] > 30
    return report


def test_bench_gguf_batched_gives_each_sequence_the_same_tokens_in_both_llmd_engines(hf_dirs, tmp_path, capsys):  # noqa: F811
    """Three prompts at once through the packed and the dequantized engine: each
    sequence's tokens are the other engine's (a prompt, position or sequence mixed up
    would part them at once)."""
    path = write_gguf(hf_dirs("llama"), tmp_path / "q8.gguf", T.Q8_0)
    report = _batched_report(path, ["llmd", "llmd-f32"], capsys)
    assert report["batched"]["llmd-f32"]["same_tokens"] == 1.0


def test_bench_gguf_batched_llama_cpp_decodes_what_llmd_does(hf_dirs, tmp_path, capsys):  # noqa: F811
    """llama.cpp's batched loop (one llama_decode per step for every sequence) on the
    same file and prompts gives llmd's greedy tokens, up to a near tie on random weights."""
    pytest.importorskip("llama_cpp")
    path = write_gguf(hf_dirs("llama"), tmp_path / "q8.gguf", T.Q8_0)
    report = _batched_report(path, ["llmd", "llama.cpp"], capsys)
    assert report["batched"]["llama.cpp"]["same_tokens"] >= 0.6


def test_bench_gguf_baseline_runs_a_commit_beside_the_working_tree(hf_dirs, tmp_path, capsys,  # noqa: F811
                                                                    monkeypatch):
    """`--baseline HEAD`: llmd as HEAD has it, imported from a temporary worktree (its
    engine named llmd@HEAD, first), beside the working tree's: both report their figures
    and decode the same tokens; the worktree is gone afterwards. (Without the C++ kernels:
    the worktree's would be built anew, its paths being part of the build's key.)"""
    import subprocess

    from llmd.gpu.layers.cpu.cpu_kernels import CPU_KERNELS_ENV

    monkeypatch.setenv(CPU_KERNELS_ENV, "0")
    path = write_gguf(hf_dirs("llama"), tmp_path / "q8.gguf", T.Q8_0)
    assert bench_gguf.main(["--model", str(path), "--rounds", "1", "--prompt", "16", "--tokens", "4",
                            "--engines", "llmd", "--baseline", "HEAD", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    assert list(report["engines"]) == ["llmd@HEAD", "llmd"]
    runs = {r["engine"]: r for r in (json.loads(line) for line in out.err.splitlines() if line.startswith('{"round"'))}
    assert "bench_gguf-baseline-" in runs["llmd@HEAD"]["llmd_from"]  # the worktree's code ran
    assert "bench_gguf-baseline-" not in runs["llmd"]["llmd_from"]
    assert report["engines"]["llmd"]["same_tokens"] == 1.0
    assert all(f["decode_tok_s"] > 0 for f in report["engines"].values())
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, check=True).stdout
    assert "bench_gguf-baseline-" not in worktrees
