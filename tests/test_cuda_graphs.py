"""CUDA graphs for decode steps (llmd.gpu.worker.cuda_graphs).

On CPU the graph path runs emulated (`init_decode_graphs(emulate=True)`): the same
static buffers, padding to captured sizes and scratch-block rows, with the forward
called instead of a graph replayed. Emulated runs must give exactly the eager run's
tokens and logprobs, and padded rows must write nowhere but the scratch block. The
GPU tests (real graphs against enforce_eager) skip without CUDA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmd import LLM, SamplingParams
from llmd.config import SpeculativeConfig
from llmd.gpu.worker.cuda_graphs import capture_sizes
from llmd_tools.make_model import fixture_path

TEXT = "def parse(path):\n    with open(path) as f:\n        return json.load(f)\n"
PROMPTS = ["a", "import os", TEXT, "x = 1", "class A:\n    pass", "for x in y:", TEXT[:30], "while True:",
           "print(1)", TEXT * 2, "return None", "if a:\n", "# comment", "[1, 2, 3]", "lambda: 0", "try:"]


@pytest.fixture
def batch_invariant_linear(monkeypatch):
    """CPU GEMMs (MKL / oneDNN) pick their kernel by the row count: a row's result can
    differ in the last bits between 3 rows and 4 (measured here: rows agree only between
    4, 8 and >= 12 rows). Computing every linear a row at a time gives each row the same
    bits in any batch, in both runs, so any difference left is the graph path's own
    (padding leaking into real rows, wrong inputs)."""
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        rows = [F.linear(flat[i:i + 1], self.weight, self.bias) for i in range(flat.shape[0])]
        out = torch.cat(rows) if rows else F.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    monkeypatch.setattr(nn.Linear, "forward", forward)


class KVWatch:
    """Wraps the runner's DecodeGraphs.run: around every graph step, the cache slots
    that changed must be the real rows' slots or the scratch block's, and no real row
    may use the scratch block."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.executor.runner
        self.graphs = self.runner.decode_graphs
        self.inner = self.graphs.run
        self.graphs.run = self.run
        self.scratch = self.runner.scratch_block
        self.padded_steps = 0
        self.fixed_steps = 0  # steps whose input ids came from the chained step before
        assert self.scratch == llm.engine.kv_cache_manager.num_blocks  # the pool's ids end below it

    def run(self, input_ids, positions, slots, seq_lens, tables, fix=None, sample=None):
        bs = self.runner.block_size
        assert all(b < self.scratch for t in tables for b in t)
        assert all(s // bs < self.scratch for s in slots)
        before = [c.clone() for c in self.runner.kv_caches]
        hidden = self.inner(input_ids, positions, slots, seq_lens, tables, fix=fix, sample=sample)
        if fix is not None:
            self.fixed_steps += 1
        changed = set()
        for old, new in zip(before, self.runner.kv_caches):
            diff = (old != new).any(dim=4).any(dim=1).any(dim=0).flatten()  # [blocks * block_size]
            changed |= set(torch.nonzero(diff).flatten().tolist())
        allowed = set(slots) | set(range(self.scratch * bs, (self.scratch + 1) * bs))
        assert changed <= allowed, sorted(changed - allowed)
        if self.graphs.padded_size(len(input_ids)) > len(input_ids):
            self.padded_steps += 1
        return hidden


def make_llm(graphs: bool, **settings) -> LLM:
    settings = {"device": "cpu", "num_gpu_blocks_override": 256, "max_model_len": 256, **settings}
    llm = LLM(model=str(fixture_path("tiny-llama")), **settings)
    if graphs:
        llm.engine.executor.runner.init_decode_graphs(emulate=True)
    return llm


def run_waves(llm: LLM, waves: dict[int, list[tuple[str, str, SamplingParams]]]) -> dict:
    """Requests added at the given step numbers (prefills arriving mid-run); the final
    (token ids, logprobs, prompt logprobs) of each request, by id."""
    engine = llm.engine
    finished, step = {}, 0
    while step <= max(waves) or engine.has_unfinished_requests():
        for rid, prompt, params in waves.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [(c.token_ids, c.logprobs) for c in out.outputs] + [out.prompt_logprobs]
        step += 1
    return finished


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **kw)


