"""The Triton paged-attention backend (llmd.gpu.layers.triton_attention) against the PyTorch
reference, and the choice of attention backend at start-up.

With no GPU here the kernels run in Triton's interpreter, which is chosen when triton is
first imported; this process may have imported triton already (xgrammar does), so the
kernel checks run once, in a fresh process with TRITON_INTERPRET=1 (the cases and their
runner are in triton_attention_cases.py), and each case's result becomes one test here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from kernel_runs import DEVICES, case_result, run_case_scripts
from triton_attention_cases import CASES

from llmd.config import EngineConfig, load_engine_config
from llmd.gpu.layers.attention import TorchAttention
from llmd.gpu.layers.attention_backends import resolve_attention_backend
from llmd.gpu.worker.model_runner import ModelRunner
from llmd.gpu.worker.runner_types import RunnerSettings

CASES_SCRIPT = Path(__file__).with_name("triton_attention_cases.py")
SLIDING_MODEL = "tiny-qwen2-sw24"  # layer 0 full attention, layers 1-2 a 24-token window
SOFTCAP_MODEL = "tiny-gemma2-sw16"  # Gemma 2: scores capped at 8, layers sliding 16 / full / sliding 16
CPU = torch.device("cpu")


def runner_settings(**kw) -> RunnerSettings:
    return RunnerSettings(block_size=16, max_model_len=256, valid_vocab_size=1024, eos_token_id=None, seed=0, **kw)


@pytest.fixture(scope="module", params=DEVICES)
def interpreted(request, tiny_llama: Path, model_dirs) -> dict[str, dict]:
    """case name -> result of that case in Triton's interpreter ("cpu"), or compiled on
    a GPU ("cuda", skipped without one); the cases split between two processes running
    side by side."""
    names = list(CASES)
    halves = [["--model", str(tiny_llama), "--softcap-model", str(model_dirs(SOFTCAP_MODEL)),
               *names[:len(names) // 4]],
              ["--sliding-model", str(model_dirs(SLIDING_MODEL)), *names[len(names) // 4:]]]
    return run_case_scripts([(CASES_SCRIPT, args) for args in halves], request.param, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_torch_reference(interpreted: dict[str, dict], name: str) -> None:
    """One layer call from the same cache: the same output (to the case's tolerance)
    and, after the cache write, bit for bit the same whole cache."""
    result = case_result(interpreted, name)
    assert result["cache_err"] == 0.0, result
    assert result["out_err"] <= result["tol"], result


@pytest.mark.parametrize("job,windows,softcaps", [
    ("model", [None] * 3, [None] * 3),
    ("model-fp8", [None] * 3, [None] * 3),
    ("model-int8", [None] * 3, [None] * 3),
    ("model-fp16-cache", [None] * 3, [None] * 3),
    ("model-sliding", [None, 24, 24], [None] * 3),
    ("model-softcap", [16, None, 16], [8.0] * 3),
])
def test_model_runner_with_the_triton_backend_matches_torch(interpreted: dict[str, dict], job: str,
                                                            windows: list[int | None],
                                                            softcaps: list[float | None]) -> None:
    """attention_backend="triton" in RunnerSettings reaches every layer with the layer's
    window and soft-cap, and one mixed step (decodes, a prefill, chunks over cached
    prefixes) of tiny-llama, of a model with sliding-window layers and of Gemma 2
    (soft-capped scores, its own attention scale), gives the torch backend's hidden
    states and caches; with kv_cache_dtype fp8 and int8 too (each runner calibrates its
    scales; the caches' stored values at most one step apart), and float16 (one float16
    step apart)."""
    result = case_result(interpreted, job)
    assert result["windows"] == windows
    assert result["softcaps"] == softcaps
    assert result["out_err"] <= result["tol"], result
    assert result["cache_err"] <= result["cache_tol"], result


@pytest.mark.parametrize("job", ["model-graph", "model-graph-sliding", "model-graph-softcap"])
def test_padded_graph_step_with_the_triton_backend_matches_torch(interpreted: dict[str, dict], job: str) -> None:
    """The decode-graph path (emulated on CPU: static buffers, padding to a captured
    size, scratch-block rows; captured and replayed on CUDA) with the Triton kernels gives the torch backend's eager
    hidden states, and leaves every real cache block as eager does (tiny-llama, and a
    model with sliding-window layers)."""
    result = case_result(interpreted, job)
    assert result["out_err"] <= result["tol"], result
    assert result["cache_err"] <= result["tol"], result


def test_auto_picks_torch_on_cpu(tiny_llama: Path) -> None:
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_attention_backend("torch", CPU) == "torch"
    runner = ModelRunner(str(tiny_llama), runner_settings(), CPU, torch.float32)
    assert runner.attention_backend == "torch"
    assert all(isinstance(layer.self_attn.attn, TorchAttention) for layer in runner.model.layers)


def test_triton_on_cpu_without_the_interpreter_fails_at_start_up(tiny_llama: Path) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("this test process runs with TRITON_INTERPRET set")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=r"attention_backend 'triton' runs on CUDA devices; .*TRITON_INTERPRET=1"):
        ModelRunner(str(tiny_llama), runner_settings(attention_backend="triton"), CPU, torch.float32)


def test_unknown_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton, flash_attn"):
        resolve_attention_backend("xformers", CPU)
    with pytest.raises(ValueError, match="attention_backend must be 'auto', 'torch', 'triton' or 'flash_attn'"):
        EngineConfig(attention_backend="xformers")
    with pytest.raises(msgspec.ValidationError, match="attention_backend"):
        load_engine_config(attention_backend="xformers")
    assert load_engine_config(attention_backend="triton").attention_backend == "triton"


def test_the_torch_path_never_imports_the_triton_module() -> None:
    """Only selecting triton loads llmd.gpu.layers.triton_attention (and so triton itself)."""
    code = ("import sys, torch\n"
            "from llmd.gpu.layers.attention_backends import make_attention, resolve_attention_backend\n"
            "import llmd.gpu.worker.model_runner, llmd.gpu.models.decoder\n"
            "make_attention(resolve_attention_backend('auto', torch.device('cpu')), 4, 2, 16, 0.25)\n"
            "assert 'llmd.gpu.layers.triton_attention' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
