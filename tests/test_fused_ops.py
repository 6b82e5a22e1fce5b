"""The fused layer ops (llmd.gpu.layers.fused_ops_triton) against their torch references
(llmd.gpu.layers.fused_ops.LayerOps and attention_inputs_reference, which compute what the
unfused layers compute), and model steps with fusion on against the same steps with it
off, both with the Triton attention backend; and the choice of ops (LLMD_FUSED_OPS).

With no GPU here the kernels run in Triton's interpreter, which is chosen when triton is
first imported; this process may have imported triton already (xgrammar does), so the
kernel checks run once, in a fresh process with TRITON_INTERPRET=1: this file run as a
script,

    TRITON_INTERPRET=1 python tests/test_fused_ops.py [--model NAME=DIR ...] [CASE ...]

prints one JSON line per case, and each case's result becomes one test here. Where a GPU
is present the same cases also run compiled (`--device cuda`, kernel_runs.py).

Tolerances. float32: within 1e-5 (absolute and relative): the kernels and torch round
the same fp32 operations but sum, rsqrt and exp in their own order. bfloat16: every
element within one bf16 ulp of the reference (2^-7 relative, 1e-5 absolute near zero)
and at most 2% of the elements not bit-identical: the kernels round to bf16 where torch
does, so they differ only where the fp32 value rounded differs in its last bits (a
kernel rounding silu before the product or not differs in ~27% of the elements).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kernel_runs import DEVICES, case_result, run_case_scripts, script_device

from llmd.gpu.layers import fused_ops
from llmd.gpu.layers.fused_ops import FUSED_OPS_ENV, UNFUSED, LayerOps, attention_inputs_reference, layer_ops
from llmd.gpu.layers.kv_quant import INT8, UNIT_SCALES, KVScales, cache_dtype, kv_cache_format, quantize
from llmd.gpu.layers.norms import GemmaRMSNorm, RMSNorm

TOLERANCE = {"float32": (1e-5, 1e-5, 1.0), "bfloat16": (1e-5, 2.0 ** -7, 0.02)}  # atol, rtol, mismatch share
# Model fixtures the model-level cases run: Llama, Qwen3 (q/k norms), Gemma 3 (Gemma
# norms on q/k and layers, gelu-tanh, two rope tables), Phi-3 (partial rotary, longrope).
MODELS = ("tiny-llama", "tiny-qwen3", "tiny-gemma3-sw16", "tiny-phi3-longrope")
# Gemma 3's final norm scales hidden states to ~300 (test_triton_attention's note on its
# fixture), so its step is compared at 1e-3; the others at 1e-4.
MODEL_TOL = {"tiny-gemma3-sw16": 1e-3}


DEVICE = torch.device("cpu")  # where the cases run (main sets it from --device)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict[str, float]:
    """excess: the largest |out - ref| beyond the dtype's tolerance (<= 0 passes);
    mismatch: the share of elements not bit-identical."""
    atol, rtol, _ = TOLERANCE[dtype]
    out, ref = out.float(), ref.float()
    excess = ((out - ref).abs() - (atol + rtol * ref.abs())).max().item() if ref.numel() else 0.0
    mismatch = (out != ref).float().mean().item() if ref.numel() else 0.0
    return {"excess": excess, "mismatch": mismatch, "max_mismatch": TOLERANCE[dtype][2]}


def _norm(cls: type[RMSNorm], n: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = cls(n, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=gen))
    return norm.to(dtype).to(DEVICE)


def norm_case(tokens: int, hidden: int, dtype: str, gemma: bool, add: bool) -> dict:
    from llmd.gpu.layers import fused_ops_triton

    gen = torch.Generator().manual_seed(tokens * hidden)
    dt = getattr(torch, dtype)
    norm = _norm(GemmaRMSNorm if gemma else RMSNorm, hidden, dt, gen)
    x, residual = _randn(gen, tokens, hidden, dtype=dt, scale=3.0), _randn(gen, tokens, hidden, dtype=dt)
    if not add:
        return compare(fused_ops_triton.rms_norm(x, norm.weight, norm.eps, gemma), UNFUSED.rms_norm(norm, x), dtype)
    out, res = fused_ops_triton.rms_norm(x, norm.weight, norm.eps, gemma, residual)
    ref, ref_res = UNFUSED.add_rms_norm(norm, x, residual)
    result = compare(out, ref, dtype)
    result["residual_mismatch"] = (res != ref_res).sum().item()  # one rounded add: always bit-identical
    return result


def act_case(tokens: int, inter: int, dtype: str, activation: str) -> dict:
    from llmd.gpu.layers import fused_ops_triton

    gen = torch.Generator().manual_seed(tokens + inter)
    gate_up = _randn(gen, tokens, 2 * inter, dtype=getattr(torch, dtype), scale=2.0)
    return compare(fused_ops_triton.act_and_mul(gate_up, activation), UNFUSED.act_and_mul(gate_up, activation),
                   dtype)


def qkv_case(tokens: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, dtype: str,
             qk_norm: type[RMSNorm] | None, kv_cache_dtype: str = "auto") -> dict:
    """One layer's attention inputs: q against the reference's, and the cache: the K and
    V of the named slots as the reference wrote them, every other element untouched. A
    padding row (slot -1) writes nothing; the step's slots are scattered over the pool."""
    from llmd.gpu.layers import fused_ops_triton

    gen = torch.Generator().manual_seed(tokens * head_dim + heads)
    dt = getattr(torch, dtype)
    qkv = _randn(gen, tokens, (heads + 2 * kv_heads) * head_dim + 8, dtype=dt)[:, 8:]  # a strided view
    freqs = torch.outer(torch.randint(0, 500, (tokens,), generator=gen).float(),
                        torch.rand(rotary_dim // 2, generator=gen))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (t.to(dt).unsqueeze(1).to(DEVICE) for t in (emb.cos(), emb.sin()))  # as rotary.cos_sin gives them
    norms = (None, None) if qk_norm is None else (_norm(qk_norm, head_dim, dt, gen), _norm(qk_norm, head_dim, dt, gen))
    blocks, block_size = tokens // 4 + 3, 4
    cache = _randn(gen, 2, kv_heads, blocks, block_size, head_dim, dtype=dt)
    fmt = kv_cache_format(kv_cache_dtype)
    scales = UNIT_SCALES if fmt is None else KVScales(0.03, 0.02) if fmt is INT8 else KVScales(0.5, 0.01)
    if fmt is not None:  # a quantized cache (int8 clips |K| > 3.8; fp8's V scale lifts |V| < 0.16 from subnormals)
        cache = quantize(cache, fmt, 1.0)
    elif kv_cache_dtype != "auto":  # float16 / bfloat16 under float32 activations
        cache = cache.to(cache_dtype(kv_cache_dtype, dt))
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    slots = slots.to(DEVICE)
    fused_cache = cache.clone()
    kernel_norm = None if qk_norm is None else (norms[0].weight, norms[1].weight, 1e-6, norms[0].gemma_scale)
    q = fused_ops_triton.qkv_rope_cache(qkv, heads, kv_heads, head_dim, cos, sin, fused_cache, slots, kernel_norm,
                                        scales)
    real = slots >= 0
    ref_cache = cache.clone()
    ref_q = attention_inputs_reference(qkv[real], heads, kv_heads, head_dim, *norms, cos[real], sin[real], ref_cache,
                                       slots[real], scales)
    result = compare(q[real], ref_q, dtype)
    flat = (2, kv_heads, blocks * block_size, head_dim)
    named = torch.zeros(blocks * block_size, dtype=torch.bool, device=DEVICE)
    named[slots[real]] = True
    fused_flat, ref_flat, old_flat = (c.view(flat) for c in (fused_cache, ref_cache, cache))
    result["untouched_changed"] = (fused_flat[:, :, ~named] != old_flat[:, :, ~named]).sum().item()
    result["v_mismatch"] = (fused_flat[1][:, named] != ref_flat[1][:, named]).sum().item()
    if kv_cache_dtype != "auto":  # K rounds where the reference's rounds: at most the next stored value over
        steps = (_stored_rank(fused_flat[0][:, named], fmt) - _stored_rank(ref_flat[0][:, named], fmt)).abs()
        result["k_excess"] = steps.max().item() - 1
        result["k_mismatch"] = (steps != 0).float().mean().item()
        return result
    k_result = compare(fused_flat[0][:, named], ref_flat[0][:, named], dtype)
    result["k_excess"], result["k_mismatch"] = k_result["excess"], k_result["mismatch"]
    return result


def _stored_rank(raw: torch.Tensor, fmt) -> torch.Tensor:
    """A quantized or 16-bit float cache's elements as ordinals in their values' order (an
    e4m3 byte, a float16 or bfloat16 is sign and magnitude: its magnitude bits count up
    with the value)."""
    if fmt is INT8:
        return raw.long()
    if fmt is None:  # float16 / bfloat16 (fmt: None)
        bits = raw.view(torch.int16).long()
        magnitude = bits & 0x7FFF
        return torch.where(bits < 0, -magnitude, magnitude)
    magnitude = (raw & 0x7F).long()
    return torch.where(raw >= 0x80, -magnitude, magnitude)


def _model_step(model_dir: str, fused: bool, dtype: torch.dtype, backend: str = "triton"
                ) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """(hidden states, every layer's cache, each layer's ops.fused) of one mixed step of
    the model with the Triton backend (or `backend`: test_cpu_fused_ops runs "torch"),
    fusion forced on or off, from a random cache."""
    from llmd.gpu.worker.model_runner import ModelRunner
    from llmd.gpu.worker.runner_types import RunnerSettings
    from triton_attention_cases import step_metadata

    os.environ[FUSED_OPS_ENV] = "1" if fused else "0"
    md, num_blocks, positions = step_metadata((1, 17, 40), ((0, 7), (20, 3)), 16, torch.Generator().manual_seed(1))
    settings = RunnerSettings(block_size=16, max_model_len=256, valid_vocab_size=1024, eos_token_id=None, seed=0,
                              attention_backend=backend)
    runner = ModelRunner(model_dir, settings, DEVICE, dtype)
    runner.initialize_kv_cache(num_blocks)
    fill = torch.Generator().manual_seed(2)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=fill))
    ids = torch.randint(runner.vocab_size, positions.shape, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        runner.attention_metadata.build(md)
        hidden = runner.model(ids.to(DEVICE), positions, runner.kv_caches, md)
    modules = [m for m in runner.model.modules() if isinstance(getattr(m, "ops", None), LayerOps)]
    return hidden, torch.stack(runner.kv_caches), sorted({m.ops.fused for m in modules})


def model_case(model_dir: str, tol: float, dtype: str = "float32") -> dict:
    """One mixed step (decodes, a prefill, a chunk over a cached prefix) with fusion on and
    off: the same hidden states and the same caches."""
    dt = getattr(torch, dtype)
    hidden_on, caches_on, fused_on = _model_step(model_dir, True, dt)
    hidden_off, caches_off, fused_off = _model_step(model_dir, False, dt)
    return {"out_err": (hidden_on.float() - hidden_off.float()).abs().max().item(),
            "cache_err": (caches_on.float() - caches_off.float()).abs().max().item(),
            "tol": tol, "fused": [fused_on, fused_off]}


def graph_case(model_dir: str) -> dict:
    """test_triton_attention's padded decode-graph step (emulated: static buffers, padded
    rows in the scratch block) with the Triton layers fused, against the torch backend's
    eager step."""
    from triton_attention_cases import run_model_graph

    os.environ[FUSED_OPS_ENV] = "1"
    return run_model_graph(model_dir)


def kernel_cases() -> dict[str, Callable[[], dict]]:
    cases: dict[str, Callable[[], dict]] = {}
    for i, (dtype, gemma, add) in enumerate((d, g, a) for d in ("float32", "bfloat16") for g in (False, True)
                                            for a in (False, True)):
        tokens = (1, 3, 17)[i % 3]
        name = f"norm-{'gemma' if gemma else 'llama'}{'-add' if add else ''}-{dtype}-t{tokens}"
        cases[name] = lambda args=(tokens, 200, dtype, gemma, add): norm_case(*args)
    for i, (dtype, act) in enumerate((d, a) for d in ("float32", "bfloat16")
                                     for a in ("silu", "gelu_pytorch_tanh", "gelu")):
        tokens, inter = (1, 3, 17)[i % 3], (1100, 300, 172)[i % 3]  # 1100: two column blocks
        cases[f"act-{act}-{dtype}-t{tokens}"] = lambda args=(tokens, inter, dtype, act): act_case(*args)
    qkv = {  # name: tokens, heads, kv heads, head_dim, rotary dim, dtype, q/k norm
        "qkv-d64-gqa2-fp32-t17": (17, 4, 2, 64, 64, "float32", None),
        "qkv-d80-mha-qknorm-fp32-t3": (3, 2, 2, 80, 80, "float32", RMSNorm),
        "qkv-d96-partial-gqa3-gemma-fp32-t1": (1, 6, 2, 96, 64, "float32", GemmaRMSNorm),
        "qkv-d80-partial-qknorm-fp32-t17": (17, 4, 1, 80, 48, "float32", RMSNorm),
        "qkv-d64-gqa2-bf16-t3": (3, 4, 2, 64, 64, "bfloat16", None),
        "qkv-d80-partial-qknorm-bf16-t17": (17, 4, 2, 80, 48, "bfloat16", RMSNorm),
        "qkv-d96-gemma-bf16-t17": (17, 3, 1, 96, 96, "bfloat16", GemmaRMSNorm),
        # Into a quantized cache (kv_cache_dtype): torch's quantizer's bytes.
        "qkv-d64-gqa2-fp32-t17-fp8": (17, 4, 2, 64, 64, "float32", None, "fp8"),
        "qkv-d80-mha-qknorm-fp32-t3-int8": (3, 2, 2, 80, 80, "float32", RMSNorm, "int8"),
        "qkv-d80-partial-qknorm-bf16-t17-fp8": (17, 4, 2, 80, 48, "bfloat16", RMSNorm, "fp8"),
        "qkv-d64-gqa2-bf16-t3-int8": (3, 4, 2, 64, 64, "bfloat16", None, "int8"),
        # Into a 16-bit float cache under float32 activations: torch's conversion's bits.
        "qkv-d80-partial-qknorm-fp32-t17-f16cache": (17, 4, 2, 80, 48, "float32", RMSNorm, "float16"),
        "qkv-d64-gqa2-fp32-t3-bf16cache": (3, 4, 2, 64, 64, "float32", None, "bfloat16"),
    }
    for name, args in qkv.items():
        cases[name] = lambda args=args: qkv_case(*args)
    return cases


CASES = kernel_cases()


def main(args: list[str]) -> None:
    """Args: case names, `--kernels` for every kernel case (also the default when no
    case and no model is named), `--model NAME=DIR` for the model cases of that fixture
    ("model-NAME"; for tiny-llama also "model-NAME-bf16" and "graph-NAME"), `--device
    cpu|cuda` (kernel_runs.script_device)."""
    global DEVICE
    import triton_attention_cases

    DEVICE = triton_attention_cases.DEVICE = script_device(args)
    jobs: dict[str, Callable[[], dict]] = {}
    while "--model" in args:
        i = args.index("--model")
        name, model_dir = args[i + 1].split("=", 1)
        del args[i:i + 2]
        jobs[f"model-{name}"] = lambda d=model_dir, t=MODEL_TOL.get(name, 1e-4): model_case(d, t)
        if name == "tiny-llama":
            jobs[f"model-{name}-bf16"] = lambda d=model_dir: model_case(d, 5e-2, "bfloat16")
            jobs[f"graph-{name}"] = lambda d=model_dir: graph_case(d)
    if "--kernels" in args or not (args or jobs):
        args = [name for name in args if name != "--kernels"] + list(CASES)
    for name in args:
        jobs[name] = CASES[name]
    for name, job in jobs.items():
        try:
            result = {"case": name, **job()}
        except Exception:
            result = {"case": name, "error": traceback.format_exc()}
        print(json.dumps(result), flush=True)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=DEVICES)
