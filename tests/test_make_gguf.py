"""tools/make_gguf.py: the 1B benchmark fixture's pipeline (a random-weight HF model,
llama.cpp's shipped converter, llama.cpp's quantizer through llama-cpp-python) at tiny
shapes. The files hold the model's weights as an independent dequantizer (the gguf
package) reads them, in the types llama.cpp's Q4_K_M and Q8_0 recipes pick; the
metadata carries the rope base and a pre-tokenizer under which llama.cpp tokenizes as
the HF tokenizer does; llmd runs the files as transformers runs them; the cache builds
once. Skipped without llama-cpp-python (the optional `llamacpp` extra) or its converter."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("llama_cpp")

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from gguf_fixtures import gguf_name, permute_rotary_rows  # noqa: E402
from hf_ref import check_logprobs_close, engine_result, hf_greedy, hf_model  # noqa: E402
from llmd import LLM, SamplingParams  # noqa: E402
from llmd_tools import make_gguf  # noqa: E402

try:
    make_gguf.converter_path()
except make_gguf.LlamaCppUnavailable as exc:  # a wheel without the converter, no LLMD_CONVERT_HF_TO_GGUF
    pytest.skip(str(exc), allow_module_level=True)

NAME = "tiny-llama-256"
RELATIVE_ERROR = {T.Q8_0: 0.008, T.Q6_K: 0.027, T.Q4_K: 0.1}
TEXTS = ("Hello, world! def main():\n    return 0", "Größe, 你好, 😀 and some more text.")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The fixture's files in a fresh cache, and its HF model rebuilt beside them (the
    build deletes its own: same recipe, same seed, same weights)."""
    cache = tmp_path_factory.mktemp("gguf-cache")
    files = {q: make_gguf.gguf_fixture(NAME, q, cache_dir=cache, threads=1)
             for q in make_gguf.GGUF_FIXTURES[NAME]["types"]}
    hf_dir = make_gguf.build_hf_model(NAME, tmp_path_factory.mktemp("hf") / NAME, cache_dir=cache)
    return files, hf_dir


def test_the_files_hold_the_models_weights_in_llama_cpps_types(built):
    files, hf_dir = built
    assert sorted(p.name for p in files["Q8_0"].parent.iterdir()) == sorted(
        [f"{NAME}-Q4_K_M.gguf", f"{NAME}-Q8_0.gguf", "llmd_fixture.json"])  # the intermediates are gone
    config = json.loads((hf_dir / "config.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    for quant, file_type in (("Q8_0", 7), ("Q4_K_M", 15)):
        reader = gguf.GGUFReader(files[quant])
        field = reader.get_field
        assert field("general.file_type").contents() == file_type
        assert field("llama.rope.freq_base").contents() == config["rope_parameters"]["rope_theta"] != 10000.0
        assert field("tokenizer.ggml.pre").contents() == "gpt-2"
        tensors = {t.name: t for t in reader.tensors}
        types = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
        # llama.cpp's mixes: Q8_0 throughout; Q4_K_M is Q4_K with Q6_K for the embedding,
        # attn_v and ffn_down (of some layers)
        assert types == ({T.Q8_0} if quant == "Q8_0" else {T.Q4_K, T.Q6_K})
        assert "output.weight" not in tensors  # tied: the embedding is the LM head
        for hf_name, ref in weights.items():
            t = tensors[gguf_name(hf_name)]
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape)
            if hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rotary row order
                heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
                ref = permute_rotary_rows(ref, heads)
            if ref.ndim == 1:  # norms stay float32
                np.testing.assert_array_equal(got, ref)
                continue
            # the type's rounding error, relative RMS (measured 0.0053, 0.018, 0.071; rows out
            # of order or another tensor's data would give ~1.4)
            error = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
            assert error < RELATIVE_ERROR[t.tensor_type], f"{quant} {hf_name}: relative RMS error {error}"


def test_llama_cpp_tokenizes_the_file_as_the_hf_tokenizer_does(built):
    from llama_cpp import Llama

    files, hf_dir = built
    _, tokenizer = hf_model(str(hf_dir))
    llm = Llama(model_path=str(files["Q8_0"]), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == tokenizer(text).input_ids


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_llmd_runs_the_file_as_transformers_does(built, quant):
    assert_runs_as_transformers_does(str(built[0][quant]), quant)


def assert_runs_as_transformers_does(path: str, quant: str) -> None:
    """llmd's greedy tokens and logprobs on the file are transformers' reading it, for 8 of
    16 tokens at least, on each of TEXTS."""
    _, tokenizer = hf_model(path)
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    for text in TEXTS:
        prompt = tokenizer(text).input_ids
        out = llm.generate([prompt], params)[0]
        assert check_logprobs_close(hf_greedy(path, prompt, 16), engine_result(out), f"{quant} {text!r}") >= 8


MOE = "tiny-qwen3-moe-256"


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    cache = tmp_path_factory.mktemp("gguf-moe-cache")
    return {q: make_gguf.gguf_fixture(MOE, q, cache_dir=cache, threads=1)
            for q in make_gguf.GGUF_FIXTURES[MOE]["types"]}


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_llmd_runs_llama_cpps_moe_file_as_transformers_does(moe_files, quant):
    """llama.cpp's converter stacks the experts (ffn_*_exps) and its quantizer gives them
    its mix's types; llmd keeps them packed, and its tokens and logprobs are transformers'
    reading the same file."""
    from llmd.gpu.layers.mlp import ExpertWeights
    from llmd.gpu.models.loader import load_model

    path = str(moe_files[quant])
    reader = gguf.GGUFReader(path)
    exps = {t.tensor_type for t in reader.tensors if t.name.endswith("_exps.weight")}
    assert exps == ({T.Q8_0} if quant == "Q8_0" else {T.Q4_K, T.Q6_K})
    model = load_model(path, torch.float32, torch.device("cpu"), 128)
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    assert len(experts) == 2 and all(e.w13.dtype == torch.uint8 for e in experts)
    assert_runs_as_transformers_does(path, quant)


def test_the_cache_builds_once(built, monkeypatch):
    files, _ = built
    monkeypatch.setattr(make_gguf, "convert_hf_to_gguf", lambda *a, **k: pytest.fail("rebuilt"))
    assert make_gguf.gguf_fixture(NAME, "Q8_0", cache_dir=files["Q8_0"].parent.parent) == files["Q8_0"]
    with pytest.raises(ValueError, match="made in Q4_K_M, Q8_0, not 'Q5_0'"):
        make_gguf.gguf_fixture(NAME, "Q5_0", cache_dir=files["Q8_0"].parent.parent)
