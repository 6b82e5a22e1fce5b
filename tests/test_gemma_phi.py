"""Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4 against HF transformers, and the configs
llmd refuses.

Fixtures (llmd_tools.make_model: transformers' own Gemma2Config, Gemma3TextConfig and
Phi3Config, random weights saved as safetensors):
- tiny-gemma2-sw16: layers sliding 16 / full / sliding 16, attention scores capped at 8,
  final logits at 30, head_dim 24 with query_pre_attn_scalar 32, tied embeddings;
- tiny-gemma3-sw16: sliding, sliding, full; q/k norms; local rope theta 100, global
  theta 10000 with linear scaling x4; final logits capped at 20;
- tiny-phi3-longrope: fused qkv / gate_up weights, longrope with short and long factors
  and original_max_position_embeddings 48, partial rotary 0.75, a 16-token window on
  every layer, padded vocab.

The reference is transformers in fp32 with eager attention (the path that applies
Gemma 2's attention soft-cap): the prompt in one forward, then one forward per token.
Whole requests give its greedy tokens and logprobs for all MAX_TOKENS steps in every
mode: plain batches, prefix-cache hits, chunked prefill, preemption, an emulated decode
graph, TP=2 over gloo. Phi-3's prompts fit in its original 48 positions and generation
crosses them, so the short and then the long factors are used (a prompt longer than
that is checked against transformers fed the prompt in pieces: llmd.gpu.layers.rotary says
why). Each comparison can fail: with one feature of a model taken away, the same check
fails.
"""
from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from test_sliding_window import plain_attention
from transformers import (Gemma2Config, Gemma3Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          Qwen2Config)
from triton_attention_cases import CASES, attend, build

from llmd import LLM, SamplingParams
from llmd.gpu.layers.attention import AttentionMetadata, TorchAttention, new_kv_cache
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.layers.norms import GemmaRMSNorm, RMSNorm
from llmd.gpu.models.decoder import FLAT_ROPE
from llmd.gpu.models.loader import load_hf_config, load_model
from llmd.gpu.layers.rotary import RotaryEmbedding
from llmd_tools.make_model import fixture_path

GEMMA2, GEMMA3, PHI3 = "tiny-gemma2-sw16", "tiny-gemma3-sw16", "tiny-phi3-longrope"
MODELS = (GEMMA2, GEMMA3, PHI3)
PHI3_ORIGINAL_MAX = 48
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# Token ids (5 and up: no special tokens), all but one longer than the 16-token windows.
# Phi-3's stay within its original 48 positions; all but the 19-token one cross them
# while generating.
PROMPT_LENGTHS = {GEMMA2: (41, 70, 19, 56), GEMMA3: (41, 70, 19, 56), PHI3: (41, 47, 19, 30)}
CPU = torch.device("cpu")


@functools.lru_cache(maxsize=None)
def prompts(name: str) -> tuple[tuple[int, ...], ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(tuple(torch.randint(5, 1000, (n,), generator=gen).tolist()) for n in PROMPT_LENGTHS[name])


@functools.lru_cache(maxsize=None)
def reference(name: str, prompt: tuple[int, ...], pieces: tuple[int, ...] | None = None):
    return hf_greedy(str(fixture_path(name)), list(prompt), MAX_TOKENS, attn_implementation="eager",
                     prompt_pieces=list(pieces) if pieces else None)


def make_llm(name: str, **settings) -> LLM:
    settings = {"num_gpu_blocks_override": 64, "max_model_len": 128, "dtype": "float32", **settings}
    return LLM(model=str(fixture_path(name)), **settings)


def generate(llm: LLM, name: str):
    return llm.generate([list(p) for p in prompts(name)], GREEDY)


def matches_hf(ref, out, label: str) -> bool:
    """Every token and logprob as HF's (a near-tie divergence would end the comparison
    early: none is allowed here)."""
    try:
        return check_logprobs_close(ref, engine_result(out), label) == MAX_TOKENS
    except AssertionError:
        return False


def check_against_hf(name: str, outputs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts(name), outputs)):
        assert out.prompt_token_ids == list(prompt)
        compared = check_logprobs_close(reference(name, prompt), engine_result(out), f"{name} prompt {i}")
        assert compared == MAX_TOKENS, (name, i, compared)


