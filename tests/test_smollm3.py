"""SmolLM3 (SmolLM3ForCausalLM): Llama's layers, every fourth without rotary (its config's
`no_rope_layers`). llmd's greedy tokens and logprobs equal transformers' on the same
weights — its NoPE layers included (with rotary on every layer they part), a sliding
window on the NoPE layers where the config asks for one — and a smollm3 GGUF (llama.cpp's
converter: Llama's tensors, no key for the NoPE layers: every fourth, as llama.cpp
leaves them) gives the HF model's tokens (F32), and kept packed its dequantized weights'
model's (Q8_0)."""
from __future__ import annotations

import json
import shutil

import pytest

from gguf import GGMLQuantizationType as T
from gguf_fixtures import write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from llmd import LLM, SamplingParams
from llmd.gpu.models.architectures import NOPE
from llmd.gpu.models.loader import load_hf_config
from tiny_models import tiny_models

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
# 20 tokens: past the window of 8 the sliding fixture's NoPE layers see
PROMPTS = [[5, 9, 200, 31, 17, 400, 3, 8, 99, 12, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [7, 7, 100]]
RECIPES = {
    "smollm3": dict(arch="smollm3", num_hidden_layers=4, intermediate_size=192),  # layer 3 NoPE
    "smollm3-swa": dict(arch="smollm3", num_hidden_layers=4, intermediate_size=192, use_sliding_window=True,
                        sliding_window=8, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("smollm3"), RECIPES)


def _matches_hf(path: str, hf_dir, exact: bool = True, atol: float = 2e-3) -> list[int]:
    """Positions compared with transformers on `hf_dir` before a divergence, per prompt
    (logprobs within `atol`); not `exact`: whether each prompt's tokens or logprobs differ."""
    llm = LLM(model=path, **SETTINGS)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.engine.shutdown()
    compared = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        ref = hf_greedy(str(hf_dir), prompt, MAX_TOKENS)
        if exact:
            compared.append(check_logprobs_close(ref, engine_result(out), f"#{i}", atol=atol))
        else:
            compared.append(ref != engine_result(out))
    return compared


@pytest.mark.parametrize("name", list(RECIPES))
def test_smollm3_runs_as_transformers_runs_it(hf_dirs, name):
    hf = hf_dirs(name)
    config = load_hf_config(hf)
    assert config.no_rope_layers == [1, 1, 1, 0]
    assert _matches_hf(str(hf), hf) == [MAX_TOKENS] * len(PROMPTS)


def test_its_nope_layer_is_what_transformers_runs(hf_dirs, tmp_path):
    """The same weights with rotary on every layer: llmd's tokens or logprobs part from
    transformers' on the real config (the NoPE layer is not a no-op to get wrong)."""
    from llmd.gpu.models.decoder import CausalLM

    hf = hf_dirs("smollm3")
    llm = LLM(model=str(hf), **SETTINGS)
    assert llm.engine.executor.runner.model.layer_rope_keys[3] == NOPE
    assert isinstance(llm.engine.executor.runner.model, CausalLM)
    llm.engine.shutdown()
    every = tmp_path / "rotary-everywhere"
    shutil.copytree(hf, every)
    config = json.loads((every / "config.json").read_text())
    config["no_rope_layers"] = [1, 1, 1, 1]
    (every / "config.json").write_text(json.dumps(config))
    assert any(_matches_hf(str(every), hf, exact=False))


def test_a_config_with_a_bad_no_rope_list_is_refused(hf_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dirs("smollm3"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["no_rope_layers"] = [1, 1, 0]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no_rope_layers"):
        load_hf_config(bad)


def test_a_smollm3_gguf_runs_as_the_hf_model(hf_dirs, tmp_path):
    hf = hf_dirs("smollm3")
    path = str(write_gguf(hf, tmp_path / "smollm3-F32.gguf", T.F32))
    config = load_hf_config(path)
    assert config.architectures == ["SmolLM3ForCausalLM"] and config.no_rope_layers == [1, 1, 1, 0]
    assert _matches_hf(path, hf) == [MAX_TOKENS] * len(PROMPTS)


@pytest.mark.usefixtures("float32_products")
def test_a_packed_smollm3_gguf_computes_its_weights(hf_dirs, tmp_path):
    """Kept packed (Q8_0): the model of its weights dequantized by the gguf package (the
    dense path the F32 file checks), to float32's roundings."""
    path = str(write_gguf(hf_dirs("smollm3"), tmp_path / "smollm3-Q8_0.gguf", T.Q8_0))
    runs = []
    for dequantize in (False, True):
        llm = LLM(model=path, dequantize=dequantize, **SETTINGS)
        runs.append([engine_result(out) for out in llm.generate(PROMPTS, GREEDY)])
        llm.engine.shutdown()
    for i, (packed, dense) in enumerate(zip(*runs)):
        assert check_logprobs_close(dense, packed, f"#{i}") == MAX_TOKENS
