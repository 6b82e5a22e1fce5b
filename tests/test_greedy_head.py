"""The greedy LM head (llmd.gpu.layers.greedy_head): greedy rows' logits at one pass over
x, the 16-row groups a bound cannot rule out as the argmax multiplied again at two passes
(cpu_quant_x16.cpp's gguf_x16_argmax_refine_). Against the full two-pass product: every
refined logit its bits, every other one the one-pass product's, every row's argmax its
argmax — on rows of x whose best two logits tie, where one pass alone picks another
token (the bound's teeth: without it the argmax differs) — and, through the
engine, the same tokens as two passes for greedy rows beside sampled and logprob rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmd import LLM, SamplingParams
from llmd.gpu.layers import greedy_head
from llmd.gpu.layers.gguf_quant import FORMATS, X16_TYPES, ReusedOutput
from llmd.gpu.layers.greedy_head import GreedyHead
from llmd.gpu.sample.metadata import argmax_only
from llmd_client.request_params import GuidedDecodingParams
from llmd_tools.gguf_blocks import random_blocks
from test_gguf_x16 import ISAS, ops, x16  # noqa: F401

ROWS, VOCAB = 24, 1024  # rows of x; weight rows (64 groups)


@pytest.fixture(params=ISAS)
def isa(request, x16):  # noqa: F811
    if request.param not in x16.x16_isas:
        pytest.skip(f"this CPU lacks {request.param}")
    return request.param


def near_ties(ops, quant: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # noqa: F811
    """(x [ROWS, cols], the x16 weight, cols): random weights, and each row of x moved
    along w_a - w_b (a and b its best two logits) until those two tie exactly: which wins
    is then up to each product's rounding of x, and one pass and two disagree on about
    half the rows."""
    f = FORMATS[quant]
    cols = 2 * f.block if f.block > 32 else 8 * f.block
    blocks = random_blocks(quant, VOCAB, cols, seed=seed)
    dense = ops.dequantize(blocks, f.code, cols).double()
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((ROWS, cols)))
    a, b = (x @ dense.t()).topk(2, dim=1).indices.unbind(1)
    diff = dense[a] - dense[b]
    x -= ((diff * x).sum(1) / (diff * diff).sum(1)).unsqueeze(1) * diff
    return x.float().contiguous(), ops.repack_x16(blocks, f.code, cols), cols


@pytest.mark.parametrize("quant", X16_TYPES)
def test_refined_rows_take_the_two_pass_argmax_and_bits(x16, isa, quant):  # noqa: F811
    code = FORMATS[quant].code
    x, w, cols = near_ties(x16, quant, seed=code)
    limit = VOCAB - 5  # a last group cut by the vocabulary's end
    two = x16.mm_x16(x, w, code, cols, 2, isa)
    one = x16.mm_x16(x, w, code, cols, 1, isa)
    norms = x16.row_norms(w, code, cols)
    exact = x16.dequantize_x16(w, code, cols).double().norm(dim=1)
    assert (norms.double() >= exact).all() and (norms.double() <= exact * (1 + 2 ** -22)).all()  # rounded up
    refined, tokens = one.clone(), torch.empty(ROWS, dtype=torch.int64)
    groups = x16.argmax_refine_(x, w, code, cols, 2, isa, refined, norms, limit, tokens)
    assert torch.equal(tokens, two[:, :limit].argmax(1))
    changed = refined != one
    assert torch.equal(refined[changed], two[changed])
    kept = ~changed & (refined != two)  # not refined: the one-pass bits
    assert torch.equal(refined[kept], one[kept])
    assert torch.equal(refined[:, :limit].argmax(1), two[:, :limit].argmax(1))
    # the cases have teeth: one pass alone, or the refinement without its bound, picks
    # another token somewhere
    assert not torch.equal(one[:, :limit].argmax(1), two[:, :limit].argmax(1)), quant
    blind = one.clone()
    x16.argmax_refine_(x, w, code, cols, 2, isa, blind, torch.zeros_like(norms), limit, tokens)
    assert not torch.equal(blind[:, :limit].argmax(1), two[:, :limit].argmax(1)), quant
    assert 0 < groups < ROWS * VOCAB // 16 / 2  # and most groups are ruled out


def _capped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap  # as decoder.compute_logits caps them


@pytest.mark.parametrize("quant", ["Q6_K", "Q8_0"])
def test_a_soft_capped_heads_refinement_keeps_every_group_that_could_tie_the_best(x16, isa, quant):  # noqa: F811
    """Under a final soft-cap (Gemma 2) float32's tanh rounds many logits near the top to
    one value, and the lowest id among them wins: every logit left at one pass must lie,
    capped, strictly below the capped best (its two-pass value too), so that the capped
    argmax is the full product's — from a mild cap to one that flattens the top of every
    row. Blind to the cap (the plain bound), some left logit ties the best once capped."""
    code = FORMATS[quant].code
    x, w, cols = near_ties(x16, quant, seed=code + 1)
    limit = VOCAB - 7
    two = x16.mm_x16(x, w, code, cols, 2, isa)[:, :limit]
    one = x16.mm_x16(x, w, code, cols, 1, isa)
    norms = x16.row_norms(w, code, cols)
    spread = float(two.std())
    tokens = torch.empty(ROWS, dtype=torch.int64)
    for cap in (4 * spread, spread / 2, spread / 5):
        refined = one.clone()
        x16.argmax_refine_(x, w, code, cols, 2, isa, refined, norms, limit, tokens, cap)
        refined = refined[:, :limit]
        assert torch.equal(_capped(refined, cap).argmax(1), _capped(two, cap).argmax(1)), cap
        best = _capped(refined, cap).max(1, keepdim=True).values
        left = refined != two  # left at one pass
        for values in (refined, two):
            assert (_capped(values, cap) < best)[left].all(), cap
    assert (_capped(two, cap) == _capped(two, cap).max(1, keepdim=True).values).sum() > 2 * ROWS  # flattened
    blind = one.clone()
    x16.argmax_refine_(x, w, code, cols, 2, isa, blind, norms, limit, tokens)
    blind = blind[:, :limit]
    left = blind != two
    assert not (_capped(two, cap) < _capped(blind, cap).max(1, keepdim=True).values)[left].all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_row_with_inf_or_nan_is_refined_whole(x16, isa, bad):  # noqa: F811
    """A bound over x's codes holds only where x is finite (a NaN is read as a code, and
    the AVX2 product reads Q8_0's -128 as +128 against negative weights): such a row is
    multiplied again whole."""
    code = FORMATS["Q8_0"].code
    x, w, cols = near_ties(x16, "Q8_0", seed=3)
    x[1, 5] = bad
    two = x16.mm_x16(x, w, code, cols, 2, isa)
    refined = x16.mm_x16(x, w, code, cols, 1, isa)
    norms = x16.row_norms(w, code, cols)
    tokens = torch.empty(1, dtype=torch.int64)
    groups = x16.argmax_refine_(x[1:2].contiguous(), w, code, cols, 2, isa, refined[1:2], norms, VOCAB, tokens)
    assert groups == VOCAB // 16
    torch.testing.assert_close(refined[1], two[1], rtol=0, atol=0, equal_nan=True)
    assert int(tokens[0]) == int(np.argmax(two[1].numpy()))  # numpy's rule: the first NaN, else the first max


def test_the_operator_refuses_what_it_cannot_refine(x16):  # noqa: F811
    code = FORMATS["Q8_0"].code
    x, w, cols = near_ties(x16, "Q8_0", seed=4)
    logits, norms, tokens = x16.mm_x16(x, w, code, cols, 1), torch.ones(VOCAB), torch.empty(ROWS, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="limit must be in"):
        x16.argmax_refine_(x, w, code, cols, 2, "", logits, norms, VOCAB + 1, tokens)
    with pytest.raises(RuntimeError, match="take 2 or 3 passes"):
        x16.argmax_refine_(x, w, code, cols, 1, "", logits, norms, VOCAB, tokens)
    with pytest.raises(RuntimeError, match="norms"):
        x16.argmax_refine_(x, w, code, cols, 2, "", logits, norms[:-1], VOCAB, tokens)
    with pytest.raises(RuntimeError, match="tokens"):
        x16.argmax_refine_(x, w, code, cols, 2, "", logits, norms, VOCAB, tokens[:-1])


@pytest.mark.parametrize("greedy_rows", [list(range(ROWS)), list(range(1, ROWS, 2)), [0, 3, 4, 9, 10, 11, 20, 23]])
def test_the_head_gives_greedy_rows_the_argmax_and_the_others_every_logit(x16, greedy_rows):  # noqa: F811
    code = FORMATS["Q6_K"].code
    x, w, cols = near_ties(x16, "Q6_K", seed=5)
    head = GreedyHead(x16, w, code, cols, 2, ReusedOutput(), {1: 1 << 20, 2: 1024})
    two = x16.mm_x16(x, w, code, cols, 2)
    got = head.logits(x, greedy_rows, VOCAB - 3)
    if len(greedy_rows) == ROWS:  # every row greedy: the head has their tokens too
        assert torch.equal(head.argmax, two[:, :VOCAB - 3].argmax(1))
    else:
        assert head.argmax is None
    others = [r for r in range(ROWS) if r not in greedy_rows]
    assert torch.equal(got[others], two[others])
    assert torch.equal(got[greedy_rows, :VOCAB - 3].argmax(1), two[greedy_rows, :VOCAB - 3].argmax(1))
    one = x16.mm_x16(x, w, code, cols, 1)
    assert not torch.equal(one[greedy_rows, :VOCAB - 3].argmax(1), two[greedy_rows, :VOCAB - 3].argmax(1))
    assert head.logits(x[:3], [0, 1, 2], VOCAB) is None  # too few greedy rows: the full product
    assert head.logits(x, greedy_rows, VOCAB + 1) is None
    assert head.logits(x.bfloat16(), greedy_rows, VOCAB) is None  # its full product's logits are bfloat16


def test_argmax_only_is_plain_greedy_without_anything_reading_the_logits():
    assert argmax_only(SamplingParams(temperature=0))
    for changed in (dict(temperature=0.5), dict(logprobs=0), dict(min_tokens=2), dict(repetition_penalty=1.1),
                    dict(presence_penalty=0.5), dict(frequency_penalty=-0.5),
                    dict(guided=GuidedDecodingParams(json_object=True))):
        assert not argmax_only(SamplingParams(**{"temperature": 0, **changed})), changed


def test_the_engine_gives_greedy_rows_the_two_pass_tokens(builtin_gguf, x16, monkeypatch):  # noqa: F811
    """The built-in model, a batch of greedy rows beside seeded sampled rows and greedy
    rows with logprobs: the same tokens (and logprobs) with the greedy head as without it,
    and the head refined some groups."""
    llm = LLM(dtype="float32", num_gpu_blocks_override=96, max_model_len=256, enable_prefix_caching=False)
    head = llm.engine.executor.runner.model.lm_head.kernel.greedy
    assert head is not None and head.passes == 2
    prompts = [f"Tell me fact number {i} about the {w}." for i, w in
               enumerate(["sea", "moon", "sun", "wind", "rain", "snow", "fire", "stone"] * 2)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [greedy] * 12 + [SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)] * 2 + \
        [SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True)] * 2

    def run() -> list:
        mixed = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        return mixed + [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]  # all greedy: the head's tokens

    with_head = run()
    assert head.refined_groups > 0
    monkeypatch.setattr(greedy_head, "GREEDY_MIN_ROWS", 1 << 30)
    groups = head.refined_groups
    assert run() == with_head
    assert head.refined_groups == groups  # off: the full product served every row


def test_verified_drafts_of_greedy_rows_take_the_two_pass_tokens(builtin_gguf, x16, monkeypatch):  # noqa: F811
    """n-gram drafts verified on greedy rows (each position's row needs only its argmax):
    the same tokens with the head as without it and as without drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(dtype="float32", num_gpu_blocks_override=96, max_model_len=256, enable_prefix_caching=False,
              speculative_config=spec)
    head = llm.engine.executor.runner.model.lm_head.kernel.greedy
    prompts = [f"Count with me: one two three four, one two three four, one two three {i}" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_head = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert head.refined_groups > 0
    monkeypatch.setattr(greedy_head, "GREEDY_MIN_ROWS", 1 << 30)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == with_head
    plain = LLM(dtype="float32", num_gpu_blocks_override=96, max_model_len=256, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == with_head
