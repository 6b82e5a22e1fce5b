"""The worker's persistent batch (issue 26): rows of a block table kept across steps and
updated by the scheduler's diff, and sampling metadata advanced instead of rebuilt while
the batch is steady. Each is checked against the plain computation it replaces: decode
rows from each request's own block list, and SamplingMetadata.build from each row's
prompt and output."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmd.core.step_messages import CachedRequestData, NewRequestData, SchedulerOutput
from llmd.gpu.layers.attention import GatherWorkspace, MetadataBuilder, TorchMetadataBuilder
from llmd.gpu.sample.metadata import SamplingMetadata
from llmd.gpu.sample.sampler import Sampler
from llmd.gpu.worker.input_batch import InputBatch
from llmd.gpu.worker.runner_types import RunnerSettings
from llmd.gpu.worker.sampling_step import SamplingStep
from llmd_client.protocol import SamplingParams

BS = 4
CPU = torch.device("cpu")


def _reference_rows(blocks_of: dict[str, list[int]], decodes) -> tuple[list, list, list, list]:
    """slots, seq_lens, positions and tables of decode rows, from each request's list."""
    slots, seq_lens, positions, tables = [], [], [], []
    for req in decodes:
        pos = req.num_computed_tokens
        block_ids = blocks_of[req.req_id]
        slots.append(block_ids[pos // BS] * BS + pos % BS)
        seq_lens.append(pos + 1)
        positions.append(pos)
        tables.append(block_ids[:pos // BS + 1])
    return slots, seq_lens, positions, tables


def test_decode_rows_follow_every_diff():
    """Random arrivals, finishes, resumptions and new blocks over 300 steps: every step's
    decode rows equal those computed from the requests' own block lists, whatever rows
    the requests were given and however the table grew."""
    rng = random.Random(0)
    batch = InputBatch(BS, CPU, GatherWorkspace(), TorchMetadataBuilder(BS, True, set()))
    next_block, live, serial = 0, {}, 0
    for step in range(300):
        new, finished = [], []
        for req_id in list(live):
            if rng.random() < 0.05:
                finished.append(req_id)
                del live[req_id]
        for _ in range(rng.randint(0, 3)):
            serial += 1
            req_id = f"r{serial}" if rng.random() < 0.9 or not finished else finished.pop()  # some resume
            length = rng.randint(1, 60)
            blocks = list(range(next_block, next_block + -(-(length + 1) // BS)))
            next_block += len(blocks)
            live[req_id] = [length, blocks]
            new.append(NewRequestData(req_id, list(range(length)), [], SamplingParams(), blocks, length - 1))
        cached_ids, cached_blocks, cached_computed = [], [], []
        for req_id, (length, blocks) in live.items():
            if any(n.req_id == req_id for n in new):
                continue
            grown = []
            while len(blocks) * BS < length + 1:
                grown.append(next_block)
                blocks.append(next_block)
                next_block += 1
            cached_ids.append(req_id)
            cached_blocks.append(grown)
            cached_computed.append(length - 1)  # all but the last sampled token
        so = SchedulerOutput(new, CachedRequestData(cached_ids, cached_blocks, cached_computed),
                             {r: 1 for r in live}, len(live), finished)
        batch.apply(so)
        rows = batch.prepare(so, None)
        slots, seq_lens, positions, tables = _reference_rows({r: b for r, (_, b) in live.items()}, rows.decodes)
        assert rows.slots.tolist() == slots and rows.seq_lens.tolist() == seq_lens
        assert rows.positions.tolist() == positions
        for got, want in zip(rows.tables.tolist(), tables):
            assert got[:len(want)] == want
        assert rows.input_ids.tolist() == [r.token_ids[r.num_computed_tokens] for r in rows.decodes]
        assert sorted(r.row for r in batch.requests.values()) == sorted({r.row for r in batch.requests.values()})
        for req_id in live:  # the step computed one token, the scheduler appends the sampled one
            req = batch.requests[req_id]
            req.num_computed_tokens += 1
            req.token_ids.append(step)
            live[req_id][0] += 1
        if live:
            _, _, md = batch.eager_inputs(rows)
            assert md.decode_block_table.shape[0] == len(rows.decodes)
            assert md.decode_mask is not None


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    if kind == 0:
        return SamplingParams(temperature=0.0)
    if kind == 1:
        return SamplingParams(temperature=0.9, top_k=5, seed=rng.randrange(100))
    if kind == 2:
        return SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                              min_tokens=rng.randrange(6), stop_token_ids=[3])
    return SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, logprobs=2)


FIELDS = ["temperature", "top_k", "top_p", "log_min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "prompt_mask", "output_counts"]


def _same(a: SamplingMetadata, b: SamplingMetadata, params: list[SamplingParams]) -> None:
    # Output counts matter on penalized rows only (a build counts no other row; an
    # advanced one counts every row's tokens, which neutral penalties then ignore).
    penalized = torch.tensor([p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                              for p in params])
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if name == "output_counts" and x is not None:
            x, y = x[penalized], y[penalized]
        if x is not None:
            assert torch.equal(x, y), name
    assert a.num_output_tokens == b.num_output_tokens and a.seeded_rows == b.seeded_rows
    assert a.all_greedy == b.all_greedy and a.max_num_logprobs == b.max_num_logprobs
    assert a.min_tokens_pending == b.min_tokens_pending


@pytest.mark.parametrize("seed", range(3))
def test_advanced_metadata_equals_a_fresh_build(seed):
    """Steps of a batch whose rows sometimes change: the metadata the sampling step uses
    (advanced by the last step's tokens while the rows stay, rebuilt when they change)
    equals SamplingMetadata.build from the rows' prompts and outputs, every step."""
    rng = random.Random(seed)
    vocab = 50
    settings = RunnerSettings(block_size=BS, max_model_len=512, valid_vocab_size=vocab, eos_token_id=2, seed=0)
    sampling = SamplingStep(None, Sampler(seed=0), settings, None)
    batch = InputBatch(BS, CPU, GatherWorkspace(), MetadataBuilder())
    reqs = []
    built = reused = 0
    for step in range(40):
        if step == 0 or rng.random() < 0.15:  # the batch changes: a request comes or goes
            if reqs and rng.random() < 0.5:
                reqs.pop(rng.randrange(len(reqs)))
            else:
                n = len(batch.requests)
                new = NewRequestData(f"q{n}", [rng.randrange(vocab) for _ in range(rng.randint(1, 9))], [],
                                     _params(rng), [n], 0)
                batch.apply(SchedulerOutput([new], CachedRequestData([], [], []), {}, 0, []))
                reqs.append(batch.requests[new.req_id])
        so = SchedulerOutput([], CachedRequestData([], [], []), {r.req_id: 1 for r in reqs}, len(reqs), [])
        before = sampling._last
        md = sampling._metadata(so, reqs, CPU)
        if before is not None and before.md is md:
            reused += 1
        else:
            built += 1
        fresh = SamplingMetadata.build([r.sampling_params for r in reqs],
                                       [r.token_ids[:r.num_prompt_tokens] for r in reqs],
                                       [r.output_token_ids for r in reqs], valid_vocab_size=vocab,
                                       eos_token_id=2, device=CPU)
        _same(md, fresh, [r.sampling_params for r in reqs])
        tokens = [rng.randrange(vocab) for _ in reqs]
        sampling._last.sampled = torch.tensor(tokens)
        for req, token in zip(reqs, tokens):
            req.token_ids.append(token)
    assert reused > 20 and built > 2  # both ways were taken


def test_a_step_sampled_elsewhere_is_not_counted_twice():
    """A step between two eager ones whose tokens the eager sampler never saw (a graph
    step's): the rows are each two tokens further, and the metadata is rebuilt."""
    settings = RunnerSettings(block_size=BS, max_model_len=64, valid_vocab_size=20, eos_token_id=None, seed=0)
    sampling = SamplingStep(None, Sampler(seed=0), settings, None)
    batch = InputBatch(BS, CPU, GatherWorkspace(), MetadataBuilder())
    params = SamplingParams(temperature=0.5, frequency_penalty=1.0)
    batch.apply(SchedulerOutput([NewRequestData("a", [1, 2], [], params, [0], 0)],
                                CachedRequestData([], [], []), {}, 0, []))
    req = batch.requests["a"]
    so = SchedulerOutput([], CachedRequestData([], [], []), {"a": 1}, 1, [])
    first = sampling._metadata(so, [req], CPU)
    sampling._last.sampled = torch.tensor([5])
    req.token_ids += [5, 6]  # the eager step's token, then a graph step's
    second = sampling._metadata(so, [req], CPU)
    assert second is not first
    assert second.output_counts[0].tolist() == np.bincount([5, 6], minlength=20).astype(float).tolist()
