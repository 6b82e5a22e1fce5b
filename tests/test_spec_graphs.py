"""Decode graphs under speculative decoding (input_batch, draft_model).

A request verifying k drafts runs as 1 + k decode rows, so a verify step replays a
decode graph; the draft model's forward over a graph step and its draft steps replay
the draft's own graphs. On CPU the graphs run emulated (the same static buffers,
padding and scratch-block rows, the forward called instead of a graph replayed). What
must hold, for n-gram drafts, oracle drafts that are partly wrong and a draft model,
under preemption and prefix caching: the greedy output with graphs is the plain greedy
output and the speculative output without graphs (tokens and logprobs, with GEMMs made
batch-invariant), padded rows write nowhere but the scratch block (KVWatch), and the
verify steps did replay graphs.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmd import LLM
from llmd.gpu.layers.attention import AttentionMetadata, TorchAttention, set_decode_rows
from llmd.core.spec_decode import SpecDecodeStats
from llmd_tools.make_model import fixture_path
from test_cuda_graphs import PROMPTS, TEXT, KVWatch, batch_invariant_linear, greedy, run_waves  # noqa: F401
from test_spec_decode import OracleProposer
from triton_attention_cases import attend
from test_spec_draft_model import model, noisy_draft  # noqa: F401

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (3, None), (None, 5.0)])
def test_verify_rows_attend_as_the_prefill_row(window, softcap) -> None:
    """The 1 + k tokens of a verify, after a cached context, as one prefill row and as
    1 + k decode rows (token i at position p + i, seq_len p + i + 1), beside a plain
    decode row: the same outputs and the same cache (the step's K/V are written before
    any row attends). Windows of 6 and 3 cut inside the context and inside the new
    tokens; GQA (4 query heads on 2 kv heads)."""
    gen = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, dim = 4, 4, 2, 8
    blocks = [3, 0, 5, 2, 6, 7]  # the verifying request's table (not in order)
    other, other_len = [1, 4], 7  # a plain decode row: 6 tokens cached, its new one at position 6
    cached, n = 13, 5  # 13 tokens in the cache, then the last token and 4 drafts
    cache = torch.randn(2, kv_heads, 9, bs, dim, generator=gen)
    q, k, v = (torch.randn(1 + n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    positions = list(range(cached, cached + n))
    slots = [other[(other_len - 1) // bs] * bs + (other_len - 1) % bs] + \
        [blocks[p // bs] * bs + p % bs for p in positions]
    attention = TorchAttention(heads, kv_heads, dim, dim ** -0.5, sliding_window=window, softcap=softcap)

    def run(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        kv = cache.clone()
        return attend(attention, q, k, v, kv, md), kv

    as_prefill = AttentionMetadata(torch.tensor(slots), 1, None, None,
                                   [(1, n, cached, torch.tensor(blocks[:-(-(cached + n) // bs)]))])
    set_decode_rows(as_prefill, [other], [other_len], torch.device("cpu"))
    as_decodes = AttentionMetadata(torch.tensor(slots), 1 + n, None, None, [])
    set_decode_rows(as_decodes, [other] + [blocks[:(p + bs) // bs] for p in positions],
                    [other_len] + [p + 1 for p in positions], torch.device("cpu"))
    (out_a, kv_a), (out_b, kv_b) = run(as_prefill), run(as_decodes)
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-5)
    assert torch.equal(kv_a, kv_b)


def graphs_on(llm: LLM) -> None:
    """Emulated decode graphs on the runner and, with a draft model, on its drafter: what
    ModelRunner.init_decode_graphs captures on CUDA. A runner that does not yet build the
    drafter's graphs (and run the drafter on a graph step's rows) gets both here."""
    runner = llm.engine.executor.runner
    runner.init_decode_graphs(emulate=True)
    drafter = runner.drafter
    if drafter is None or drafter.decode_graphs is not None:
        return
    drafter.init_decode_graphs(runner.decode_graphs.sizes, emulate=True)
    target_run = runner.decode_graphs.run

    def run(input_ids, positions, slots, seq_lens, tables, fix=None, **kwargs):
        hidden = target_run(input_ids, positions, slots, seq_lens, tables, fix=fix, **kwargs)
        drafter.forward_decode_rows(input_ids, positions, slots, seq_lens, tables, fix)
        return hidden

    runner.decode_graphs.run = run


class VerifyReplays:
    """Counts the steps that verify drafts, those of them that replayed a graph, and
    those that could not (a prefill chunk in the step)."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine.executor.runner
        self.rows = None
        self.verify_steps = 0
        self.with_prefills = 0
        self.replayed = 0
        prepare, run = runner.batch.prepare, runner.decode_graphs.run

        def recording_prepare(so, chain):
            self.rows = prepare(so, chain)
            self.verify_steps += bool(self.rows.verifies)
            self.with_prefills += bool(self.rows.verifies and self.rows.prefills)
            return self.rows

        def counting_run(*args, **kwargs):
            self.replayed += bool(self.rows.verifies)
            return run(*args, **kwargs)

        runner.batch.prepare = recording_prepare
        runner.decode_graphs.run = counting_run


