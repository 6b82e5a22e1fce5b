"""Speculative decoding never changes what is sampled: greedy outputs equal plain
decoding token for token (n-gram drafts, and oracle drafts that exercise acceptance at
every position), and the rejection sampler's outputs follow the target distribution
(chi-square, with a negative control)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmd import LLM, GuidedDecodingParams, SamplingParams
from llmd.gpu.sample.rejection_sampler import verify
from llmd.gpu.sample.sampler import Sampler, SamplingMetadata
from llmd.core.spec_decode import NgramProposer, SpecDecodeStats
from llmd_tools.make_model import fixture_path
from sampler_refs import chi_square_pvalue, reference_probs

CODE = "def parse(path):\n    with open(path) as f:\n        return [line.split(',') for line in f]\n"
PROMPTS = [CODE * 3, "hello world " * 8, "abc", CODE + "# edited\n" + CODE.replace("parse", "load")]


def spec_config(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-llama"))


@pytest.fixture(scope="module")
def plain(model) -> LLM:
    return LLM(model=model, dtype="float32", max_model_len=512)


def greedy(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


class OracleProposer:
    """Proposes the reference continuation (what plain greedy decoding produced), with
    every `corrupt`-th position wrong: drafts are accepted, rejected and cut short at
    every position, which the random-weight models never do with n-gram drafts."""

    def __init__(self, tokenizer, prompts: list[str], refs: list[list[int]], k: int, corrupt: int = 0) -> None:
        self.refs = [(tokenizer(p).input_ids, r) for p, r in zip(prompts, refs)]
        self.k = k
        self.corrupt = corrupt

    def propose(self, token_ids: list[int], req_id: str | None = None) -> list[int]:
        for prompt, ref in self.refs:
            if token_ids[:len(prompt)] == prompt and token_ids[len(prompt):] == ref[:len(token_ids) - len(prompt)]:
                done = len(token_ids) - len(prompt)
                drafts = ref[done:done + self.k]
                if self.corrupt:
                    drafts = [(t + 1) % 1000 if (done + i) % self.corrupt == self.corrupt - 1 else t
                              for i, t in enumerate(drafts)]
                return drafts
        return []

    def forget(self, req_id: str) -> None:
        pass


def with_oracle(llm: LLM, prompts, refs, k: int, corrupt: int = 0) -> LLM:
    llm.engine.scheduler.drafts.proposer = OracleProposer(llm.engine.tokenizer, prompts, refs, k, corrupt)
    llm.engine.scheduler.spec_stats = SpecDecodeStats()
    return llm


# -- the proposer -------------------------------------------------------------------------

def test_ngram_proposer_prefers_the_most_recent_longest_match():
    p = NgramProposer(k=3, n_min=1, n_max=3)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 7, 1, 2, 3]) == [7, 7, 7]  # latest of two
    assert p.propose([5, 6, 1, 2, 8, 2]) == [8, 2]  # no 2- or 3-gram; the 1-gram "2": what followed it
    assert p.propose([1, 2, 3, 4]) == []  # the suffix never matches itself
    assert p.propose([4, 5, 4, 5, 4], k=1) == [5]
    # Longer n first: "3 4" occurs followed by 10, while "4" alone last occurred before 11.
    assert NgramProposer(k=1, n_min=1, n_max=2).propose([3, 4, 10, 4, 11, 3, 4]) == [10]
    assert NgramProposer(k=2, n_min=2, n_max=2).propose([1, 2, 1]) == []


def test_indexed_proposals_equal_the_scan():
    """A request's index, kept between calls and grown by the tokens each step adds,
    proposes what a scan of the whole sequence proposes (random sequences over small
    vocabularies, so matches of every length are common)."""
    rng = np.random.default_rng(0)
    num_matches = 0
    for trial in range(200):
        n_min = int(rng.integers(1, 4))
        p = NgramProposer(k=int(rng.integers(1, 6)), n_min=n_min, n_max=int(rng.integers(n_min, 7)))
        vocab = int(rng.choice([2, 3, 5, 20]))
        tokens = rng.integers(0, vocab, size=int(rng.integers(0, 6))).tolist()
        for step in range(25):
            drafts = p.propose(tokens, req_id="r")
            assert drafts == p.propose(tokens), (tokens, p.n_min, p.n_max)
            num_matches += bool(drafts)
            tokens += rng.integers(0, vocab, size=int(rng.integers(1, 7))).tolist()
    assert 1000 < num_matches < 5000  # of 5000 proposals: matches and misses both exercised


def test_an_index_follows_its_request():
    p = NgramProposer(k=2, n_min=1, n_max=2)
    seq = [1, 2, 3, 1]
    assert p.propose(seq, req_id="a") == [2, 3]
    seq += [5, 6, 5]
    assert p.propose(seq, req_id="a") == [6, 5]  # indexed only the tokens added
    assert p.indexes["a"].num_tokens == 7
    # Another sequence under the same id (not the indexed one grown) is indexed afresh.
    assert p.propose([7, 8, 9, 7, 8], req_id="a") == [9, 7]
    p.forget("a")
    assert p.indexes == {}


# -- greedy equality ------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 16])
def test_ngram_greedy_equals_plain(model, plain, batch):
    prompts = (PROMPTS * 4)[:batch]
    ref = outputs(plain, prompts, greedy())
    for k in range(1, 6):
        llm = LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(k))
        assert outputs(llm, prompts, greedy()) == ref, k
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafts_greedy_equals_plain(model, plain, batch, k):
    prompts = (PROMPTS * 4)[:batch]
    ref = outputs(plain, prompts, greedy())
    llm = with_oracle(LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(k)),
                      prompts, ref, k, corrupt=7)
    assert outputs(llm, prompts, greedy()) == ref
    stats = llm.engine.scheduler.spec_stats
    assert 0.3 < stats.acceptance_rate < 1.0
    per_position = stats.accepted_per_position
    assert len(per_position) == k and per_position == sorted(per_position, reverse=True) and per_position[-1] > 0


def test_exact_drafts_are_all_accepted(model, plain):
    """Drafts that are the target's own greedy output: acceptance 100% at temperature 0."""
    ref = outputs(plain, PROMPTS, greedy())
    llm = with_oracle(LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(4)),
                      PROMPTS, ref, 4)
    assert outputs(llm, PROMPTS, greedy()) == ref
    stats = llm.engine.scheduler.spec_stats
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length > 4.0  # 4 drafts + 1 per step, less the final short steps