def interpreted(request, model_dirs) -> dict[str, dict]:
    """case name -> its result in Triton's interpreter ("cpu"), or compiled on a GPU
    ("cuda", skipped without one); the cases split between two processes running side
    by side: the kernels and two models, the other two models."""
    models = [["--model", f"{name}={model_dirs(name)}"] for name in MODELS]
    halves = (["--kernels", *models[2], *models[3]], [*models[0], *models[1]])
    return run_case_scripts([(Path(__file__), args) for args in halves], request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_their_references(interpreted: dict[str, dict], name: str) -> None:
    result = case_result(interpreted, name)
    assert result["excess"] <= 0, result
    assert result["mismatch"] <= result["max_mismatch"], result
    if name.startswith("norm") and "-add" in name:
        assert result["residual_mismatch"] == 0, result
    if name.startswith("qkv"):
        assert result["untouched_changed"] == 0, result  # no slot but the named ones written
        assert result["v_mismatch"] == 0, result  # V copied bit for bit
        assert result["k_excess"] <= 0 and result["k_mismatch"] <= result["max_mismatch"], result


@pytest.mark.parametrize("job", [f"model-{name}" for name in MODELS] + ["model-tiny-llama-bf16"])
def test_model_step_with_fusion_matches_without(interpreted: dict[str, dict], job: str) -> None:
    """Every layer's ops follow the switch, and the fused step gives the unfused step's
    hidden states and caches."""
    result = case_result(interpreted, job)
    assert result["fused"] == [[True], [False]], result
    assert result["out_err"] <= result["tol"], result
    assert result["cache_err"] <= result["tol"], result


def test_fused_padded_graph_step_matches_torch(interpreted: dict[str, dict]) -> None:
    result = case_result(interpreted, "graph-tiny-llama")
    assert result["out_err"] <= result["tol"], result
    assert result["cache_err"] <= result["tol"], result


def test_the_switch_and_the_torch_backend(monkeypatch) -> None:
    """The torch backend never fuses (its attention writes the cache itself); "0" turns
    fusion off for every backend; anything but 0/1/auto/off/on is refused."""
    for setting in ("", "auto", "0", "1", "off", "on"):
        monkeypatch.setenv(FUSED_OPS_ENV, setting)
        assert layer_ops("torch") is UNFUSED
    for setting in ("0", "off"):
        monkeypatch.setenv(FUSED_OPS_ENV, setting)
        assert layer_ops("triton") is UNFUSED and layer_ops("flash_attn") is UNFUSED
    monkeypatch.setenv(FUSED_OPS_ENV, "yes")
    with pytest.raises(ValueError, match="LLMD_FUSED_OPS must be one of 0, 1, auto"):
        fused_ops.fused_ops_setting()


if __name__ == "__main__":
    main(sys.argv[1:])
