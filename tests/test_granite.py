"""Granite (GraniteForCausalLM): Llama's layers with four multipliers — embeddings times
`embedding_multiplier`, the attention scale `attention_multiplier`, each block's output
times `residual_multiplier` before the residual add, logits over `logits_scaling`. llmd's
greedy tokens and logprobs equal transformers' on the same weights (each multiplier away
from 1, so each one counts), through prefill (the Python layers) and the decode steps
(the C++ decode layers), and a granite GGUF written as llama.cpp's
converter writes it (the multipliers as `_scale` keys) gives the HF model's."""
from __future__ import annotations

import pytest

from gguf import GGMLQuantizationType as T
from gguf_fixtures import write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from llmd import LLM, SamplingParams
from llmd.gpu.layers.cpu.cpu_decode_layers import why_not
from llmd.gpu.models.gguf_arch import granite_config_fields
from llmd.gpu.models.loader import load_hf_config
from tiny_models import tiny_models

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
PROMPTS = [[5, 9, 200, 31, 17, 400, 3, 8, 99, 12], [7, 7, 100]]
MULTIPLIERS = dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4, logits_scaling=3.0)
RECIPE = dict(arch="granite", num_hidden_layers=3, intermediate_size=192, **MULTIPLIERS)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("granite"), {"granite": RECIPE})("granite")


def _check(path: str, hf_dir) -> None:
    llm = LLM(model=path, **SETTINGS)
    try:
        assert why_not(llm.engine.executor.runner.model) is None  # the C++ decode layers decode
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.engine.shutdown()
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert check_logprobs_close(hf_greedy(str(hf_dir), prompt, MAX_TOKENS), engine_result(out), f"#{i}") \
            == MAX_TOKENS


def test_granite_runs_as_transformers_runs_it(hf):
    config = load_hf_config(hf)
    assert {k: getattr(config, k) for k in MULTIPLIERS} == MULTIPLIERS
    _check(str(hf), hf)


def test_a_granite_gguf_runs_as_the_hf_model(hf, tmp_path):
    path = str(write_gguf(hf, tmp_path / "granite-F32.gguf", T.F32))
    config = load_hf_config(path)
    assert config.architectures == ["GraniteForCausalLM"]
    assert {k: getattr(config, k) for k in MULTIPLIERS} == pytest.approx(MULTIPLIERS)
    _check(path, hf)


def test_a_granite_gguf_without_a_multiplier_takes_llama_cpps_default():
    """Where a granite file has no `_scale` key llama.cpp multiplies by 1, and scales
    attention by 1/sqrt(head_dim) (transformers' GraniteConfig would default to 1)."""
    written = {"granite.embedding_scale": 12.0}
    fields = granite_config_fields(written.get, "granite", {"head_dim": 64})
    assert fields == dict(attention_multiplier=0.125, embedding_multiplier=12.0, residual_multiplier=1.0,
                          logits_scaling=1.0)


def test_a_granite_config_with_a_non_positive_multiplier_is_refused(hf, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    config = json.loads((bad / "config.json").read_text())
    config["logits_scaling"] = 0
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="logits_scaling"):
        load_hf_config(bad)
