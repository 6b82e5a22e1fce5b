"""Sampling inside the decode graphs (llmd.gpu.sample.graph_sampler, graph_sampling_plan,
graph_penalties).

On CPU the graphs run emulated: the same static buffers, staging and tail code, called
instead of replayed. Greedy steps sampled in the graph must give exactly the eager
run's tokens in every engine mode (padding, preemption, prefix caching, chained async
steps, penalties, min_tokens, rows that need the eager sampler); random sampling must
draw from the distribution its parameters define (a chi-square test); and the captured
function must never read a tensor back to the host.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from test_cuda_graphs import PROMPTS, TEXT, batch_invariant_linear, compare, make_llm  # noqa: F401 (fixture)

from llmd import LLM, SamplingParams
from llmd.gpu.sample import graph_sampler
from llmd.gpu.sample.graph_penalties import PenaltyTables
from llmd.gpu.sample.graph_sampler import GREEDY, PENALIZED, SAMPLE, WORDS_PER_ROW, GraphSampler, RowParams
from llmd.gpu.worker.graph_sampling_plan import GraphSamplingPlan, SampledRow
from llmd.gpu.worker.runner_types import RunnerRequest
from llmd.gpu.sample.sampler import Sampler
from llmd.gpu.sample.filters import apply_top_k_top_p
from llmd_tools.make_model import fixture_path


def greedy(max_tokens: int, **kw) -> SamplingParams:
    """Greedy without logprobs: a step of such rows samples in the graph."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def graph_compare(waves, graph_settings: dict | None = None, **settings):
    """compare() of test_cuda_graphs (emulated graphs against eager, every request's
    tokens equal, KV writes only where allowed); returns the graphs' step tallies."""
    llm, watch = compare(waves, graph_settings, **settings)
    graphs = llm.engine.executor.runner.decode_graphs
    return llm, watch, graphs


def test_the_switch_turns_the_tails_off(monkeypatch) -> None:
    """LLMD_GRAPH_SAMPLING=0: the graphs sample eagerly (the A/B of the in-graph
    sampling's figures), the same tokens; anything but 0/1/off/on is refused."""
    waves = {0: [(f"a{i}", PROMPTS[i], greedy(6)) for i in range(3)]}
    monkeypatch.setenv(graph_sampler.GRAPH_SAMPLING_ENV, "0")
    llm, _, graphs = graph_compare(waves)
    assert graphs.sampling is None and not graphs.sampled_steps
    monkeypatch.setenv(graph_sampler.GRAPH_SAMPLING_ENV, "yes")
    with pytest.raises(ValueError, match="LLMD_GRAPH_SAMPLING must be 0 or 1"):
        graph_sampler.graph_sampling_enabled()
    for value, enabled in (("", True), ("1", True), ("on", True), ("off", False)):
        monkeypatch.setenv(graph_sampler.GRAPH_SAMPLING_ENV, value)
        assert graph_sampler.graph_sampling_enabled() is enabled


# -- greedy: the same tokens as the eager sampler ----------------------------------------------
@pytest.mark.parametrize("batch", [3, 13])
def test_greedy_in_graph_matches_eager(batch_invariant_linear, batch: int) -> None:
    """`batch` requests (padded to 4 or 16) ending at different lengths, prefills arriving
    mid-run (eager steps between graph steps), one with min_tokens over two stop ids
    (the SAMPLE tail's greedy rows)."""
    waves = {0: [(f"a{i}", PROMPTS[i], greedy(6 + 3 * i)) for i in range(batch)],
             4: [("late", TEXT, greedy(9)),
                 ("min", "import sys", greedy(12, min_tokens=8, stop_token_ids=[7, 13]))],
             8: [("last", PROMPTS[-1], greedy(5))]}
    llm, watch, graphs = graph_compare(waves)
    assert graphs.sampled_steps.get(GREEDY, 0) > 0 and graphs.sampled_steps.get(SAMPLE, 0) > 0
    assert watch.padded_steps > 0 and any(size > 2 for size in graphs.padded_sizes)


def test_greedy_in_graph_with_preemption(batch_invariant_linear) -> None:
    prompts = [TEXT * 2, "import sys", TEXT, "class A:", "for x in y:", TEXT[:30]]
    waves = {0: [(f"p{i}", p, greedy(40)) for i, p in enumerate(prompts)]}
    llm, watch, graphs = graph_compare(waves, num_gpu_blocks_override=10, max_model_len=160)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert graphs.sampled_steps.get(GREEDY, 0) > 0 and watch.padded_steps > 0


