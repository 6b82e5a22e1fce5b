"""Phi-3 GGUFs (`general.architecture` phi3: Phi-3, Phi-3.5, Phi-4, Phi-4-mini) as
llama.cpp's converter writes them (gguf_fixtures' writer, checked equal to the converter's
output by hand): q/k/v in one `attn_qkv`, gate and up in one `ffn_up`, a rotation of part
of each head, a 128k model's longrope factors as two tensors, the window (0: none). llmd
runs the file as transformers runs the HF model it was made from (F32: a prompt under the
original context, decode steps past it and past the window), and its Q8_0 weights packed
as transformers computes them; rope tensors where they do not belong are refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gguf
from gguf import GGMLQuantizationType as T
from gguf_fixtures import write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy, model_greedy
from llmd import LLM, SamplingParams
from llmd.gpu.models.loader import load_hf_config
from tiny_models import tiny_models

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
# 40 prompt tokens and 24 more: the long factors from position 48 on, past the window of 16
PROMPTS = [list(range(5, 45)), [7, 7, 100, 31, 17]]
LONGROPE = dict(arch="phi3", pad_vocab=False, sliding_window=16, original_max_position_embeddings=48,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})
PLAIN = dict(arch="phi3", pad_vocab=False, sliding_window=None)  # Phi-4's: no window, no longrope


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    hf = tiny_models(root, {"longrope": LONGROPE, "plain": PLAIN})
    return lambda name, qtype=T.F32: (hf(name), write_gguf(hf(name), root / f"{name}-{qtype.name}.gguf", qtype))


def _compare(llm: LLM, reference) -> None:
    for i, (prompt, out) in enumerate(zip(PROMPTS, llm.generate(PROMPTS, GREEDY))):
        compared = check_logprobs_close(reference(prompt), engine_result(out), f"#{i}")
        assert compared == MAX_TOKENS, f"#{i}: diverged at token {compared}"


@pytest.mark.parametrize("name", ["longrope", "plain"])
def test_a_phi3_file_runs_as_transformers_runs_its_model(models, name):
    hf, path = models(name)
    config, reference = load_hf_config(path).to_dict(), AutoConfig.from_pretrained(hf).to_dict()
    for key in ("architectures", "sliding_window", "original_max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == reference[key], key
    rope, expected = config["rope_parameters"], reference["rope_parameters"]
    assert rope.get("partial_rotary_factor", 1.0) == expected.get("partial_rotary_factor", 1.0)
    for key in ("long_factor", "short_factor"):  # the file's float32s
        assert np.array_equal(np.float32(rope.get(key, [])), np.float32(expected.get(key, []))), key
    _compare(LLM(model=str(path), **SETTINGS), lambda prompt: hf_greedy(str(hf), prompt, MAX_TOKENS))


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("tp", [1, 2])
def test_a_packed_phi3_file_computes_its_weights(models, tp):
    """At TP=2 each rank takes its q, k and v rows (and gate and up rows) out of the one
    packed tensor the file holds them in."""
    hf, path = models("longrope", T.Q8_0)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors if t.name.endswith("attn_qkv.weight")} == {T.Q8_0}
    config = AutoConfig.from_pretrained(hf)
    ref = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name, config=config,
                                               dtype=torch.float32).eval()
    llm = LLM(model=str(path), tensor_parallel_size=tp, **SETTINGS)
    try:
        assert {kind for kind in llm.engine.executor.weight_bytes() if kind[:1] == "Q"} == {"Q8_0"}  # kept packed
        _compare(llm, lambda prompt: model_greedy(ref, config.vocab_size, prompt, MAX_TOKENS))
    finally:
        llm.engine.shutdown()


def test_rope_tensors_where_they_do_not_belong_are_refused(models, tmp_path):
    plain_hf, _ = models("plain")
    one = write_gguf(plain_hf, tmp_path / "one.gguf", extra_tensors={"rope_factors_long.weight": np.ones(6, np.float32)})
    with pytest.raises(ValueError, match=r"rope_factors_long.weight, rope_factors_short.weight \(longrope factors\) "
                                         r"come in pairs in a 'phi3' model; this file has rope_factors_long.weight"):
        load_hf_config(one)
    wrong = write_gguf(plain_hf, tmp_path / "wrong.gguf", extra_tensors={
        "rope_factors_long.weight": np.ones(5, np.float32), "rope_factors_short.weight": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match=r"'rope_factors_long.weight' has shape \[5\]; it must hold one factor per "
                                         r"rotated frequency: \[8\] for the 16 rotated dimensions"):
        load_hf_config(wrong)
    llama = write_gguf(tiny_models(tmp_path, {"llama": dict(arch="llama", llama3_rope=False)})("llama"),
                       tmp_path / "llama.gguf", extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32),
                                                               "rope_factors_short.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match=r"\(longrope factors\) are not part of a 'llama' model"):
        load_hf_config(llama)
