"""Sliding-window attention (Mistral; Qwen2/Qwen3 `sliding_attention` layers): the query
at position p sees keys p - W < k <= p, as transformers masks them.

- The torch backend's layer call against a plain per-query masked softmax in float64
  (decode rows, prefills with and without a cached prefix); the Triton kernels and the
  flash-attn backend are checked against the torch backend by their own case files
  (tests/triton_attention_cases.py, tests/test_flash_attention.py: the `sliding-*` cases).
- Each layer gets the window transformers gives it; configs llmd cannot honour are
  refused at load, naming the architecture and the field.
- Whole requests through the engine equal HF transformers' greedy tokens and logprobs
  on random-weight Mistral (window 16 on every layer) and Qwen2 (layer 0 full, layers
  1-2 window 24) fixtures, with prompts longer than the window and generation crossing
  it: plain batches, chunked prefill, preemption, prefix-cache hits, emulated decode
  graphs and TP=2. The same check fails when the windows are ignored.
"""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from triton_attention_cases import CASES, Case, attend, build

from llmd import LLM, SamplingParams
from llmd.gpu.layers.attention import AttentionMetadata, TorchAttention
from llmd.gpu.models.loader import load_hf_config, load_model
from llmd.gpu.models.architectures import ARCHITECTURES, get_architecture
from llmd_tools.make_model import fixture_path

MISTRAL = "tiny-mistral-sw16"  # every layer: window 16
QWEN2 = "tiny-qwen2-sw24"  # layer 0 full, layers 1 and 2: window 24
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# Token ids (5 and up: no special tokens), all but one longer than either window.
PROMPT_LENGTHS = (41, 70, 19, 56)


# --- the torch backend against a plain masked softmax ------------------------------------