def test_chunked_prefill_and_preemption(model, plain):
    prompts = [("word " * (30 + 9 * i)) + CODE for i in range(8)]
    ref = outputs(plain, prompts, greedy(64))
    tight = LLM(model=model, dtype="float32", max_model_len=512, num_gpu_blocks_override=36, block_size=16,
                long_prefill_token_threshold=32, max_num_batched_tokens=64, speculative_config=spec_config(3))
    with_oracle(tight, prompts, ref, 3, corrupt=5)
    assert outputs(tight, prompts, greedy(64)) == ref
    assert tight.engine.scheduler.stats.num_preemptions_total > 0
    assert tight.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert tight.engine.kv_cache_manager.num_free_blocks == tight.engine.num_blocks


def test_stops_and_max_tokens_are_never_overrun(model, plain):
    ref_long = outputs(plain, PROMPTS[:1], greedy(40))[0]
    stop_id = ref_long[17]
    cases = [greedy(11), SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0.0, max_tokens=40, stop=[plain.engine.tokenizer.decode(ref_long[20:23])])]
    llm = LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(5))
    for params in cases:
        expected = plain.generate(PROMPTS[:1], params)[0].outputs[0]
        with_oracle(llm, PROMPTS[:1], [ref_long], 5)
        got = llm.generate(PROMPTS[:1], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason)


def test_logprobs_of_accepted_tokens_match(model, plain):
    params = greedy(24, logprobs=3)
    expected = plain.generate(PROMPTS, params)
    llm = with_oracle(LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(3)),
                      PROMPTS, [o.outputs[0].token_ids for o in expected], 3, corrupt=3)
    got = llm.generate(PROMPTS, params)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) < 1e-4 and pa[t].rank == pb[t].rank


def test_opt_out_gets_no_drafts(model):
    llm = LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(3))
    llm.generate(PROMPTS, greedy(speculative=False))
    assert llm.engine.scheduler.spec_stats.num_drafts == 0


