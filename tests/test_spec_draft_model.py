"""Draft-model speculative decoding never changes what is sampled: a draft that is the
target itself has every draft accepted at temperature 0; a different draft (the target
with perturbed weights, accepted at about half the positions) gives greedy output equal
to plain decoding at batch 1 and 16, k = 1..5, under chunked prefill and preemption, near
max_model_len, under guided decoding and in a worker process. The general rejection
rule (accept with min(1, p/q), else sample from max(p - q, 0)) makes the emitted tokens
follow the target (chi-square, with a negative control). Bad configurations are clear
errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmd import LLM, GuidedDecodingParams, SamplingParams
from llmd.gpu.sample.rejection_sampler import verify
from llmd.gpu.sample.sampler import Sampler, SamplingMetadata
from llmd_tools.make_model import fixture_path
from sampler_refs import chi_square_pvalue, reference_probs
from test_spec_decode import PROMPTS, ROW0, ROW1, greedy, outputs

BASE = dict(dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def plain(model) -> LLM:
    return LLM(model=model, **BASE)


def draft_config(draft: str, k: int) -> dict:
    return {"method": "draft_model", "draft_model": draft, "num_speculative_tokens": k}


def spec_llm(model: str, draft: str, k: int, **settings) -> LLM:
    return LLM(model=model, **{**BASE, **settings}, speculative_config=draft_config(draft, k))


def copy_model(src: str | Path, dst: Path, edit_weights=None, edit_config=None) -> str:
    """A copy of model directory `src` with its weights and config.json edited."""
    shutil.copytree(src, dst)
    if edit_weights is not None:
        weights = dst / "model.safetensors"
        save_file(edit_weights(load_file(str(weights))), str(weights), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def noisy_draft(model, tmp_path_factory) -> str:
    """The target with every weight matrix perturbed by 1.5% of its std: it agrees with
    the target's greedy choice at roughly half the positions (the random-weight fixtures
    are chaotic: 10% noise leaves under 10%)."""
    gen = torch.Generator().manual_seed(1)

    def perturb(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: w + 0.015 * w.std() * torch.randn(w.shape, generator=gen) if w.dim() > 1 else w
                for name, w in weights.items()}

    return copy_model(model, tmp_path_factory.mktemp("draft") / "noisy", perturb)


# -- greedy equality --------------------------------------------------------------------------

def test_draft_equal_to_the_target_is_always_accepted(model, plain):
    ref = outputs(plain, PROMPTS, greedy())
    llm = spec_llm(model, model, 4)
    assert outputs(llm, PROMPTS, greedy()) == ref
    stats = llm.engine.scheduler.spec_stats
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length > 4.0  # 4 drafts + 1 per step, less the final short steps


def test_draft_equal_to_the_target_has_q_equal_to_p(model, monkeypatch):
    """Sampling with the target as its own draft: the q kept for every verified draft is
    the target's p at that row (the same position, filters, penalties and min_tokens),
    so min(1, p/q) accepts (nearly) all."""
    import llmd.gpu.worker.sampling_step as sampling_step

    num_checked = []

    def checking_verify(sampler, logits, md, drafts, draft_probs=None):
        p = sampler.filter(sampler.prepare(sampler.mask(logits.clone(), md), md)[0], md).softmax(dim=-1)
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
        rows = [r for start, d in zip(starts, drafts) for r in range(start, start + len(d))]
        torch.testing.assert_close(draft_probs[rows], p[rows], atol=1e-4, rtol=0)
        num_checked.append(len(rows))
        return verify(sampler, logits, md, drafts, draft_probs)

    monkeypatch.setattr(sampling_step, "verify", checking_verify)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, min_tokens=30,
                             seed=s, max_tokens=40) for s in range(4)]
    llm = spec_llm(model, model, 4)
    llm.generate(PROMPTS, params)
    assert sum(num_checked) == llm.engine.scheduler.spec_stats.num_draft_tokens > 100
    assert llm.engine.scheduler.spec_stats.acceptance_rate > 0.99


@pytest.mark.parametrize("batch", [1, 16])
def test_draft_model_greedy_equals_plain(model, plain, noisy_draft, batch):
    prompts = (PROMPTS * 4)[:batch]
    ref = outputs(plain, prompts, greedy())
    for k in range(1, 6):
        llm = spec_llm(model, noisy_draft, k)
        assert outputs(llm, prompts, greedy()) == ref, k
        stats = llm.engine.scheduler.spec_stats
        assert 0.2 < stats.acceptance_rate < 0.95, (k, stats)
        assert len(stats.accepted_per_position) == k and stats.accepted_per_position[-1] > 0


def test_chunked_prefill_and_preemption(model, plain, noisy_draft):
    """A tight KV pool: the draft slots are reserved with the step's (or dropped before
    anyone is preempted for them), every block stays consistent, all are freed."""
    prompts = [("word " * (30 + 9 * i)) + PROMPTS[0] for i in range(8)]
    ref = outputs(plain, prompts, greedy(64))
    tight = spec_llm(model, noisy_draft, 3, num_gpu_blocks_override=36, block_size=16,
                     long_prefill_token_threshold=32, max_num_batched_tokens=64)
    engine = tight.engine
    ids = [engine.add_request(None, p, greedy(64)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.kv_cache_manager.check_integrity()
    assert [done[i] for i in ids] == ref
    assert engine.scheduler.stats.num_preemptions_total > 0
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_drafts_stop_at_max_model_len_and_max_tokens(model, noisy_draft):
    """Prompts that leave a few positions before max_model_len: the drafts (and the
    slots reserved for them) never go past what the request may emit."""
    short = dict(BASE, max_model_len=64, num_gpu_blocks_override=40, block_size=4)
    plain_short = LLM(model=model, **short)
    ids = plain_short.tokenizer(PROMPTS[0]).input_ids
    prompts = [ids[:56 + 2 * i] for i in range(4)]  # 8, 6, 4 and 2 positions left
    for params in (SamplingParams(temperature=0.0, ignore_eos=True), greedy(2), greedy(3)):
        ref = outputs(plain_short, prompts, params)
        assert outputs(spec_llm(model, noisy_draft, 5, **short), prompts, params) == ref


def test_mixed_batch_penalties_and_seeds(model, plain, noisy_draft):
    """Greedy rows (with a repetition penalty, seen by the draft too) keep their plain
    output beside sampled rows; seeded sampled rows are reproducible."""
    params = [greedy(32, repetition_penalty=1.3), greedy(32)] + \
        [SamplingParams(temperature=0.9, top_k=20, seed=s, max_tokens=32, ignore_eos=True) for s in range(4)]
    prompts = (PROMPTS * 2)[:len(params)]
    ref = outputs(plain, prompts[:2], params[:2])
    llm = spec_llm(model, noisy_draft, 3)
    first = outputs(llm, prompts, params)
    assert first[:2] == ref
    assert outputs(llm, prompts, params) == first
    assert all(len(t) == 32 for t in first)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_guided_requests(model, plain, noisy_draft):
    """Drafts are grammar-checked; the draft the grammar cuts off (refused, or ending the
    grammar) is verified as the last draft, not dropped. Greedy guided output is
    unchanged; sampled guided output stays valid."""
    from test_guided import PERSON, json_valid

    guided = GuidedDecodingParams(json_schema=PERSON)
    params = SamplingParams(temperature=0.0, max_tokens=192, guided=guided)
    ref = outputs(plain, PROMPTS, params)
    llm = spec_llm(model, noisy_draft, 4)
    scheduler = llm.engine.scheduler
    cut, verified = [], []
    schedule, validate = scheduler.schedule, scheduler.structured.validate_drafts

    def recording_validate(grammar, drafts):
        valid = validate(grammar, drafts)
        if len(valid) < len(drafts):
            cut.append(drafts[:len(valid) + 1])
        return valid

    def recording_schedule():
        so = schedule()
        verified.extend(so.scheduled_spec_decode_tokens.values())
        return so

    scheduler.schedule, scheduler.structured.validate_drafts = recording_schedule, recording_validate
    assert outputs(llm, PROMPTS, params) == ref
    assert scheduler.spec_stats.num_accepted_tokens > 0
    assert any(drafts in verified for drafts in cut), "no cut-off draft was verified"
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=192, guided=guided) for s in range(8)]
    for out in llm.generate(PROMPTS * 2, sampled):
        sample = out.outputs[0]
        assert sample.finish_reason == "length" or json_valid(sample.text, PERSON), sample.text


def test_multiprocess_worker(model, plain, noisy_draft):
    ref = outputs(plain, PROMPTS, greedy(24))
    llm = spec_llm(model, noisy_draft, 3, distributed_executor_backend="mp")
    try:
        assert outputs(llm, PROMPTS, greedy(24)) == ref
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()


def test_kv_sizing_counts_both_models(model, noisy_draft):
    budget = dict(BASE, kv_cache_memory_bytes=4 << 20)
    plain_engine = LLM(model=model, **budget).engine
    engine = spec_llm(model, noisy_draft, 3, **budget).engine
    per_block = plain_engine.executor.kv_cache_bytes_per_block()
    assert engine.executor.kv_cache_bytes_per_block() == 2 * per_block
    assert engine.num_blocks == (4 << 20) // (2 * per_block)
    drafter = engine.executor.runner.drafter
    assert [c.shape for c in drafter.kv_caches] == [c.shape for c in engine.executor.runner.kv_caches]


def test_a_draft_write_outside_the_requests_blocks_is_an_error(model):
    """The worker refuses a draft position the scheduler reserved no slot for."""
    llm = spec_llm(model, model, 3, block_size=4)
    llm.engine.scheduler._draft_lookahead = lambda request, end: 0  # reserves nothing past the step
    execute = llm.engine.executor.execute_model

    def overreaching(so, grammar=None):  # ... but lets the worker draft 3 anyway
        so.draft_max_num_tokens = {r: n + 3 for r, n in so.draft_max_num_tokens.items()}
        return execute(so, grammar)

    llm.engine.executor.execute_model = overreaching
    with pytest.raises(RuntimeError, match="past its .* KV blocks"):
        llm.generate(PROMPTS[2], greedy(8))


# -- configuration errors ------------------------------------------------------------------------

def test_bad_configs_are_clear_errors(model, tmp_path):
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(model=model, **BASE, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="only used with method"):
        LLM(model=model, **BASE, speculative_config={"method": "ngram", "draft_model": model})
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        spec_llm(model, model, 3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="is not a directory"):
        spec_llm(model, str(tmp_path / "missing"), 3)
    with pytest.raises(ValueError, match="vocab size 1088, the target model 1024"):
        spec_llm(model, str(fixture_path("tiny-qwen2")), 3)
    other_eos = copy_model(model, tmp_path / "eos")
    tok_config = Path(other_eos) / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()), "eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="eos token id 4, the target model 1"):
        spec_llm(model, other_eos, 3)
    short = copy_model(model, tmp_path / "short", edit_config=lambda c: c.update(max_position_embeddings=256))
    with pytest.raises(ValueError, match="max_position_embeddings 256, less than max_model_len 512"):
        spec_llm(model, short, 3)


# -- the general rejection rule's distribution --------------------------------------------------------

# The draft's row 0: overlaps ROW0's distribution by about 0.66 (with top-k 6: 0.43, and
# each puts mass where the other has none).
Q0 = np.array([0.3, 1.2, -0.9, 1.9, -0.2, 0.6, 0.0, -1.4, 1.5, 0.4, 0.9, 1.1])


def verify_sampled(n: int, params: SamplingParams, *,
                   sampler: Sampler | None = None) -> tuple[list[list[int]], torch.Tensor]:
    """n requests, each with one draft d ~ q (Q0 after params' filters), verified over
    ROW0, then ROW1 after the draft. Returns what each emitted, and the drafts."""
    q0 = torch.tensor(reference_probs(Q0, temperature=params.temperature, top_k=params.top_k),
                      dtype=torch.float32)
    d = torch.multinomial(q0, n, replacement=True, generator=torch.Generator().manual_seed(5))
    rows, seen = [ROW0, ROW1], [o for t in d.tolist() for o in ([], [t])]
    q, drafts = torch.stack([q0, torch.zeros_like(q0)] * n), [[t] for t in d.tolist()]
    logits = torch.tensor(np.stack(rows * n), dtype=torch.float32)
    md = SamplingMetadata.build([params] * len(seen), [[]] * len(seen), seen, valid_vocab_size=len(ROW0))
    result = verify(sampler or Sampler(seed=3), logits, md, drafts, q)
    return result.token_ids, d


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 6)])
def test_general_rule_output_follows_the_target(temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    p0 = reference_probs(ROW0, temperature=temperature, top_k=top_k)
    q0 = reference_probs(Q0, temperature=temperature, top_k=top_k)
    emitted, drafts = verify_sampled(40000, params)
    first = torch.tensor([t[0] for t in emitted])
    assert chi_square_pvalue(first, p0) > 1e-3
    # A draft is accepted with probability sum(min(p, q)) overall (more than the
    # point-mass rule's sum(p * q), which is unbiased too but ignores q).
    accepted = [len(t) == 2 for t in emitted]
    assert abs(np.mean(accepted) - np.minimum(p0, q0).sum()) < 0.01
    assert all(t[0] == d for t, d, a in zip(emitted, drafts.tolist(), accepted) if a)
    # After an accepted draft the bonus token follows the next position's distribution.
    second = torch.tensor([t[1] for t in emitted if len(t) == 2])
    assert chi_square_pvalue(second, reference_probs(ROW1, temperature=temperature, top_k=top_k)) > 1e-3


def test_chi_square_catches_a_verifier_that_skips_the_residual():
    """Negative control: after a rejection, sample from p instead of max(p - q, 0)."""
    sampler = Sampler(seed=3)
    filtered = []

    def remember_filter(logits, md):
        filtered.append(Sampler.filter(logits, md))
        return filtered[-1]

    sampler.filter = remember_filter
    sampler.race = lambda probs, md, salt=0: Sampler.race(sampler, filtered[-1].softmax(dim=-1), md, salt)
    emitted, _ = verify_sampled(20000, SamplingParams(temperature=1.0), sampler=sampler)
    assert chi_square_pvalue(torch.tensor([t[0] for t in emitted]), reference_probs(ROW0)) < 1e-6
