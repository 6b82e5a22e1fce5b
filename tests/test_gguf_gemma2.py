"""Gemma 2 GGUFs (`general.architecture` gemma2) as llama.cpp's converter writes them
(gguf_fixtures' writer: its Gemma2Model's keys, norms stored as 1 + w under llama.cpp's
names): llmd's greedy tokens and logprobs equal transformers' on the HF model the file
was made from (F32: sliding layers past their window, soft-capped attention and logits)
and on the file's own weights (Q8_0, kept packed), the config as llama.cpp derives it.
transformers' GGUF reader is the reference for the weights only: it leaves Gemma 2's
soft-caps and attention scale at their defaults, so the HF model's config goes with it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gguf import GGMLQuantizationType as T
from gguf_fixtures import write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy, model_greedy
from llmd import LLM, SamplingParams
from llmd.gpu.models.gguf_arch import gemma2_config_fields
from llmd.gpu.models.loader import load_hf_config
from tiny_models import tiny_models

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
# 18 tokens: past the window of 16 the sliding layers see
PROMPTS = [[5, 9, 200, 31, 17, 400, 3, 8, 99, 12, 14, 15, 16, 17, 18, 19, 20, 21], [7, 7, 100]]
RECIPE = dict(arch="gemma2", tie_word_embeddings=True, head_dim=24, query_pre_attn_scalar=24, sliding_window=16,
              attn_logit_softcapping=8.0, final_logit_softcapping=30.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    hf = tiny_models(root, {"gemma2": RECIPE})("gemma2")
    return hf, {q: write_gguf(hf, root / f"gemma2-{q.name}.gguf", q) for q in (T.F32, T.Q8_0)}


def _compare(llm: LLM, reference) -> None:
    for i, (prompt, out) in enumerate(zip(PROMPTS, llm.generate(PROMPTS, GREEDY))):
        compared = check_logprobs_close(reference(prompt), engine_result(out), f"#{i}")
        assert compared == MAX_TOKENS, f"#{i}: diverged at token {compared}"


def test_a_gemma2_file_runs_as_transformers_runs_its_model(model):
    hf, files = model
    config, reference = load_hf_config(files[T.F32]).to_dict(), AutoConfig.from_pretrained(hf).to_dict()
    for key in ("architectures", "layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "head_dim", "hidden_activation", "rope_parameters", "tie_word_embeddings"):
        assert config[key] == reference[key], key
    _compare(LLM(model=str(files[T.F32]), **SETTINGS), lambda prompt: hf_greedy(str(hf), prompt, MAX_TOKENS, attn_implementation="eager"))


@pytest.mark.usefixtures("float32_products")
def test_a_packed_gemma2_file_computes_its_weights(model):
    hf, files = model
    path = Path(files[T.Q8_0])
    config = AutoConfig.from_pretrained(hf)
    config._attn_implementation = "eager"  # Gemma 2's attention soft-cap
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                               dtype=torch.float32).eval()
    _compare(LLM(model=str(path), **SETTINGS), lambda prompt: model_greedy(ref, config.vocab_size, prompt, MAX_TOKENS))


def test_gemma2_metadata_is_read_as_llama_cpp_reads_it():
    """Layers alternate from a sliding one (swa pattern 2); attention scale 1/sqrt(head_dim)
    but 1/sqrt(hidden / heads) on the 27B (46 layers); no sliding layer without a window."""
    def fields(layers: int, hidden: int, heads: int, head_dim: int, metadata: dict) -> dict:
        base = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim)
        return gemma2_config_fields(lambda key, default=None: metadata.get(key, default), "gemma2", base)

    caps = {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}
    two_b = fields(26, 2304, 8, 256, {"gemma2.attention.sliding_window": 4096, **caps})
    assert two_b["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2
    assert (two_b["query_pre_attn_scalar"], two_b["sliding_window"]) == (256, 4096)
    assert (two_b["attn_logit_softcapping"], two_b["final_logit_softcapping"]) == (50.0, 30.0)
    assert fields(46, 4608, 32, 128, caps)["query_pre_attn_scalar"] == 144
    bare = fields(4, 64, 4, 16, {})
    assert bare["layer_types"] == ["full_attention"] * 4 and bare["sliding_window"] is None
    assert bare["attn_logit_softcapping"] is None and bare["final_logit_softcapping"] is None


def test_greedy_rows_under_the_final_soft_cap_take_the_full_products_tokens(model, monkeypatch):
    """Gemma 2's logits are soft-capped after the LM head: its greedy rows go through the
    one-pass head refined with the cap in view (greedy_head) and get the tokens the full
    two-pass product gives them."""
    from llmd.gpu.layers import greedy_head

    _, files = model
    llm = LLM(model=str(files[T.Q8_0]), **SETTINGS)
    head = greedy_head.greedy_head_of(llm.engine.executor.runner.model)
    assert head is not None and head.passes == 2
    prompts = [[5 + i, 9, 200 + 7 * i, 31, 17, 400 - i, 3] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with_head = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert head.refined_groups > 0
    monkeypatch.setattr(greedy_head, "GREEDY_MIN_ROWS", 1 << 30)
    groups = head.refined_groups
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == with_head
    assert head.refined_groups == groups
    llm.engine.shutdown()
