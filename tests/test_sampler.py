"""The batched sampler against independent references: argmax, analytic distributions
(chi-square), plain-Python filters and penalties, log_softmax (the top-k / top-p
filter against the full sort: test_top_k_top_p.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmd.gpu.sample.sampler import Sampler, SamplingMetadata, apply_penalties, argmax_rows, gather_logprobs
from llmd_client.protocol import SamplingParams
from sampler_refs import (LOGITS12, NEG_INF, chi_square_pvalue, metadata, reference_penalties, reference_probs,
                          sample)

# -- greedy -------------------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 7
    assert torch.equal(sample(logits, params), logits.argmax(-1))
    # top-k/top-p on a greedy row change nothing
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5)] * 7
    assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_argmax_rows_is_torch_argmax():
    """The numpy path (float32 on CPU) picks what torch's argmax picks: the first of tied
    maxima, a NaN over any number, -inf rows; strided rows; other dtypes go to torch."""
    logits = torch.randn(6, 4099, generator=torch.Generator().manual_seed(0))
    logits[1, [7, 3000]] = 100.0  # a tie: the first
    logits[2] = float("-inf")
    logits[2, 4098] = -1e30
    logits[3] = float("-inf")  # every entry equal: index 0
    logits[4, 11] = float("nan")
    logits[4, 12] = float("inf")
    with torch.inference_mode():
        for case in (logits, logits[:, :4000], logits[::2], logits[:0]):
            got = argmax_rows(case)
            assert got.dtype == torch.int64 and torch.equal(got, case.argmax(dim=-1))
        half = logits.bfloat16()
        assert torch.equal(argmax_rows(half), half.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1)).repeat(400, 1)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=2.0)
              for i in range(400)]
    tokens = sample(logits, params)
    argmax = int(logits[0].argmax())
    assert (tokens[0::2] == argmax).all()
    assert len(set(tokens[1::2].tolist())) > 5  # random rows are random


def test_does_not_modify_logits():
    logits = torch.randn(4, 30)
    before = logits.clone()
    params = [SamplingParams(temperature=0.9, top_p=0.5, min_p=0.1, top_k=5, logprobs=2,
                             repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2)] * 4
    sample(logits, params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4, eos=0)
    assert torch.equal(logits, before)


# -- distributions (chi-square against the analytic distribution) -------------------------

N_DRAWS = 20_000
CASES = {
    "T=0.7": dict(temperature=0.7),
    "T=1.5": dict(temperature=1.5),
    "top_k=4": dict(temperature=1.0, top_k=4),
    "top_p=0.75": dict(temperature=1.0, top_p=0.75),
    "min_p=0.2": dict(temperature=1.0, min_p=0.2),
    # each filter removes tokens the one before it kept: 12 -> 8 -> 7 -> 6
    "combined": dict(temperature=0.8, top_k=8, top_p=0.95, min_p=0.14),
}


def draw(case: dict, seed: int = 1234) -> torch.Tensor:
    logits = torch.tensor(LOGITS12, dtype=torch.float32).repeat(N_DRAWS, 1)
    return sample(logits, [SamplingParams(**case)] * N_DRAWS, seed=seed)


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_matches_analytic(name):
    case = CASES[name]
    if name == "combined":  # the case exercises every filter
        sizes = [int((reference_probs(LOGITS12, **{**case, **off}) > 0).sum())
                 for off in (dict(top_k=0, top_p=1.0, min_p=0.0), dict(top_p=1.0, min_p=0.0),
                             dict(min_p=0.0), {})]
        assert sizes == [12, 8, 7, 6]
    expected = reference_probs(LOGITS12, **case)
    assert chi_square_pvalue(draw(case), expected) > 1e-3


def test_chi_square_rejects_wrong_distribution():
    """Negative controls: the helper must be able to fail."""
    tokens = draw(CASES["T=0.7"])
    assert chi_square_pvalue(tokens, reference_probs(LOGITS12, temperature=0.8)) < 1e-6
    swapped = reference_probs(LOGITS12, temperature=0.7)
    swapped[[0, 11]] = swapped[[11, 0]]  # two tokens of similar probability
    assert chi_square_pvalue(tokens, swapped) < 1e-6
    # top-p keeping one token too many: the extra token is never drawn
    tokens = draw(CASES["top_p=0.75"])
    extra = reference_probs(LOGITS12, top_k=int((reference_probs(LOGITS12, top_p=0.75) > 0).sum()) + 1)
    assert chi_square_pvalue(tokens, extra) < 1e-6


def test_filters_never_leave_the_allowed_set():
    gen = torch.Generator().manual_seed(5)
    vocab, reps = 40, 300
    base = torch.randn(6, vocab, generator=gen) * 2.0
    cases = [dict(top_k=1), dict(top_k=3), dict(top_p=0.3), dict(top_p=0.7, top_k=10),
             dict(min_p=0.3), dict(temperature=0.5, top_k=12, top_p=0.8, min_p=0.05)]
    logits = base.repeat_interleave(reps, dim=0)
    params = [SamplingParams(**c) for c in cases for _ in range(reps)]
    tokens = sample(logits, params, seed=9).view(len(cases), reps)
    for row, case in enumerate(cases):
        ref = reference_probs(base[row].double().numpy(), **case)
        drawn = set(tokens[row].tolist())
        assert drawn <= set(np.flatnonzero(ref > 0).tolist()), case
        assert set(np.flatnonzero(ref > 0.03).tolist()) <= drawn, case  # and not over-filtered


def test_top_k_off_rows_beside_top_k_rows():
    """top_k past the vocab (and 0) filters nothing, also in a batch where others use top_k."""
    logits = torch.tensor(LOGITS12, dtype=torch.float32).repeat(3 * N_DRAWS, 1)
    params = [SamplingParams(top_k=1000), SamplingParams(top_k=0), SamplingParams(top_k=2)] * N_DRAWS
    tokens = sample(logits, params, seed=3).view(N_DRAWS, 3)
    assert chi_square_pvalue(tokens[:, 0].contiguous(), reference_probs(LOGITS12)) > 1e-3
    assert chi_square_pvalue(tokens[:, 1].contiguous(), reference_probs(LOGITS12)) > 1e-3
    assert chi_square_pvalue(tokens[:, 2].contiguous(), reference_probs(LOGITS12, top_k=2)) > 1e-3


# -- penalties ----------------------------------------------------------------------------

def test_penalties_match_reference():
    rng = np.random.default_rng(0)
    vocab = 64
    rows = [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=0.8),
        dict(frequency_penalty=-0.6),
        dict(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=0.4),
        dict(),  # a neutral row in a penalized batch
    ]
    params = [SamplingParams(**r) for r in rows]
    prompts = [rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in rows]
    outputs = [rng.integers(0, vocab, rng.integers(0, 30)).tolist() for _ in rows]
    logits = rng.normal(size=(len(rows), vocab)).astype(np.float32)
    md = metadata(params, vocab, prompts=prompts, outputs=outputs)
    got = apply_penalties(torch.from_numpy(logits), md).numpy()
    for i, r in enumerate(rows):
        want = reference_penalties(logits[i], prompts[i], outputs[i], r.get("repetition_penalty", 1.0),
                                   r.get("presence_penalty", 0.0), r.get("frequency_penalty", 0.0))
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)

    # One step later, without a rebuild.
    new_tokens = torch.tensor(rng.integers(0, vocab, len(rows)))
    md.append_sampled(new_tokens)
    got = apply_penalties(torch.from_numpy(logits), md).numpy()
    for i, r in enumerate(rows):
        want = reference_penalties(logits[i], prompts[i], outputs[i] + [int(new_tokens[i])],
                                   r.get("repetition_penalty", 1.0), r.get("presence_penalty", 0.0),
                                   r.get("frequency_penalty", 0.0))
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)


def test_penalties_steer_sampling():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    # token 0 in the output 3 times: 5 - 3 * 1.5 = 0.5 < 4
    tokens = sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=1.5)], outputs=[[0, 0, 0]])
    assert tokens.tolist() == [1]
    # repetition covers the prompt: token 0 falls to 5 / 2 = 2.5 < 4 (token 1 is unseen)
    tokens = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompts=[[0]])
    assert tokens.tolist() == [1]
    # presence/frequency ignore the prompt
    tokens = sample(logits, [SamplingParams(temperature=0.0, presence_penalty=2.0)], prompts=[[0]])
    assert tokens.tolist() == [0]


# -- padded vocab and min_tokens ----------------------------------------------------------

def test_padded_vocab_is_never_sampled_nor_reported():
    valid, width = 10, 16
    logits = torch.randn(64, width)
    logits[:, valid:] = 100.0  # the padding holds the largest logits
    params = ([SamplingParams(temperature=0.0)] * 16 + [SamplingParams(temperature=1.0, logprobs=5)] * 16
              + [SamplingParams(temperature=5.0, top_p=0.99)] * 16 + [SamplingParams(top_k=3, logprobs=2)] * 16)
    out = Sampler()(logits, metadata(params, valid))
    assert (out.sampled_token_ids < valid).all()
    assert (out.logprobs_token_ids < valid).all()
    torch.testing.assert_close(out.logprobs[:, 1:], torch.log_softmax(logits[:, :valid], -1).topk(5).values)
    # all greedy: the fast path masks too
    assert (sample(logits, [SamplingParams(temperature=0.0)] * 64, vocab=valid) < valid).all()
    assert torch.equal(sample(logits, [SamplingParams(temperature=0.0)] * 64, vocab=valid),
                       logits[:, :valid].argmax(-1))
    # rows with different tokenizer sizes
    sizes = [4, 10, 7, 16] * 16
    tokens = sample(logits, [SamplingParams(temperature=3.0)] * 64, vocab=sizes)
    assert all(t < s for t, s in zip(tokens.tolist(), sizes))


def test_min_tokens_masks_eos_and_stop_ids():
    eos, stop = 3, 5
    logits = torch.zeros(4, 8)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop]),
              SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(temperature=0.0)]
    outputs = [[1], [1], [1], [1]]
    for _ in range(50):
        tokens = sample(logits, params, outputs=outputs, eos=eos).tolist()
        assert tokens[0] not in (eos, stop) and tokens[1] not in (eos, stop)
        assert tokens[2] == eos  # ignore_eos: EOS is not a stop token, only stop ids are masked
        assert tokens[3] == eos  # no min_tokens
    # reached: EOS allowed again (rebuilt, and advanced in place)
    assert sample(logits, params, outputs=[[1, 2]] * 4, eos=eos).tolist()[0] == eos
    md = metadata(params, 8, outputs=outputs, eos=eos)
    sampler = Sampler()
    first = sampler(logits, md).sampled_token_ids
    assert first[0] != eos
    md.append_sampled(first)
    assert sampler(logits, md).sampled_token_ids[0] == eos
    # one row done while another is still held back: the per-row count on the device moves
    params = [SamplingParams(temperature=0.0, min_tokens=3), SamplingParams(temperature=0.0, min_tokens=6)]
    md = metadata(params, 8, outputs=[[1], [1]], eos=eos)
    for step in range(2, 8):
        tokens = sampler(logits[:2], md).sampled_token_ids
        assert [t == eos for t in tokens.tolist()] == [step > 3, step > 6]
        md.append_sampled(tokens)


# -- seeds --------------------------------------------------------------------------------

def run_seeded(logits_row: torch.Tensor, params: SamplingParams, row: int, batch: int, engine_seed: int,
               steps: int = 12) -> list[int]:
    """Generate `steps` tokens for one request placed at `row` of a batch of random neighbours."""
    gen = torch.Generator().manual_seed(engine_seed)
    neighbours = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0),
                  SamplingParams(top_p=0.5, seed=99)]
    sampler = Sampler(seed=engine_seed)
    output: list[int] = []
    for _ in range(steps):
        logits = torch.randn(batch, logits_row.shape[0], generator=gen)
        logits[row] = logits_row
        params_list = [neighbours[(i + engine_seed) % len(neighbours)] for i in range(batch)]
        params_list[row] = params
        outputs = [[0] * ((i * 3) % 5) for i in range(batch)]
        outputs[row] = list(output)
        md = metadata(params_list, logits_row.shape[0], outputs=outputs)
        output.append(int(sampler(logits, md).sampled_token_ids[row]))
    return output


def test_seeded_request_is_reproducible_across_batches():
    logits_row = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 0.5
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = run_seeded(logits_row, params, row=0, batch=1, engine_seed=0)
    assert run_seeded(logits_row, params, row=5, batch=8, engine_seed=1) == alone
    assert run_seeded(logits_row, params, row=2, batch=3, engine_seed=2) == alone
    other = run_seeded(logits_row, SamplingParams(temperature=1.0, top_p=0.95, seed=1235), row=0,
                       batch=1, engine_seed=0)
    assert other != alone
    assert len(set(alone)) > 3  # a varied sequence, not a constant


def test_seeded_rows_in_one_batch_and_unseeded_rows_random():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4)).repeat(6, 1) * 0.3
    params = [SamplingParams(seed=11), SamplingParams(seed=11), SamplingParams(seed=12),
              SamplingParams(), SamplingParams(), SamplingParams()]
    sampler = Sampler(seed=0)
    runs = [sampler(logits, metadata(params, 500)).sampled_token_ids.tolist() for _ in range(5)]
    for r in runs:
        assert r[0] == r[1] == runs[0][0]  # same seed, same position: same token, every call
    assert len({r[2] for r in runs}) == 1
    assert len({tuple(r[3:]) for r in runs}) == 5  # unseeded rows keep moving


# -- logprobs -----------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ranks():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 30, generator=gen)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.3, logprobs=0),
              SamplingParams(temperature=1.7, logprobs=5, top_k=20, repetition_penalty=1.4),
              SamplingParams(top_p=0.5), SamplingParams(temperature=4.0, logprobs=1),
              SamplingParams(temperature=3.0, presence_penalty=1.0, logprobs=2)]
    out = Sampler(seed=2)(logits, metadata(params, 30, prompts=[[1, 2, 3]] * 6, outputs=[[4, 4]] * 6))
    ref = torch.log_softmax(logits, dim=-1)
    k = 5
    assert out.logprobs_token_ids.shape == (6, k + 1) and out.logprobs.shape == (6, k + 1)
    assert torch.equal(out.logprobs_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprobs_token_ids))
    order = torch.argsort(logits, dim=-1, descending=True)
    assert torch.equal(out.logprobs_token_ids[:, 1:], order[:, :k])  # top-k in descending order
    for i, t in enumerate(out.sampled_token_ids.tolist()):
        assert out.ranks[i] == order[i].tolist().index(t) + 1


def test_gather_logprobs_standalone():
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), -1).repeat(3, 1)
    ids, lps, ranks = gather_logprobs(lp, torch.tensor([1, 0, 3]), 2)
    assert ids.tolist() == [[1, 1, 3], [0, 1, 3], [3, 1, 3]]
    assert ranks.tolist() == [1, 4, 2]
    torch.testing.assert_close(lps, lp.gather(1, ids))
    ids, lps, ranks = gather_logprobs(lp, torch.tensor([2, 2, 2]), 0)
    assert ids.tolist() == [[2]] * 3 and ranks.tolist() == [3] * 3
    # ties rank a token after its equals (vLLM counts logprobs >= the token's)
    tied = torch.log_softmax(torch.tensor([[0.0, 3.0, 3.0, 1.0]]), -1)
    assert gather_logprobs(tied, torch.tensor([1]), 1)[2].tolist() == [2]
    assert gather_logprobs(tied, torch.tensor([3]), 1)[2].tolist() == [3]
    # k past the vocab is cut to the vocab
    assert gather_logprobs(lp, torch.tensor([1, 0, 3]), 10)[0].shape == (3, 5)


def test_no_logprobs_unless_asked():
    out = Sampler()(torch.randn(3, 9), metadata([SamplingParams()] * 3, 9))
    assert out.logprobs is None and out.logprobs_token_ids is None and out.ranks is None


# -- extremes -----------------------------------------------------------------------------

def test_temperature_extremes_are_finite():
    logits = torch.tensor(LOGITS12, dtype=torch.float32).repeat(N_DRAWS, 1) * 30.0
    cold = sample(logits, [SamplingParams(temperature=1e-5, logprobs=2)] * N_DRAWS)
    assert (cold == int(np.argmax(LOGITS12))).all()
    tiny = sample(logits, [SamplingParams(temperature=1e-6, top_p=0.5, min_p=0.5)] * N_DRAWS)
    assert (tiny == int(np.argmax(LOGITS12))).all()  # below the greedy threshold
    hot_logits = torch.tensor(LOGITS12, dtype=torch.float32).repeat(N_DRAWS, 1)
    hot = sample(hot_logits, [SamplingParams(temperature=100.0)] * N_DRAWS)
    assert chi_square_pvalue(hot, reference_probs(LOGITS12, temperature=100.0)) > 1e-3


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.randn(500, 3000, generator=torch.Generator().manual_seed(6))
    tokens = sample(logits, [SamplingParams(top_p=1e-9)] * 500)
    assert torch.equal(tokens, logits.argmax(-1))


def test_all_masked_but_one():
    logits = torch.full((6, 10), NEG_INF)
    logits[:, 7] = -3.0
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=1e-5),
              SamplingParams(top_p=0.1, top_k=3), SamplingParams(min_p=0.9, logprobs=3),
              SamplingParams(temperature=100.0, seed=5, repetition_penalty=1.5, presence_penalty=1.0)]
    out = Sampler()(logits, metadata(params, 10, outputs=[[7, 1]] * 6))
    assert out.sampled_token_ids.tolist() == [7] * 6
    assert out.ranks.tolist() == [1] * 6
    assert (out.logprobs[:, 0] == 0.0).all()
    assert not torch.isnan(out.logprobs).any()


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), metadata([], 10))
    assert out.sampled_token_ids.shape == (0,)


@pytest.mark.parametrize("names", [("cpu", "cpu:0"), pytest.param(("cuda", "cuda:0"), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_one_generator_per_device_whatever_its_name(names: tuple[str, str]):
    """A runner made with device "cuda" registers the batch generator with its graphs
    while its tensors say "cuda:0": both names must give the one generator (on the H100
    two generators made every sampling tail's capture fail)."""
    sampler = Sampler(seed=0)
    plain, indexed = (torch.device(name) for name in names)
    assert sampler.batch_generator(plain) is sampler.batch_generator(indexed)
    md = metadata([SamplingParams(temperature=1.0)] * 2, 8)
    sampler.uniform(torch.zeros(2, 8, device=indexed), md)
    assert list(sampler._batch_generators) == [sampler.batch_generator(plain).device]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampling_makes_no_host_sync():
    """On a GPU the sampler never waits for the device: every filter (top-p sorts), the
    penalties, seeds and the race stay on the device until the runner's one copy."""
    dev = torch.device("cuda")
    vocab = 4096
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=3, repetition_penalty=1.1),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_p=0.5, presence_penalty=0.5)]
    md = SamplingMetadata.build(params, [[1, 2, 3]] * 3, [[4, 5]] * 3, valid_vocab_size=vocab,
                                eos_token_id=0, device=dev)
    logits = torch.randn(3, vocab, device=dev) * 4
    sampler = Sampler(seed=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = sampler(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.sampled_token_ids.shape == (3,)
    assert result.sampled_token_ids[1].item() == logits[1].argmax().item()


@pytest.mark.parametrize("name", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_grammar_rows_sample_only_allowed_tokens_and_the_gpu_path_makes_no_host_sync(name: str):
    """A step's grammar bitmask (xgrammar's int32 words, bit 31 included) reaches the
    device and masks its rows only: sampled and greedy rows under a grammar take allowed
    ids, the free row its own argmax. On a GPU nothing waits for the device."""
    dev = torch.device(name)
    vocab = 4096
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0)]
    md = SamplingMetadata.build(params, [[1, 2, 3]] * 3, [[4, 5]] * 3, valid_vocab_size=vocab,
                                eos_token_id=0, device=dev)
    allowed = {0: [7, 31, 100, 4095], 2: [63]}  # 31 and 63: a word's sign bit
    words = np.zeros((2, vocab // 32), dtype=np.uint32)
    for i, ids in enumerate(allowed.values()):
        for t in ids:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(dev) * 4
    logits[2, 63] = -50.0  # the grammar's only choice, far from the row's argmax
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        md.set_grammar_bitmask([0, 2], words.view(np.int32).tobytes(), dev)
        result = Sampler(seed=0)(logits, md)
    finally:
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    tokens = result.sampled_token_ids.tolist()
    assert tokens[0] in allowed[0] and tokens[2] == 63
    assert tokens[1] == logits[1].argmax().item()