def plain_attention(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                    window: int | None, softcap: float | None = None) -> torch.Tensor:
    """Each query on its own, in float64: its context read key by key through its block
    table from the cache (written already), softmax over keys p - window < k <= p (the
    scores capped at softcap * tanh(score / softcap) when softcap is given)."""
    heads = q.shape[1]
    kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    rows = [(i, 1, int(md.decode_seq_lens[i]) - 1, md.decode_block_table[i]) for i in range(md.num_decodes)]
    rows += [(start, n, cached, ids) for start, n, cached, ids in md.prefills]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for start, num_new, num_cached, table in rows:
        for t in range(num_new):
            p = num_cached + t
            first = 0 if window is None else max(0, p - window + 1)
            keys = range(first, p + 1)
            blocks = [int(table[k // block_size]) for k in keys]
            slots = [k % block_size for k in keys]
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                k = kv_cache[0, kvh, blocks, slots].double()
                v = kv_cache[1, kvh, blocks, slots].double()
                scores = k @ q[start + t, h].double() * q.shape[2] ** -0.5
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[start + t, h] = torch.softmax(scores, 0) @ v
    return out


BACKEND_CASES = {name: case for name, case in CASES.items()
                 if name.startswith("sliding-") and case.dtype == "float32"}
BACKEND_CASES.update({
    "window-1": Case(4, 2, decodes=(1, 30), prefills=((0, 9), (17, 5)), sliding_window=1),
    "window-wider-than-contexts": Case(4, 2, decodes=(5, 40), prefills=((0, 30), (20, 9)), sliding_window=64),
})


@pytest.mark.parametrize("name", sorted(BACKEND_CASES))
def test_torch_backend_matches_a_plain_masked_softmax(name: str) -> None:
    case = BACKEND_CASES[name]
    q, k, v, kv_cache, md = build(case)
    attn = TorchAttention(case.heads, case.kv_heads, case.head_dim, case.head_dim ** -0.5, case.sliding_window)
    out = attend(attn, q, k, v, kv_cache, md)
    real = [i for i in range(q.shape[0]) if not len(case.decodes) <= i < md.num_decodes]  # not padding rows
    ref = plain_attention(q, kv_cache, md, case.sliding_window)
    assert (out[real].double() - ref[real]).abs().max().item() < 1e-5
    if case.sliding_window < max(case.decodes + tuple(c + n for c, n in case.prefills)):
        full = plain_attention(q, kv_cache, md, None)  # the window changes this case's output
        assert (full[real] - ref[real]).abs().max().item() > 0.1


def test_bad_windows_are_refused() -> None:
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            TorchAttention(4, 2, 16, 0.25, bad)


# --- per-layer windows and refusals --------------------------------------------------------


def layer_windows(model) -> list[int | None]:
    return [layer.self_attn.attn.sliding_window for layer in model.layers]


def save_config(config, directory: Path, arch: str) -> Path:
    config.architectures = [arch]
    config.save_pretrained(directory)
    return directory


def test_each_layer_gets_the_window_transformers_gives_it(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert layer_windows(load_model(fixture_path(MISTRAL), torch.float32, cpu, 128)) == [16, 16, 16]
    assert layer_windows(load_model(fixture_path(QWEN2), torch.float32, cpu, 128)) == [None, 24, 24]
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64)
    cases = {
        "qwen3": (Qwen3Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=2),
                  "Qwen3ForCausalLM", [None, None, 8, 8]),
        "qwen2-off": (Qwen2Config(**small, use_sliding_window=False, sliding_window=8), "Qwen2ForCausalLM",
                      [None] * 4),
        "qwen2-listed": (Qwen2Config(**small, use_sliding_window=True, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"] * 2),
                         "Qwen2ForCausalLM", [8, None, 8, None]),
        "mistral-full": (MistralConfig(**small, sliding_window=None), "MistralForCausalLM", [None] * 4),
    }
    for name, (config, arch, windows) in cases.items():
        config = load_hf_config(save_config(config, tmp_path / name, arch))
        assert get_architecture(arch).attention_windows(config) == windows, name


def test_configs_llmd_cannot_honour_are_refused(tmp_path: Path) -> None:
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64)
    refused = {
        "mistral-mixed": (MistralConfig(**small, sliding_window=8), "MistralForCausalLM",
                          {"layer_types": ["sliding_attention", "full_attention"]},
                          r"MistralForCausalLM: config layer_types .* per-layer types are not implemented"),
        "qwen2-chunked": (Qwen2Config(**small, use_sliding_window=True, sliding_window=8,
                                      layer_types=["chunked_attention", "full_attention"]), "Qwen2ForCausalLM", {},
                          r"Qwen2ForCausalLM: config layer_types \['chunked_attention'\] are not implemented"),
        "qwen2-no-window": (Qwen2Config(**small, use_sliding_window=False,
                                        layer_types=["sliding_attention", "full_attention"]), "Qwen2ForCausalLM",
                            {}, r"Qwen2ForCausalLM: .*'sliding_attention' layers but sliding_window is None"),
        "llama-window": (LlamaConfig(**small), "LlamaForCausalLM", {"sliding_window": 8},
                         r"LlamaForCausalLM: config sliding_window=8 is not part of this architecture"),
        "llama-types": (LlamaConfig(**small), "LlamaForCausalLM",
                        {"layer_types": ["full_attention", "sliding_attention"]},
                        r"LlamaForCausalLM: config layer_types other than 'full_attention'"),
        "olmo2": (LlamaConfig(**small), "Olmo2ForCausalLM", {}, r"unsupported architecture 'Olmo2ForCausalLM'"),
    }
    for name, (config, arch, extra, message) in refused.items():
        directory = save_config(config, tmp_path / name, arch)
        if extra:  # fields transformers' own config class would not write or would rewrite
            path = directory / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
        with pytest.raises(ValueError, match=message):
            load_hf_config(directory)
    with pytest.raises(ValueError, match="MistralForCausalLM: config layer_types"):  # at engine start
        LLM(model=str(tmp_path / "mistral-mixed"), dtype="float32")


# --- whole requests against HF transformers -------------------------------------------------


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[tuple[int, ...], ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(tuple(torch.randint(5, 1000, (n,), generator=gen).tolist()) for n in PROMPT_LENGTHS)


@functools.lru_cache(maxsize=None)
def reference(name: str, prompt: tuple[int, ...]):
    return hf_greedy(str(fixture_path(name)), list(prompt), MAX_TOKENS)


def make_llm(name: str, **settings) -> LLM:
    settings = {"num_gpu_blocks_override": 64, "max_model_len": 128, "dtype": "float32", **settings}
    return LLM(model=str(fixture_path(name)), **settings)


def check_against_hf(name: str, outputs) -> None:
    """Every prompt's tokens and logprobs as HF's, all MAX_TOKENS of them (no near-tie
    lets a run part from HF's early here: a divergence would end the comparison)."""
    for i, (prompt, out) in enumerate(zip(prompts(), outputs)):
        assert out.prompt_token_ids == list(prompt)
        compared = check_logprobs_close(reference(name, prompt), engine_result(out), f"{name} prompt {i}")
        assert compared == MAX_TOKENS, (name, i, compared)


def assert_all_free(llm: LLM) -> None:
    llm.engine.kv_cache_manager.check_integrity()
    llm.engine.kv_cache_manager.assert_all_free()


@pytest.mark.parametrize("name", [MISTRAL, QWEN2])
def test_greedy_batch_matches_hf(name: str) -> None:
    llm = make_llm(name)
    check_against_hf(name, llm.generate([list(p) for p in prompts()], GREEDY))
    assert_all_free(llm)


@pytest.mark.parametrize("name,budget,threshold", [
    (MISTRAL, 20, 12),  # chunks narrower than the window: every chunk's window reaches into its prefix
    (QWEN2, 48, 40),  # chunks wider than the window
])
def test_chunked_prefill_matches_hf(name: str, budget: int, threshold: int) -> None:
    llm = make_llm(name, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    check_against_hf(name, llm.generate([list(p) for p in prompts()], GREEDY))
    assert_all_free(llm)


def test_preemption_matches_hf() -> None:
    # 10 blocks of 16 tokens for four requests of up to 94 tokens: some are preempted
    # and recomputed.
    llm = make_llm(QWEN2, num_gpu_blocks_override=10)
    check_against_hf(QWEN2, llm.generate([list(p) for p in prompts()], GREEDY))
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert_all_free(llm)


def test_prefix_cache_hits_match_hf() -> None:
    llm = make_llm(MISTRAL)
    batch = [list(p) for p in prompts()]
    check_against_hf(MISTRAL, llm.generate(batch, GREEDY))
    again = llm.generate(batch, GREEDY)  # the same prompts: their full blocks come from the cache
    assert [o.num_cached_tokens for o in again] == [len(p) // 16 * 16 for p in batch]
    check_against_hf(MISTRAL, again)
    assert_all_free(llm)


def test_emulated_decode_graphs_match_hf() -> None:
    """Decode steps through the graph path (static buffers, rows padded to a captured
    size, emulated on CPU), whose metadata each sliding layer reads its window mask from."""
    llm = make_llm(QWEN2, max_num_seqs=8)
    runner = llm.engine.executor.runner
    runner.init_decode_graphs(emulate=True)
    check_against_hf(QWEN2, llm.generate([list(p) for p in prompts()], GREEDY))
    assert runner.decode_graphs.num_replays >= MAX_TOKENS - 1
    assert_all_free(llm)


def test_tensor_parallel_matches_hf() -> None:
    """TP=2 over gloo: each rank holds one of the two kv heads, its layers the same windows."""
    llm = make_llm(QWEN2, tensor_parallel_size=2, max_num_batched_tokens=48, device="cpu")
    try:
        check_against_hf(QWEN2, llm.generate([list(p) for p in prompts()], GREEDY))
        assert_all_free(llm)
    finally:
        llm.engine.shutdown()


def test_the_comparison_fails_when_the_window_is_ignored(monkeypatch) -> None:
    """The checks above can fail: with every layer in full attention the engine's
    logprobs leave HF's at the first token of each prompt longer than the window."""
    mistral = ARCHITECTURES["MistralForCausalLM"]
    monkeypatch.setitem(ARCHITECTURES, mistral.name,
                        replace(mistral, windows=lambda name, config: [None] * config.num_hidden_layers))
    llm = make_llm(MISTRAL)
    assert layer_windows(llm.engine.executor.runner.model) == [None] * 3
    outputs = llm.generate([list(p) for p in prompts()], GREEDY)
    for prompt, out in zip(prompts(), outputs):
        with pytest.raises(AssertionError):
            check_logprobs_close(reference(MISTRAL, prompt), engine_result(out), "window ignored")