def test_guided_requests_verify_grammar_checked_drafts(model, plain):
    """Drafts are cut at the first token the grammar refuses, every verified position has
    its own grammar mask, and the matcher rolls back: greedy guided output is unchanged,
    sampled guided output stays valid."""
    from test_guided import PERSON, json_valid

    guided = GuidedDecodingParams(json_schema=PERSON)
    params = SamplingParams(temperature=0.0, max_tokens=192, guided=guided)
    ref = outputs(plain, PROMPTS, params)
    llm = with_oracle(LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(4)),
                      PROMPTS, ref, 4, corrupt=6)
    assert outputs(llm, PROMPTS, params) == ref
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=192, guided=guided) for s in range(8)]
    with_oracle(llm, PROMPTS, ref, 4, corrupt=6)
    for out in llm.generate(PROMPTS * 2, sampled):
        sample = out.outputs[0]
        assert sample.finish_reason == "length" or json_valid(sample.text, PERSON), sample.text


def test_sampling_with_drafts_runs_and_respects_seeds(model):
    """Seeded sampling with speculation is reproducible run to run (the distribution
    itself is checked on the rejection sampler below)."""
    llm = LLM(model=model, dtype="float32", max_model_len=512, speculative_config=spec_config(3))
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True)
    first = outputs(llm, PROMPTS, params)
    assert outputs(llm, PROMPTS, params) == first
    assert all(len(t) == 32 for t in first)


def test_tensor_parallel_verification(model, plain):
    ref = outputs(plain, PROMPTS, greedy(24))
    llm = LLM(model=model, dtype="float32", max_model_len=512, tensor_parallel_size=2, device="cpu",
              speculative_config=spec_config(3))
    try:
        with_oracle(llm, PROMPTS, ref, 3, corrupt=4)
        assert outputs(llm, PROMPTS, greedy(24)) == ref
    finally:
        llm.engine.shutdown()


# -- the rejection sampler's distribution ------------------------------------------------------

ROW0 = np.array([0.3, 2.0, -0.9, 1.1, -0.2, 1.6, 0.0, -1.4, 0.8, 1.3, -0.5, 0.5])
ROW1 = np.array([1.0, -0.3, 0.4, 2.2, -1.0, 0.1, 0.9, -0.6, 1.7, 0.2, -2.0, 0.6])


def verify_many(n: int, draft: int, params: SamplingParams, sampler: Sampler | None = None) -> list[list[int]]:
    """n identical requests, each verifying one draft over rows ROW0 (after the last
    token) and ROW1 (after the draft)."""
    logits = torch.tensor(np.stack([ROW0, ROW1] * n), dtype=torch.float32)
    md = SamplingMetadata.build([params] * (2 * n), [[]] * (2 * n), [[], [draft]] * n,
                                valid_vocab_size=len(ROW0))
    return verify(sampler or Sampler(seed=3), logits, md, [[draft]] * n).token_ids


@pytest.mark.parametrize("draft", [1, 7])  # a likely draft and an unlikely one
@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 6)])
def test_rejection_sampler_output_follows_the_target(draft, temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    emitted = verify_many(40000, draft, params)
    first = torch.tensor([t[0] for t in emitted])
    p0 = reference_probs(ROW0, temperature=temperature, top_k=top_k)
    assert chi_square_pvalue(first, p0) > 1e-3
    # After an accepted draft, the bonus token follows the next position's distribution.
    second = torch.tensor([t[1] for t in emitted if len(t) == 2])
    assert abs(len(second) / len(emitted) - p0[draft]) < 0.02
    if len(second) > 500:
        assert chi_square_pvalue(second, reference_probs(ROW1, temperature=temperature, top_k=top_k)) > 1e-3


def test_chi_square_catches_a_biased_verifier(monkeypatch):
    """Negative control: a verifier that accepts every draft over-represents it."""
    biased = Sampler(seed=3)
    monkeypatch.setattr(biased, "uniform", lambda like, md, salt=0: torch.zeros_like(like, dtype=torch.float32)
                        if salt else Sampler.uniform(biased, like, md, salt))
    emitted = verify_many(20000, 7, SamplingParams(temperature=1.0), sampler=biased)
    first = torch.tensor([t[0] for t in emitted])
    assert chi_square_pvalue(first, reference_probs(ROW0)) < 1e-6


def test_greedy_rows_accept_exactly_the_argmax():
    params = SamplingParams(temperature=0.0)
    assert verify_many(2, 1, params) == [[1, 3], [1, 3]]  # ROW0's argmax is 1, ROW1's is 3
    assert verify_many(1, 5, params) == [[1]]  # rejected: the argmax instead