def assert_all_free(llm: LLM) -> None:
    llm.engine.kv_cache_manager.check_integrity()
    llm.engine.kv_cache_manager.assert_all_free()


def runner_model(llm: LLM):
    return llm.engine.executor.runner.model


# --- whole requests against HF transformers -------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_greedy_batch_and_prefix_cache_hits_match_hf(name: str) -> None:
    llm = make_llm(name)
    check_against_hf(name, generate(llm, name))
    again = generate(llm, name)  # the same prompts: their full blocks come from the cache
    assert [o.num_cached_tokens for o in again] == [len(p) // 16 * 16 for p in prompts(name)]
    check_against_hf(name, again)
    assert_all_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_matches_hf(name: str) -> None:
    # Chunks of at most 12 tokens, narrower than the windows: every chunk's window reaches
    # into its cached prefix, and Phi-3's prompts are chunked across nothing but a window.
    llm = make_llm(name, max_num_batched_tokens=20, long_prefill_token_threshold=12)
    check_against_hf(name, generate(llm, name))
    assert_all_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_preemption_matches_hf(name: str) -> None:
    # 10 blocks of 16 tokens for four requests of up to 94 tokens: some are preempted and
    # recomputed (Phi-3's recomputed prefills then span its original 48 positions).
    llm = make_llm(name, num_gpu_blocks_override=10)
    check_against_hf(name, generate(llm, name))
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert_all_free(llm)


def test_emulated_decode_graphs_match_hf() -> None:
    """Decode steps through the graph path (static buffers, padded rows, emulated on
    CPU), where Gemma 3's layers read their own rope tables and windows."""
    llm = make_llm(GEMMA3, max_num_seqs=8)
    runner = llm.engine.executor.runner
    runner.init_decode_graphs(emulate=True)
    check_against_hf(GEMMA3, generate(llm, GEMMA3))
    assert runner.decode_graphs.num_replays >= MAX_TOKENS - 1
    assert_all_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_matches_hf(name: str) -> None:
    """TP=2 over gloo: each rank one of the two kv heads (Phi-3's rows cut out of its
    fused qkv and gate_up tensors), the vocab split in two for embedding and LM head."""
    llm = make_llm(name, tensor_parallel_size=2, max_num_batched_tokens=48, device="cpu")
    try:
        check_against_hf(name, generate(llm, name))
        assert_all_free(llm)
    finally:
        llm.engine.shutdown()


def test_phi3_prompt_longer_than_the_original_max() -> None:
    """A 70-token prompt: llmd rotates positions below 48 with the short factors and the
    rest with the long ones, which is transformers fed the prompt in calls that stay on
    one side of the threshold (48 tokens, then one at a time). transformers' one call
    over the whole prompt takes the long factors for all of it: a different result."""
    prompt = tuple(torch.randint(5, 1000, (70,), generator=torch.Generator().manual_seed(1)).tolist())
    out = make_llm(PHI3).generate([list(prompt)], GREEDY)[0]
    pieces = (PHI3_ORIGINAL_MAX,) + (1,) * (len(prompt) - PHI3_ORIGINAL_MAX)
    assert check_logprobs_close(reference(PHI3, prompt, pieces), engine_result(out), "phi3 pieces") == MAX_TOKENS
    assert not matches_hf(reference(PHI3, prompt), out, "phi3 one call")


# --- what each layer reads from the config ------------------------------------------------


def test_layers_follow_the_config() -> None:
    gemma2 = load_model(fixture_path(GEMMA2), torch.float32, CPU, 128)
    attns = [layer.self_attn for layer in gemma2.layers]
    assert [a.attn.sliding_window for a in attns] == [16, None, 16]
    assert [a.attn.softcap for a in attns] == [8.0] * 3
    assert [a.attn.scale for a in attns] == [32 ** -0.5] * 3  # query_pre_attn_scalar, not head_dim 24
    assert all(a.q_norm is None for a in attns) and isinstance(gemma2.norm, GemmaRMSNorm)

    gemma3 = load_model(fixture_path(GEMMA3), torch.float32, CPU, 128)
    attns = [layer.self_attn for layer in gemma3.layers]
    assert [a.attn.sliding_window for a in attns] == [16, 16, None]
    assert [a.attn.softcap for a in attns] == [None] * 3
    assert all(isinstance(a.q_norm, GemmaRMSNorm) and isinstance(a.k_norm, GemmaRMSNorm) for a in attns)
    positions = torch.arange(128, dtype=torch.float32)[:, None]
    for layer_type, inv_freq in (("sliding_attention", 1 / 100.0 ** (torch.arange(0, 24, 2) / 24)),
                                 ("full_attention", 1 / 10000.0 ** (torch.arange(0, 24, 2) / 24) / 4)):
        angles = positions * inv_freq
        expected = torch.cat([angles, angles], dim=-1).cos()
        assert torch.allclose(gemma3.rotary[layer_type].cos_cache, expected, atol=1e-5), layer_type

    phi3 = load_model(fixture_path(PHI3), torch.float32, CPU, 128)
    assert [layer.self_attn.attn.sliding_window for layer in phi3.layers] == [16] * 3
    cfg = phi3.config.rope_parameters
    rotated = 12  # partial_rotary_factor 0.75 of head_dim 16
    assert phi3.rotary[FLAT_ROPE].cos_cache.shape == (128, rotated)
    factor = phi3.config.max_position_embeddings / PHI3_ORIGINAL_MAX
    mscale = math.sqrt(1 + math.log(factor) / math.log(PHI3_ORIGINAL_MAX))
    base = 10000.0 ** (torch.arange(0, rotated, 2) / rotated)
    for p in (0, 30, 47, 48, 100):  # p + 1 > 48: the long factors
        factors = torch.tensor(cfg["long_factor"] if p + 1 > PHI3_ORIGINAL_MAX else cfg["short_factor"])
        angles = p / (factors * base)
        assert torch.allclose(phi3.rotary[FLAT_ROPE].cos_cache[p], torch.cat([angles, angles]).cos() * mscale, atol=1e-5), p


@pytest.mark.parametrize("case_name", ["softcap-mixed", "softcap-sliding-chunked"])
def test_torch_backend_soft_caps_as_a_plain_masked_softmax(case_name: str) -> None:
    """The torch backend's capped decode and prefill paths against a per-query softmax of
    c * tanh(s / c) in float64 (the Triton and flash-attn backends are checked against
    this one by their case files: the `softcap-*` cases)."""
    case = CASES[case_name]
    q, k, v, kv_cache, md = build(case)
    attn = TorchAttention(case.heads, case.kv_heads, case.head_dim, case.head_dim ** -0.5, case.sliding_window,
                          case.softcap)
    out = attend(attn, q, k, v, kv_cache, md)
    ref = plain_attention(q, kv_cache, md, case.sliding_window, case.softcap)
    assert (out.double() - ref).abs().max().item() < 1e-5
    uncapped = plain_attention(q, kv_cache, md, case.sliding_window)
    assert (uncapped - ref).abs().max().item() > 0.1  # the cap changes this case's output


@pytest.mark.parametrize("variant", ["phi3-4k", "phi3-longrope-full-rotary", "gemma2-mha-bias", "gemma3-yarn"])
def test_logits_of_config_variants_match_hf_through_the_paged_cache(variant: str, tmp_path: Path) -> None:
    """Config shapes the fixtures do not take, through a 20-token prefill, a 12-token
    chunk over it and one-token decodes over scattered blocks, against transformers
    fed the same pieces: Phi-3-mini-4k's (plain rope, a window), Phi-3-128k's (longrope
    on whole heads, factor and attention_factor given; the threshold 32 crossed by the
    decodes), Gemma 2 with one kv head per head and biases, Gemma 3 with yarn on its
    global layers."""
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, pad_token_id=0,
                 bos_token_id=2, eos_token_id=1)
    config, arch = {
        "phi3-4k": (lambda: Phi3Config(**small, sliding_window=10), "Phi3ForCausalLM"),
        "phi3-longrope-full-rotary": (lambda: Phi3Config(**small, original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 1.2,
            "short_factor": [1.0 + 0.2 * i for i in range(8)], "long_factor": [1.0 + i for i in range(8)]}),
            "Phi3ForCausalLM"),
        "gemma2-mha-bias": (lambda: Gemma2Config(**{**small, "num_key_value_heads": 4}, head_dim=16,
                                                 attention_bias=True, sliding_window=8, query_pre_attn_scalar=20,
                                                 attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
                            "Gemma2ForCausalLM"),
        "gemma3-yarn": (lambda: Gemma3TextConfig(**small, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                                 layer_types=["sliding_attention", "full_attention"] * 1
                                                 + ["sliding_attention"],
                                                 rope_parameters={
                                                     "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                                                     "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                        "rope_theta": 10000.0,
                                                                        "original_max_position_embeddings": 32}}),
                        "Gemma3ForCausalLM"),
    }[variant]
    config = config()
    config.architectures = [arch]
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # norms and biases away from their init, so each one matters
        for param_name, param in hf.named_parameters():
            if "norm" in param_name or param_name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.float32, CPU, 256)
    tokens = torch.randint(0, 300, (44,), generator=torch.Generator().manual_seed(2))
    pieces = [(0, 20), (20, 32)] + [(t, t + 1) for t in range(32, 44)]
    got = torch.cat(paged_logits(model, tokens, pieces))
    with torch.no_grad():
        past, want = None, []
        for start, end in pieces:
            out = hf(tokens[None, start:end], past_key_values=past, use_cache=True)
            past = out.past_key_values
            want.append(out.logits[0])
    assert (got - torch.cat(want)).abs().max().item() < 2e-5