def compare(waves, graph_settings: dict | None = None, **settings) -> tuple[LLM, KVWatch]:
    ref = run_waves(make_llm(False, **settings), waves)
    llm = make_llm(True, **settings, **(graph_settings or {}))
    watch = KVWatch(llm)
    got = run_waves(llm, waves)
    assert got.keys() == ref.keys()
    for rid in ref:
        assert got[rid] == ref[rid], rid
    llm.engine.kv_cache_manager.check_integrity()
    llm.engine.kv_cache_manager.assert_all_free()
    return llm, watch


def test_capture_sizes() -> None:
    assert capture_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert capture_sizes(3) == [1, 2]
    assert capture_sizes(13) == [1, 2, 4, 8]
    assert capture_sizes(4096)[-1] == 512
    assert capture_sizes(128, max_num_batched_tokens=20) == [1, 2, 4, 8, 16]  # no step holds more rows


def test_the_capture_warm_up_runs_padding_rows_into_the_scratch_block_only() -> None:
    """Capture's warm-up (every size, no real row) on the emulated graphs: each forward
    runs, and of the KV cache only the scratch block changes (the same step on CUDA
    failed on an empty block-table list before a capture could start)."""
    llm = make_llm(True, max_num_seqs=16)
    runner = llm.engine.executor.runner
    graphs = runner.decode_graphs
    scratch = graphs.scratch_block
    for cache in runner.kv_caches:
        cache.normal_()
    before = [c.clone() for c in runner.kv_caches]
    graphs.warm_up(reversed(graphs.sizes))
    for old, new in zip(before, runner.kv_caches):
        blocks = (old != new).transpose(0, 2).flatten(1).any(dim=1)  # [blocks]
        assert torch.nonzero(blocks).flatten().tolist() == [scratch]


def test_cpu_and_enforce_eager_run_without_graphs() -> None:
    """Graphs are captured only on CUDA; the cache always has the scratch block."""
    for settings in ({}, {"enforce_eager": True}):
        llm = make_llm(False, num_gpu_blocks_override=32, **settings)
        runner = llm.engine.executor.runner
        assert runner.decode_graphs is None
        assert runner.kv_caches[0].shape[2] == 33 and runner.scratch_block == 32


@pytest.mark.parametrize("batch", [3, 5, 13])
def test_emulated_graphs_match_eager(batch_invariant_linear, batch: int) -> None:
    """`batch` requests at once (padded to 4, 8, 16), finishing at different lengths,
    with more arriving mid-run (their prefill steps run eagerly), one asking for prompt
    logprobs and one sampling with a seed."""
    waves = {0: [(f"a{i}", PROMPTS[i], greedy(6 + 3 * i)) for i in range(batch)],
             5: [("late", TEXT, greedy(9, prompt_logprobs=2)),
                 ("seeded", "import sys", SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=2))],
             9: [("last", PROMPTS[-1], greedy(5))]}
    llm, watch = compare(waves)
    graphs = llm.engine.executor.runner.decode_graphs
    assert watch.padded_steps > 0
    assert graphs.num_replays > 0
    assert any(size > 2 for size in graphs.padded_sizes)
    scratch = torch.stack([c[:, :, watch.scratch] for c in llm.engine.executor.runner.kv_caches])
    assert scratch.abs().sum() > 0  # padded rows did write, into the scratch block


def test_emulated_graphs_with_preemption(batch_invariant_linear) -> None:
    prompts = [TEXT * 2, "import sys", TEXT, "class A:", "for x in y:", TEXT[:30]]
    waves = {0: [(f"p{i}", p, greedy(40)) for i, p in enumerate(prompts)]}
    llm, watch = compare(waves, num_gpu_blocks_override=10, max_model_len=160)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert watch.padded_steps > 0