def test_greedy_in_graph_with_prefix_caching(batch_invariant_linear) -> None:
    shared = TEXT * 3
    waves = {0: [(f"s{i}", shared + PROMPTS[i], greedy(8 + 2 * i)) for i in range(3)],
             4: [(f"t{i}", shared + PROMPTS[i + 3], greedy(10)) for i in range(4)]}
    llm, _, graphs = graph_compare(waves)
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert graphs.sampled_steps.get(GREEDY, 0) > 0


def test_greedy_in_graph_with_chained_async_steps(batch_invariant_linear) -> None:
    """Chained steps: a step's tokens stay in the static buffer, the next step's rows read
    them through `fix`, and the host reads each step's pinned copy once."""
    waves = {0: [(f"c{i}", PROMPTS[i], greedy(10 + 2 * i)) for i in range(5)],
             6: [("late", TEXT, greedy(7))]}
    llm, watch, graphs = graph_compare(waves, graph_settings={"async_scheduling": True})
    assert watch.fixed_steps > 0 and graphs.sampled_steps.get(GREEDY, 0) > 0
    llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_in_graph_match_eager(batch_invariant_linear, async_scheduling: bool) -> None:
    """Greedy rows with each penalty among plain ones: the PENALIZED tail's tables are
    rebuilt when rows shift (requests finish and arrive) and counted in the graph while
    they stay; chained, a rebuilt row's last token is still on the device."""
    penalties = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.2), dict(presence_penalty=1.5),
                 dict(repetition_penalty=0.8, frequency_penalty=-0.5), {}]
    waves = {0: [(f"r{i}", PROMPTS[i] + TEXT, greedy(6 + 5 * i, **penalties[i])) for i in range(5)],
             7: [("late", TEXT * 2, greedy(12, frequency_penalty=2.0))]}
    llm, _, graphs = graph_compare(waves, graph_settings={"async_scheduling": async_scheduling})
    assert graphs.sampled_steps.get(PENALIZED, 0) > 0
    assert graphs.sampling.penalties is not None
    llm.engine.shutdown()


def test_rows_needing_the_eager_sampler_fall_back(batch_invariant_linear, monkeypatch) -> None:
    """A step with a logprobs row, or a seeded random row, replays the forward graph and
    samples eagerly; steps after those requests finish sample in the graph; batches past
    the tail's budget (here 2 rows) sample eagerly too. All tokens as eager."""
    monkeypatch.setattr(graph_sampler, "GREEDY_TAIL_CELLS", 2 * 1024)
    waves = {0: [(f"g{i}", PROMPTS[i], greedy(16)) for i in range(2)]
             + [("lp", "x = 1", greedy(4, logprobs=2)),
                ("seeded", "import sys", SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=6))],
             10: [(f"h{i}", PROMPTS[4 + i], greedy(6)) for i in range(3)]}
    llm, _, graphs = graph_compare(waves)
    in_graph = sum(graphs.sampled_steps.values())
    assert 0 < in_graph < graphs.num_replays