def paged_logits(model, tokens: torch.Tensor, pieces: list[tuple[int, int]]) -> list[torch.Tensor]:
    bs = 16
    attn = model.layers[0].self_attn
    caches = [new_kv_cache(12, bs, attn.num_kv_heads, attn.head_dim, torch.float32, CPU) for _ in model.layers]
    blocks = torch.tensor([9, 2, 7, 4])  # deliberately out of order
    logits = []
    for start, end in pieces:
        pos = torch.arange(start, end)
        slots = blocks[pos // bs] * bs + pos % bs
        table = blocks[:(end + bs - 1) // bs]
        if end - start == 1:
            md = AttentionMetadata(slots, 1, table[None], torch.tensor([end]), [])
        else:
            md = AttentionMetadata(slots, 0, None, None, [(0, end - start, start, table)])
        metadata_builder(model, bs, md.slot_mapping.device).build(md)
        with torch.no_grad():
            logits.append(model.compute_logits(model(tokens[start:end], pos, caches, md)))
    return logits


# --- each check can fail -----------------------------------------------------------------------


def _each_attention(attribute: str, value: Callable) -> Callable:
    def mutate(model, monkeypatch) -> None:
        for layer in model.layers:
            monkeypatch.setattr(layer.self_attn.attn, attribute, value(layer.self_attn))
    return mutate


def _plain_norms(model, monkeypatch) -> None:
    monkeypatch.setattr(GemmaRMSNorm, "forward", RMSNorm.forward)  # w instead of 1 + w
    monkeypatch.setattr(GemmaRMSNorm, "gemma_scale", False)  # the same in the fused ops


def _no_final_cap(model, monkeypatch) -> None:
    monkeypatch.setattr(model.config, "final_logit_softcapping", None)


def _no_embed_scale(model, monkeypatch) -> None:
    monkeypatch.setattr(model, "arch", replace(model.arch, embed_scale=False))


def _no_qk_norms(model, monkeypatch) -> None:
    for layer in model.layers:
        monkeypatch.setattr(layer.self_attn, "q_norm", None)


def _no_post_ff_norm(model, monkeypatch) -> None:
    for layer in model.layers:
        monkeypatch.setattr(layer, "post_feedforward_layernorm", torch.nn.Identity())


def _global_rope_everywhere(model, monkeypatch) -> None:
    full = model.rotary["full_attention"]
    monkeypatch.setattr(model, "rotary", torch.nn.ModuleDict({"sliding_attention": full, "full_attention": full}))


def _phi3_rotary(long_from: int | None):
    """Phi-3's rotary table with the long factors from position `long_from` on (None:
    the short factors everywhere), the attention factor unchanged."""
    def table(model, factors: str) -> RotaryEmbedding:
        config = copy.deepcopy(model.config)  # one set of factors on both sides of the threshold
        config.rope_parameters["short_factor"] = config.rope_parameters["long_factor"] = \
            model.config.rope_parameters[factors]
        return RotaryEmbedding(config, model.head_dim, model.max_positions)

    def mutate(model, monkeypatch) -> None:
        mixed = table(model, "short_factor")
        if long_from is not None:
            long = table(model, "long_factor")
            mixed.cos_cache[long_from:] = long.cos_cache[long_from:]
            mixed.sin_cache[long_from:] = long.sin_cache[long_from:]
        monkeypatch.setattr(model, "rotary", nn.ModuleDict({FLAT_ROPE: mixed}))
    return mutate


MUTATIONS: dict[str, tuple[str, Callable]] = {
    "gemma2-norms-w-not-1+w": (GEMMA2, _plain_norms),
    "gemma2-no-attention-softcap": (GEMMA2, _each_attention("softcap", lambda attn: None)),
    "gemma2-no-final-softcap": (GEMMA2, _no_final_cap),
    "gemma2-no-embedding-scale": (GEMMA2, _no_embed_scale),
    "gemma2-head-dim-scale": (GEMMA2, _each_attention("scale", lambda attn: attn.head_dim ** -0.5)),
    "gemma2-no-windows": (GEMMA2, _each_attention("sliding_window", lambda attn: None)),
    "gemma3-no-qk-norms": (GEMMA3, _no_qk_norms),
    "gemma3-no-post-ff-norm": (GEMMA3, _no_post_ff_norm),
    "gemma3-global-rope-on-local-layers": (GEMMA3, _global_rope_everywhere),
    "gemma3-no-final-softcap": (GEMMA3, _no_final_cap),
    "phi3-short-factors-only": (PHI3, _phi3_rotary(None)),
    "phi3-long-factors-one-position-early": (PHI3, _phi3_rotary(PHI3_ORIGINAL_MAX - 1)),
    "phi3-no-window": (PHI3, _each_attention("sliding_window", lambda attn: None)),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_comparison_fails_without_each_feature(mutation: str, monkeypatch) -> None:
    name, mutate = MUTATIONS[mutation]
    llm = make_llm(name)
    mutate(runner_model(llm), monkeypatch)
    outputs = generate(llm, name)
    matched = [matches_hf(reference(name, p), out, mutation) for p, out in zip(prompts(name), outputs)]
    assert not all(matched), f"{mutation}: every prompt still matches transformers"


# --- refusals -----------------------------------------------------------------------------------------

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64)
PHI_SMALL = dict(SMALL, pad_token_id=0, bos_token_id=2, eos_token_id=1)
REFUSED = {
    "rope-type": (lambda: LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": 10000.0}),
                  "LlamaForCausalLM", {},
                  r"LlamaForCausalLM: config rope_parameters.rope_type='dynamic' is not implemented by llmd"),
    "gemma3-local-rope-type": (lambda: Gemma3TextConfig(**SMALL, head_dim=16, rope_parameters={
        "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}), "Gemma3ForCausalLM", {},
        r"Gemma3ForCausalLM: config rope_parameters\['sliding_attention'\].rope_type='dynamic' is not implemented"),
    "activation": (lambda: Qwen2Config(**SMALL, hidden_act="relu"), "Qwen2ForCausalLM", {},
                   r"Qwen2ForCausalLM: config hidden_act='relu' is not implemented by llmd \(implemented: silu"),
    "gemma-activation": (lambda: Gemma2Config(**SMALL, head_dim=16, hidden_activation="gelu_new"),
                         "Gemma2ForCausalLM", {}, r"Gemma2ForCausalLM: config hidden_activation='gelu_new' is not"),
    "llama-final-softcap": (lambda: LlamaConfig(**SMALL), "LlamaForCausalLM", {"final_logit_softcapping": 30.0},
                            r"LlamaForCausalLM: config final_logit_softcapping=30.0 is not part of this architecture"),
    "mistral-attention-softcap": (lambda: MistralConfig(**SMALL), "MistralForCausalLM",
                                  {"attn_logit_softcapping": 50.0},
                                  r"MistralForCausalLM: config attn_logit_softcapping=50.0 is not part of this"),
    "phi3-query-scalar": (lambda: Phi3Config(**PHI_SMALL), "Phi3ForCausalLM", {"query_pre_attn_scalar": 64},
                          r"Phi3ForCausalLM: config query_pre_attn_scalar=64 is not part of this architecture"),
    "gemma3-attention-softcap": (lambda: Gemma3TextConfig(**SMALL, head_dim=16, attn_logit_softcapping=50.0),
                                 "Gemma3ForCausalLM", {},
                                 r"Gemma3ForCausalLM: config attn_logit_softcapping=50.0 is not applied by "
                                 r"transformers' model"),
    "gemma2-negative-softcap": (lambda: Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=-1.0),
                                "Gemma2ForCausalLM", {},
                                r"Gemma2ForCausalLM: config final_logit_softcapping=-1.0 must be a positive number"),
    "gemma2-bidirectional": (lambda: Gemma2Config(**SMALL, head_dim=16, use_bidirectional_attention=True),
                             "Gemma2ForCausalLM", {},
                             r"Gemma2ForCausalLM: config use_bidirectional_attention=True asks for attention in both"),
    "heads-not-dividing-hidden": (lambda: Qwen2Config(**{**SMALL, "hidden_size": 30, "num_attention_heads": 4}),
                                  "Qwen2ForCausalLM", {},
                                  r"Qwen2ForCausalLM: config hidden_size=30 is not a multiple of num_attention_heads"),
    "kv-heads-not-dividing": (lambda: LlamaConfig(**{**SMALL, "num_attention_heads": 4, "num_key_value_heads": 3}),
                              "LlamaForCausalLM", {},
                              r"LlamaForCausalLM: config num_key_value_heads=3 must be a positive divisor"),
    "llama-partial-rotary": (lambda: LlamaConfig(**SMALL, partial_rotary_factor=0.5), "LlamaForCausalLM", {},
                             r"LlamaForCausalLM: config rope_parameters.partial_rotary_factor=0.5 asks for partial"),
    "phi3-odd-rotary": (lambda: Phi3Config(**PHI_SMALL, partial_rotary_factor=0.1875), "Phi3ForCausalLM", {},
                        r"Phi3ForCausalLM: config rope_parameters.partial_rotary_factor=0.1875 rotates 3 of the 16"),
    "gemma3-multimodal": (lambda: Gemma3Config(), "Gemma3ForConditionalGeneration", {},
                          r"architecture 'Gemma3ForConditionalGeneration' is Gemma 3's multimodal model"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_configs_llmd_cannot_run_are_refused(case: str, tmp_path: Path) -> None:
    make, arch, extra, message = REFUSED[case]
    config = make()
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    if extra:  # fields transformers' own config class would not write
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    with pytest.raises(ValueError, match=message):
        load_hf_config(tmp_path)


def test_a_refused_config_stops_the_engine_at_start(tmp_path: Path) -> None:
    config = Gemma3TextConfig(**SMALL, head_dim=16, attn_logit_softcapping=50.0)
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM: config attn_logit_softcapping"):
        LLM(model=str(tmp_path), dtype="float32")