def test_emulated_graphs_with_prefix_caching(batch_invariant_linear) -> None:
    shared = TEXT * 3
    waves = {0: [(f"s{i}", shared + PROMPTS[i], greedy(8 + 2 * i)) for i in range(3)],
             4: [(f"t{i}", shared + PROMPTS[i + 3], greedy(10)) for i in range(4)]}
    llm, watch = compare(waves)
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert watch.padded_steps > 0


def test_emulated_graphs_with_ngram_speculation(batch_invariant_linear) -> None:
    """Steps verifying drafts run eagerly, the others replay; the tokens are the same."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    waves = {0: [(f"n{i}", TEXT * 2 if i % 2 else PROMPTS[i], greedy(24)) for i in range(5)]}
    llm, _ = compare(waves, speculative_config=spec)
    assert llm.engine.executor.runner.decode_graphs.num_replays > 0


def test_emulated_graphs_with_chained_async_steps(batch_invariant_linear) -> None:
    """Async scheduling chains steps: a graph step's input ids for rows whose token the
    step before sampled are written on the device after the copy in."""
    waves = {0: [(f"c{i}", PROMPTS[i], greedy(10 + 2 * i)) for i in range(5)],
             6: [("late", TEXT, greedy(7))]}
    llm, watch = compare(waves, graph_settings={"async_scheduling": True})
    assert watch.fixed_steps > 0 and watch.padded_steps > 0
    llm.engine.shutdown()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graphs_match_eager_bf16() -> None:
    """Real graphs against enforce_eager, Triton backend, bf16: the same greedy tokens
    (contexts stay under one decode split, where both paths do the same arithmetic)."""
    settings = dict(model=str(fixture_path("tiny-llama")), device="cuda", dtype="bfloat16",
                    attention_backend="triton", num_gpu_blocks_override=256, max_model_len=256, max_num_seqs=16)
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(13)]
    outs = {}
    for eager in (True, False):
        llm = LLM(enforce_eager=eager, **settings)
        runner = llm.engine.executor.runner
        assert (runner.decode_graphs is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:13], params)]
        if not eager:
            graphs = runner.decode_graphs
            assert graphs.sizes == [1, 2, 4, 8, 16] and set(graphs.graphs) == set(graphs.sizes)
            assert graphs.num_replays > 0 and 16 in graphs.padded_sizes
        llm.engine.shutdown()
    assert outs[False] == outs[True]


@cuda
def test_torch_backend_on_cuda_runs_eagerly(caplog) -> None:
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(fixture_path("tiny-llama")), device="cuda", attention_backend="torch",
                  num_gpu_blocks_override=64, max_model_len=128)
    assert llm.engine.executor.runner.decode_graphs is None
    assert "CUDA graphs off" in caplog.text
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_failed_capture_frees_and_runs_eagerly(monkeypatch, caplog) -> None:
    """A capture that raises (out of memory, say) is released, logged with its cause,
    and the runner keeps decode_graphs None. The CUDA calls around it are stubbed so
    the handling runs on CPU."""
    from llmd.gpu.worker import cuda_graphs

    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    released = []

    def capture(self):
        self.graphs[1] = object()  # something made before the failure
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", capture)
    real_release = cuda_graphs.DecodeGraphs.release
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "release", lambda self: (released.append(dict(self.graphs)),
                                                                          real_release(self)))
    llm = make_llm(False, num_gpu_blocks_override=32)
    runner = llm.engine.executor.runner
    with caplog.at_level("WARNING", logger="llmd.cuda_graphs"):
        runner.init_decode_graphs()
    assert runner.decode_graphs is None
    assert released and 1 in released[0]
    assert "CUDA graph capture failed (OutOfMemoryError: CUDA out of memory" in caplog.text
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