def test_penalty_tables_follow_their_rows() -> None:
    """PenaltyTables against counts taken from the token lists: requests move between
    rows, get tokens the tables did not count (an eager step), tokens the tail counted,
    and a last token still on the device; rows not refreshed keep what they held."""
    vocab = 16
    tables = PenaltyTables(4, vocab, torch.device("cpu"))
    reqs = {name: RunnerRequest(req_id=name, token_ids=prompt + out, num_prompt_tokens=len(prompt),
                                sampling_params=SamplingParams(), num_computed_tokens=0)
            for name, prompt, out in (("a", [1, 2, 2], [3]), ("b", [4], [5, 5, 15]), ("c", [6, 7], []))}
    in_flight = torch.tensor([9, 11, 12])

    def check(rows: dict[int, tuple[str, int | None]]) -> None:
        for row, (name, src) in rows.items():
            req = reqs[name]
            want = torch.bincount(torch.tensor(req.token_ids[req.num_prompt_tokens:] + ([] if src is None else
                                               [int(in_flight[src])]), dtype=torch.int64), minlength=vocab)
            assert tables.counts[row].tolist() == want.float().tolist(), (row, name)
            prompt = torch.zeros(vocab, dtype=torch.bool)
            prompt[req.token_ids[:req.num_prompt_tokens]] = True
            assert tables.prompt_mask[row].tolist() == prompt.tolist(), (row, name)

    def refresh(rows: dict[int, tuple[str, int | None]]) -> None:
        tables.refresh([(row, reqs[name], src) for row, (name, src) in rows.items()], in_flight)
        check(rows)

    refresh({0: ("a", None), 1: ("b", None)})
    reqs["a"].token_ids.append(8)  # an eager step sampled it: the tables never saw it
    refresh({0: ("a", None), 1: ("b", None)})
    refresh({0: ("b", None), 2: ("a", 0)})  # shifted rows; a's last token (9) still on the device
    tables.counts[2, 11] += 1  # the tail samples a's next token (11) and counts it
    tables.sampled([(2, "a")])
    reqs["a"].token_ids.append(9)  # the host has 9 now; 11 is on the device
    tables.counts[2, 0] += 100  # a marker: an up-to-date row is not rebuilt
    tables.refresh([(2, reqs["a"], 1)], in_flight)
    assert tables.counts[2, 0] == 100
    tables.counts[2, 0] -= 100
    check({2: ("a", 1)})
    refresh({3: ("c", 2), 2: ("a", None)})


# -- random sampling: the distribution its parameters define -----------------------------------
def _row(row: int, params: SamplingParams, num_output: int = 0, stop_ids: tuple[int, ...] = ()) -> SampledRow:
    req = RunnerRequest(req_id=f"r{row}", token_ids=[0] * (3 + num_output), num_prompt_tokens=3,
                        sampling_params=params, num_computed_tokens=2 + num_output)
    return SampledRow(row, req, num_output, None, stop_ids)


def _expected(logits: torch.Tensor, p: SamplingParams, banned: tuple[int, ...] = ()) -> torch.Tensor:
    """The distribution of one row, written from the definitions in float64: temperature,
    the top_k most likely, the fewest most likely whose mass reaches top_p, then those at
    least min_p times the most likely (banned ids removed first)."""
    x = logits.double().clone()
    x[list(banned)] = -math.inf
    probs = torch.softmax(x / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[:p.top_k] if p.top_k else order
    kept = probs[keep] / probs[keep].sum()
    mass, nucleus = 0.0, []
    for token, q in zip(keep, kept.tolist()):
        nucleus.append(token)
        mass += q
        if mass >= p.top_p:
            break
    top = probs[nucleus[0]]
    final = torch.zeros_like(probs)
    for token in nucleus:
        if probs[token] >= p.min_p * top:
            final[token] = probs[token]
    return final / final.sum()


def test_random_sampling_in_graph_matches_the_distribution() -> None:
    """Four groups of rows in one padded batch, each with its own parameters (and a
    greedy group, and padded rows), sampled by the SAMPLE tail over a vocab of 12. For
    each random group a chi-square test of the counts against the expected distribution
    at p >= 1e-4 (the false-failure rate with a random seed; the seed is fixed), and no
    draw outside its support."""
    vocab, b, per_group = 12, 64, 15
    logits = torch.tensor([[2.0, 1.5, 1.4, 1.0, 0.5, 0.0, -0.3, -1.0, -2.0, 0.7, 0.2, -5.0]]).repeat(b, 1)
    groups = [SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.3, top_k=6, top_p=0.85),
              SamplingParams(temperature=1.0, top_p=0.6, min_p=0.2),
              SamplingParams(temperature=1.1, min_tokens=5, stop_token_ids=[0, 3])]
    rows = [_row(g * per_group + i, params, stop_ids=(0, 3) if params.min_tokens else ())
            for g, params in enumerate(groups) for i in range(per_group)]
    rows.append(_row(len(rows), SamplingParams(temperature=0)))
    sampler = GraphSampler(Sampler(seed=1234), vocab, b, torch.device("cpu"))
    params = RowParams.of(torch.zeros(b * WORDS_PER_ROW, dtype=torch.int64), b)
    GraphSamplingPlan(SAMPLE, rows, vocab, None).stage(params)
    draws = []
    for _ in range(400):
        out = torch.empty(b, dtype=torch.int64)
        sampler.tail(SAMPLE, logits, params, out)
        draws.append(out)
    draws = torch.stack(draws)  # [calls, b]
    assert (draws[:, len(rows) - 1] == 0).all()  # the greedy row: the argmax
    assert ((draws >= 0) & (draws < vocab)).all()  # padded rows too
    for g, params_g in enumerate(groups):
        got = torch.bincount(draws[:, g * per_group:(g + 1) * per_group].reshape(-1), minlength=vocab).double()
        want = _expected(logits[0], params_g, (0, 3) if params_g.min_tokens else ()) * got.sum()
        support = want > 0
        assert got[~support].sum() == 0, (g, got, want)
        chi2 = ((got[support] - want[support]) ** 2 / want[support]).sum()
        dof = int(support.sum()) - 1
        p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2).item()
        assert p_value >= 1e-4, (g, p_value, got, want)


