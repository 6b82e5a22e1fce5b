"""AWQ, GPTQ and FP8 safetensors checkpoints load packed and compute what their weights
mean: llmd's greedy tokens and logprobs on the quantized checkpoint equal HF
transformers' on the dequantized weights (fp32), the dequantization written from each
format's layout in tests/quant_reference.py; for the FP8 layouts transformers reads
itself (HF's fine-grained FP8, and compressed-tensors' through its own package), on the
quantized checkpoint directly. The checkpoints are written by
llmd_tools.quantize_checkpoint from random-weight fixtures: AWQ (llama, qwen2 with q/k/v
bias, Phi-3 with its fused q/k/v and gate/up), GPTQ 4-bit symmetric v1, 4-bit asymmetric
v2 with act-order (an order per module), 8-bit act-order with a quantized LM head, FP8
per tensor, per channel and per block. The memory account shows the packed storage
close to the files' size; modules the config keeps dense stay dense; `dequantize=True`
loads the same checkpoint dense; what llmd cannot keep packed is refused by name."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_ref import check_logprobs_close, engine_result, hf_greedy, hf_model
from llmd import LLM
from llmd_tools.make_model import build_model
from llmd_tools.quantize_checkpoint import options, quantize_checkpoint
from quant_reference import write_dequantized
from test_engine_vs_hf import TEXTS
from test_gguf import GREEDY, MAX_TOKENS

SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
# Dense fixtures whose linear layers' input sizes are whole 32- and 64-column groups.
DENSE = {
    "llama": dict(arch="llama", intermediate_size=192),
    "qwen2": dict(arch="qwen2", intermediate_size=192),
    "qwen3": dict(arch="qwen3", intermediate_size=192),
    "phi3": dict(arch="phi3", intermediate_size=192),
    "qwen3-moe": dict(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      intermediate_size=192, mlp_only_layers=[1]),
}
CASES = {
    "awq-llama-g32": ("llama", dict(method="awq", group_size=32)),
    "awq-qwen2-g64": ("qwen2", dict(method="awq", group_size=64)),
    "awq-phi3-fused": ("phi3", dict(method="awq", group_size=32)),
    "gptq4-sym-v1": ("llama", dict(method="gptq", group_size=32)),
    "gptq4-asym-v2-act-order": ("llama", dict(method="gptq", group_size=32, sym=False, gptq_v2=True, act_order=True,
                                              order_per_module=True)),
    "gptq8-act-order-lm-head": ("llama", dict(method="gptq", bits=8, group_size=64, act_order=True, lm_head=True)),
    "fp8-tensor": ("llama", dict(method="fp8", fp8_style="tensor")),
    "fp8-channel-qwen3": ("qwen3", dict(method="fp8", fp8_style="channel")),
    "fp8-block": ("llama", dict(method="fp8", fp8_style="block", block=(32, 32))),
}
LABELS = {"awq": "awq-int4", "fp8": "fp8-e4m3"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")

    @functools.cache
    def dense(name: str) -> Path:
        recipe = dict(DENSE[name])
        return build_model(root / f"dense-{name}", recipe.pop("arch"), "tiny", **recipe)

    @functools.cache
    def get(case: str, **extra) -> Path:
        base, opts = CASES[case] if case in CASES else (case, {})
        tag = case + "".join(f"-{k}={v}" for k, v in sorted(extra.items()))
        return quantize_checkpoint(dense(base), root / tag, options(**{**opts, **extra}))

    get.dense = dense
    return get


def _compare(reference: str, llm: LLM, name: str) -> None:
    _, tokenizer = hf_model(reference)
    prompts = [tokenizer(t).input_ids for t in TEXTS[:2]]
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, GREEDY))):
        compared = check_logprobs_close(hf_greedy(reference, prompt, MAX_TOKENS), engine_result(out), f"{name} #{i}",
                                        atol=1e-3)
        assert compared >= MAX_TOKENS // 2, f"{name} #{i}: diverged at token {compared}"


def _label(path: Path) -> str:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return LABELS.get(qc["quant_method"], f"{qc['quant_method']}-int{qc.get('bits')}") \
        if qc["quant_method"] != "compressed-tensors" else "fp8-e4m3"


def _quantized_layers(llm: LLM) -> dict[str, str]:
    model = llm.engine.executor.runner.model
    return {name: m.quant for name, m in model.named_modules() if getattr(m, "quant", None)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_computes_what_its_dequantized_weights_do(checkpoints, tmp_path, case):
    path = checkpoints(case)
    llm = LLM(model=str(path), **SETTINGS)
    try:
        layers = _quantized_layers(llm)
        assert set(layers.values()) == {_label(path)}
        assert len(layers) == 4 * 3 + ("lm-head" in case)  # qkv, o, gate_up, down of 3 layers (+ LM head)
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, case)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("case", ["fp8-block", "fp8-channel-qwen3"])
def test_transformers_reads_the_fp8_checkpoint_itself_as_llmd_does(checkpoints, tmp_path, case):
    """transformers dequantizes HF's fine-grained FP8 on CPU itself, and compressed-tensors'
    float-quantized through the compressed-tensors package: the format owners' readers."""
    path = checkpoints(case)
    reference = path
    if "channel" in case:
        pytest.importorskip("compressed_tensors")
        reference = _weights_only(path, tmp_path / "weights-only")
    llm = LLM(model=str(path), **SETTINGS)
    try:
        _compare(str(reference), llm, case)
    finally:
        llm.engine.shutdown()


def _weights_only(path: Path, out: Path) -> Path:
    """The checkpoint without its activation scheme: compressed-tensors would quantize
    the activations too (per token, W8A8), where llmd runs W8A16."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (out / "config.json").write_text(json.dumps(config))
    return out


def _quantized_file_bytes(path: Path) -> int:
    """Bytes of the file's quantized tensors (codes, zero points, scales, g_idx)."""
    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            if t.get_dtype() in ("I32", "F8_E4M3") or name.endswith((".scales", ".weight_scale", ".weight_scale_inv")):
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * {"I32": 4, "F8_E4M3": 1, "F16": 2, "F32": 4, "BF16": 2}[t.get_dtype()]
    return total


@pytest.mark.parametrize("case,low,high", [("awq-llama-g32", 1.0, 1.25), ("gptq4-sym-v1", 0.85, 1.0),
                                           ("fp8-tensor", 1.0, 1.1)])
def test_the_memory_account_shows_the_packed_storage(checkpoints, case, low, high):
    path = checkpoints(case)
    packed, dense = LLM(model=str(path), **SETTINGS), LLM(model=str(path), dequantize=True, **SETTINGS)
    try:
        weights, dense_weights = packed.engine.memory().weights, dense.engine.memory().weights
        in_file = _quantized_file_bytes(path)
        label = _label(path)
        # AWQ's groups of 32 become Q5_0 blocks (one more bit a code), GPTQ's symmetric
        # ones Q4_0 (g_idx not kept), FP8 its bytes and a float32 scale per row (5 % of
        # these 64- and 192-column rows, 0.2 % of a 2048-column one).
        assert low * in_file <= weights[label] <= high * in_file, (weights, in_file)
        assert label not in dense_weights and _quantized_layers(dense) == {}
        assert sum(dense_weights.values()) > sum(weights.values()) + 3 * weights[label]
    finally:
        packed.engine.shutdown()
        dense.engine.shutdown()