def draft_kv_watch(llm: LLM) -> KVWatch:
    """KVWatch over the draft model's graphs and cache (same block ids, same scratch block)."""
    drafter = llm.engine.executor.runner.drafter
    view = SimpleNamespace(decode_graphs=drafter.decode_graphs, scratch_block=drafter.scratch_block,
                           block_size=drafter.settings.block_size, kv_caches=drafter.kv_caches)
    return KVWatch(SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(runner=view),
                                                          kv_cache_manager=llm.engine.kv_cache_manager)))


def make_llm(model_dir: str, spec: dict | None, graphs: bool, **settings) -> LLM:
    settings = {"num_gpu_blocks_override": 256, "max_model_len": 256, **settings}
    llm = LLM(model=model_dir, speculative_config=spec, **settings)
    if graphs:
        graphs_on(llm)
    return llm


def with_oracle(llm: LLM, waves, refs: dict, corrupt: int) -> LLM:
    """Oracle drafts (the plain run's output, every `corrupt`-th position wrong)."""
    requests = [(prompt, refs[rid][0][0]) for wave in waves.values() for rid, prompt, _ in wave]
    llm.engine.scheduler.drafts.proposer = OracleProposer(llm.engine.tokenizer, [p for p, _ in requests],
                                                   [r for _, r in requests], NGRAM["num_speculative_tokens"],
                                                   corrupt)
    llm.engine.scheduler.spec_stats = SpecDecodeStats()
    return llm


def tokens(outputs: dict) -> dict:
    return {rid: [sample[0] for sample in out[:-1]] for rid, out in outputs.items()}


def check_three_ways(model_dir: str, spec: dict, waves, oracle: int | None = None, **settings):
    """Plain greedy, speculative without graphs and speculative with emulated graphs:
    the same tokens and logprobs for every request (after a preemption, the same tokens
    as plain decoding: its recompute, a prefill, attends through another kernel than the
    decode rows that first computed those positions, and the steps at which plain and
    speculative runs preempt differ). Returns the graph run's engine and its
    VerifyReplays and KVWatch."""
    plain = run_waves(make_llm(model_dir, None, False, **settings), waves)
    runs = []
    for graphs in (False, True):
        llm = make_llm(model_dir, spec, graphs, **settings)
        if oracle is not None:
            with_oracle(llm, waves, plain, oracle)
        watch = (VerifyReplays(llm), KVWatch(llm)) if graphs else None
        runs.append(run_waves(llm, waves))
        llm.engine.kv_cache_manager.check_integrity()
        llm.engine.kv_cache_manager.assert_all_free()
    eager, graphed = runs
    assert eager.keys() == graphed.keys() == plain.keys()
    for rid in plain:
        assert graphed[rid] == eager[rid], rid
    preempted = llm.engine.get_stats()["num_preemptions"] > 0
    assert (tokens(graphed) if preempted else graphed) == (tokens(plain) if preempted else plain)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    return llm, watch


def test_ngram_verify_steps_replay_graphs(batch_invariant_linear) -> None:
    """Every step after the prompts' prefill is decodes and verifies only: every verify
    step replays a graph, padded (3 requests x up to 4 rows in a captured size)."""
    waves = {0: [(f"n{i}", TEXT * 2 if i % 2 else PROMPTS[i], greedy(30)) for i in range(3)]}
    llm, (replays, kv) = check_three_ways(str(fixture_path("tiny-llama")), NGRAM, waves)
    assert replays.verify_steps > 0 and replays.replayed == replays.verify_steps
    assert kv.padded_steps > 0


