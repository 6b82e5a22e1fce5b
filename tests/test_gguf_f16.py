"""An F16 GGUF of bfloat16 values (a bf16 checkpoint converted with `--outtype f16`, as
most F16 files are made today) runs in bfloat16 under `--dtype auto` on CPU: its weights
exactly the F16 values, the same model, bit for bit, as a BF16 file of those values,
counted so by the pool's estimate. An F16 file with one value bfloat16 cannot
hold stays float16 (float32 on CPU), as does one of float32 values (test_gguf's
qwen2 F16). The bit rule against torch's own conversion, on every float16."""
from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf import GGMLQuantizationType as T
from gguf_fixtures import write_gguf
from hf_ref import engine_result
from llmd import LLM, SamplingParams
from llmd.config import EngineConfig
from llmd.gpu.layers.cpu.cpu_linear import checkpoint_weight
from llmd.gpu.layers.gguf_types import f16_bits_fit_bfloat16
from llmd.gpu.models.loader import load_hf_config
from llmd.pool.estimate import estimate_need, read_shape
from test_engine_vs_hf import TEXTS
from tiny_models import tiny_models

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
MODULES = ("embed_tokens", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"f16", "bf16", "f16-one-off"}: GGUFs of one checkpoint whose weights are bf16 values
    (and float16 ones)."""
    root = tmp_path_factory.mktemp("gguf-f16")
    hf = tiny_models(root, {"qwen3": dict(arch="qwen3", intermediate_size=192, head_dim=128)})("qwen3")
    rounded = root / "qwen3-bf16-values"
    shutil.copytree(hf, rounded)
    weights = load_file(str(hf / "model.safetensors"))
    # bf16 values as an F16 file holds them: |w| < 2^-17 rounded to f16's subnormal steps,
    # bf16 values too (a BF16 file of the bf16 checkpoint itself differs there)
    save_file({k: v.to(torch.bfloat16).to(torch.float16).float() for k, v in weights.items()},
              str(rounded / "model.safetensors"))
    down = weights["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).to(torch.float16).numpy()
    one_off = down.copy()
    one_off.view(np.uint16)[3, 5] ^= 1  # a float16 whose lowest mantissa bit is set: not a bfloat16
    assert not f16_bits_fit_bfloat16(one_off.view(np.uint16)) and f16_bits_fit_bfloat16(down.view(np.uint16))
    return {"f16": str(write_gguf(rounded, root / "f16.gguf", T.F16)),
            "bf16": str(write_gguf(rounded, root / "bf16.gguf", T.BF16)),
            "f16-one-off": str(write_gguf(rounded, root / "f16-one-off.gguf", T.F16,
                                          raw_tensors={"blk.1.ffn_down.weight": (one_off, T.F16)}))}


def test_the_bit_rule_is_torchs_round_trip_on_every_float16():
    bits = np.arange(1 << 16, dtype=np.uint16)
    halves = torch.from_numpy(bits.view(np.float16).copy())
    exact = halves.to(torch.bfloat16).to(torch.float16).view(torch.int16).numpy().view(np.uint16) == bits
    ours = np.array([f16_bits_fit_bfloat16(bits[i:i + 1]) for i in range(bits.size)])
    nan = torch.isnan(halves).numpy()
    assert np.array_equal(ours[~nan], exact[~nan])
    assert exact.sum() > 8000 and (~exact[~nan]).sum() > 50000  # both kinds, subnormals among them
    assert f16_bits_fit_bfloat16(bits[exact & ~nan]) and not f16_bits_fit_bfloat16(bits[~exact & ~nan])


def test_an_f16_file_of_bfloat16_values_runs_as_its_bf16_file(files, caplog):
    assert str(load_hf_config(files["f16"]).dtype).removeprefix("torch.") == "bfloat16"
    assert str(load_hf_config(files["f16-one-off"]).dtype).removeprefix("torch.") == "float16"
    runs = {}
    for kind in ("f16", "bf16"):
        with caplog.at_level(logging.INFO, logger="llmd.engine"):
            llm = LLM(model=files[kind], device="cpu", num_gpu_blocks_override=64, max_model_len=256)
        assert "KV cache" in caplog.text and "float16 weights run in float32" not in caplog.text
        try:
            assert llm.engine.dtype == torch.bfloat16
            model = llm.engine.executor.runner.model
            weights = {name: checkpoint_weight(model.get_submodule(name)).clone() for name in MODULES}
            tokenizer = llm.engine.tokenizer
            prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
            runs[kind] = weights, [engine_result(out) for out in llm.generate(prompts, GREEDY)]
        finally:
            llm.engine.shutdown()
    for name in MODULES:
        assert runs["f16"][0][name].dtype == torch.bfloat16
        assert torch.equal(runs["f16"][0][name], runs["bf16"][0][name]), name
    assert runs["f16"][1] == runs["bf16"][1]  # every token and logprob
    need = {kind: estimate_need(EngineConfig(model=files[kind], kv_cache_memory_bytes=1), read_shape(files[kind]),
                                "cpu", available_ram=0) for kind in ("f16", "bf16", "f16-one-off")}
    assert need["f16"] == need["bf16"] and need["f16-one-off"]["cpu"] > 1.5 * need["f16"]["cpu"]


def test_an_f16_file_with_one_value_bfloat16_cannot_hold_runs_in_float32(files, caplog):
    """... and says why its weights take twice the file, and what halves them."""
    with caplog.at_level(logging.INFO, logger="llmd.engine"):
        llm = LLM(model=files["f16-one-off"], device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    assert "float16 weights run in float32 on CPU" in caplog.text and "--dtype bfloat16" in caplog.text
    try:
        assert llm.engine.dtype == torch.float32
        down = checkpoint_weight(llm.engine.executor.runner.model.get_submodule("layers.1.mlp.down_proj"))
        assert down.dtype == torch.float32 and down[3, 5] != down[3, 5].to(torch.bfloat16).float()
    finally:
        llm.engine.shutdown()