# -- no host sync in the captured function -------------------------------------------------------
class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_sync():
    """Any read of a tensor's value by the host (item, tolist, cpu, numpy, nonzero,
    bool/int/float of a tensor: a Python branch on its value) or host data turned into a
    tensor raises: on CUDA each would sync the device or fail the capture."""
    names = ["item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
             "__array__"]
    saved = {name: getattr(torch.Tensor, name) for name in names}
    saved_fns = {name: getattr(torch, name) for name in ("nonzero", "tensor", "as_tensor", "from_numpy")}

    def trap(name):
        def call(*args, **kwargs):
            raise HostSync(f"{name} called inside the captured function")
        return call

    try:
        for name in names:
            setattr(torch.Tensor, name, trap(name))
        for name in saved_fns:
            setattr(torch, name, trap(f"torch.{name}"))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in saved_fns.items():
            setattr(torch, name, fn)


def test_the_sync_trap_catches_a_host_read() -> None:
    """The trap is real: top-p's windowed CPU path reads a vector back."""
    logits = torch.randn(2, 300)
    with pytest.raises(HostSync), no_host_sync():
        apply_top_k_top_p(logits, None, 0, torch.tensor([[0.9], [0.5]]))


def test_captured_function_never_syncs(monkeypatch) -> None:
    """Every emulated replay (forward and tail) of steps of each variant runs under the
    trap; the steps must sample in the graph."""
    llm = make_llm(True)
    graphs = llm.engine.executor.runner.decode_graphs
    for name in ("_forward", "_tail"):
        inner = getattr(graphs, name)

        def trapped(*args, _inner=inner, **kwargs):
            with no_host_sync():
                return _inner(*args, **kwargs)

        monkeypatch.setattr(graphs, name, trapped)
    params = [greedy(6), SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, max_tokens=6),
              SamplingParams(temperature=0.7, max_tokens=6, min_tokens=4, stop_token_ids=[3], repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.5)]
    for i in range(3):
        llm.generate(PROMPTS[:3], [params[i]] * 3)
    assert set(graphs.sampled_steps) == {GREEDY, SAMPLE, PENALIZED}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_tails_match_eager_greedy_and_sample() -> None:
    """Real graphs with their tails against enforce_eager (Triton backend, bf16): the same
    greedy tokens, and random rows with penalties draw valid tokens in the graph."""
    settings = dict(model=str(fixture_path("tiny-llama")), device="cuda", dtype="bfloat16",
                    attention_backend="triton", num_gpu_blocks_override=256, max_model_len=256, max_num_seqs=16)
    params = [greedy(8 + 4 * i) for i in range(13)]
    outs = {}
    for eager in (True, False):
        llm = LLM(enforce_eager=eager, **settings)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:13], params)]
        if not eager:
            graphs = llm.engine.executor.runner.decode_graphs
            assert {(b, GREEDY) for b in graphs.sizes} <= set(graphs.tails)
            random = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, ignore_eos=True,
                                     repetition_penalty=1.2)] * 5
            got = llm.generate(PROMPTS[:5], random)
            assert all(len(o.outputs[0].token_ids) == 12 for o in got)
            assert graphs.sampled_steps.get(GREEDY, 0) > 0 and graphs.sampled_steps.get(PENALIZED, 0) > 0
        llm.engine.shutdown()
    assert outs[False] == outs[True]