@pytest.mark.parametrize("corrupt", [2, 5])
def test_oracle_drafts_with_graphs(batch_invariant_linear, corrupt: int) -> None:
    """Drafts that are the plain output with every corrupt-th position wrong: accepted,
    rejected and cut short at every position; requests arrive mid-run (their prefills
    run eagerly beside verify rows) and finish at different lengths."""
    waves = {0: [(f"o{i}", PROMPTS[i], greedy(14 + 5 * i)) for i in range(4)],
             6: [("late", TEXT, greedy(12)), ("later", PROMPTS[9], greedy(9))]}
    llm, (replays, kv) = check_three_ways(str(fixture_path("tiny-llama")), NGRAM, waves, oracle=corrupt)
    stats = llm.engine.scheduler.spec_stats
    assert 0.2 < stats.acceptance_rate < 1.0
    assert replays.with_prefills > 0 and replays.replayed == replays.verify_steps - replays.with_prefills > 0
    assert kv.padded_steps > 0


def test_oracle_drafts_with_graphs_under_preemption(batch_invariant_linear) -> None:
    prompts = [TEXT * 2, "import sys", TEXT, "class A:", "for x in y:", TEXT[:30]]
    waves = {0: [(f"p{i}", p, greedy(40)) for i, p in enumerate(prompts)]}
    llm, (replays, _) = check_three_ways(str(fixture_path("tiny-llama")), NGRAM, waves, oracle=4,
                                         num_gpu_blocks_override=12, max_model_len=160)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert replays.replayed == replays.verify_steps - replays.with_prefills > 0


def test_oracle_drafts_with_graphs_and_prefix_caching(batch_invariant_linear) -> None:
    shared = TEXT * 3
    waves = {0: [(f"s{i}", shared + PROMPTS[i], greedy(12 + 2 * i)) for i in range(3)],
             4: [(f"t{i}", shared + PROMPTS[i + 3], greedy(14)) for i in range(4)]}
    llm, (replays, _) = check_three_ways(str(fixture_path("tiny-llama")), NGRAM, waves, oracle=3)
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert replays.replayed == replays.verify_steps - replays.with_prefills > 0


@pytest.mark.parametrize("preempt", [False, True])
def test_draft_model_with_graphs(batch_invariant_linear, model, noisy_draft, preempt: bool) -> None:  # noqa: F811
    """The draft model's forward over graph steps and its draft steps replay its own
    graphs, whose padded rows stay in the draft cache's scratch block; drafts are
    accepted at about half the positions and the output is the plain output."""
    spec = {"method": "draft_model", "draft_model": noisy_draft, "num_speculative_tokens": 3}
    prompts = [TEXT * 2, "import sys", TEXT, "class A:", "for x in y:", TEXT[:30]]
    waves = {0: [(f"d{i}", p, greedy(24 + 3 * i)) for i, p in enumerate(prompts)],
             5: [("late", PROMPTS[10], greedy(10))]}
    settings = {"num_gpu_blocks_override": 14, "max_model_len": 160} if preempt else {}
    plain = run_waves(make_llm(model, None, False, **settings), waves)
    eager = make_llm(model, spec, False, **settings)
    graphed = make_llm(model, spec, True, **settings)
    replays, draft_kv = VerifyReplays(graphed), draft_kv_watch(graphed)
    KVWatch(graphed)
    eager_out = run_waves(eager, waves)
    assert run_waves(graphed, waves) == eager_out
    assert (tokens(eager_out) if preempt else eager_out) == (tokens(plain) if preempt else plain)
    runner = graphed.engine.executor.runner
    stats = graphed.engine.scheduler.spec_stats
    assert stats.acceptance_rate > 0.2
    assert stats == eager.engine.scheduler.spec_stats  # the same drafts, proposed and accepted
    assert replays.replayed == replays.verify_steps - replays.with_prefills > 0
    # One draft replay per target graph step (its forward), and more for the draft steps.
    assert runner.drafter.decode_graphs.num_replays > runner.decode_graphs.num_replays > 0
    assert draft_kv.padded_steps > 0
    assert (graphed.engine.get_stats()["num_preemptions"] > 0) == preempt
    graphed.engine.kv_cache_manager.check_integrity()
    graphed.engine.kv_cache_manager.assert_all_free()
