"""Which decode-graph steps sample inside the graph, and the per-row parameters they
stage (graph_sampler holds what the graph computes with them).

A step samples in the graph when every row that samples needs only what a tail does:
no logprobs, no per-request seed on a random row (its draws must depend on its seed and
position alone), no grammar bitmask, min_tokens with at most NUM_STOP_IDS stop ids, no
drafts to verify. Otherwise the step keeps today's path: the forward graph, then the LM
head and the eager sampler. Rows that do not sample this step (a one-token chunk of a
prompt) get neutral parameters and their tokens are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.gpu.sample.graph_sampler import FLOAT_FIELDS, GREEDY, INT_FIELDS, NUM_STOP_IDS, PENALIZED, SAMPLE, RowParams
from llmd.gpu.worker.runner_types import StepHandle, RunnerRequest
from llmd.gpu.sample.metadata import SAMPLING_EPS
from llmd.core.step_messages import SchedulerOutput
from llmd_client.protocol import SamplingParams

@dataclass
class SampledRow:
    """A row that samples in the graph."""

    row: int
    req: RunnerRequest
    num_output: int  # output tokens before this step, a token still on the device included
    in_flight: int | None  # index of the request's last token in the pending step's tokens, or None
    stop_ids: tuple[int, ...]  # min_tokens: ids masked while num_output < min_tokens; () when none pending

    @property
    def params(self) -> SamplingParams:
        return self.req.sampling_params

    @property
    def greedy(self) -> bool:
        return self.params.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass
class GraphSamplingPlan:
    """One step's tail: its variant and the rows that sample (the others are neutral)."""

    variant: str
    rows: list[SampledRow]
    vocab: int  # the sampled vocab: top-k "off" is top_k = vocab
    in_flight: torch.Tensor | None  # the pending step's tokens on the device (StepHandle.sampled)

    def stage(self, params: RowParams) -> None:
        """Write every row's parameters (neutral where a row does not sample, padding
        included) into `params`, views of the pinned staging buffer."""
        params.fill_neutral(self.vocab)
        if not self.rows:
            return
        ints, floats = params.ints.numpy(), params.floats.numpy()
        at = np.fromiter((r.row for r in self.rows), dtype=np.int64, count=len(self.rows))
        for name, column in self._int_columns().items():
            ints[INT_FIELDS.index(name), at] = column
        stops = [(r.stop_ids * NUM_STOP_IDS)[:NUM_STOP_IDS] if r.stop_ids else (0,) * NUM_STOP_IDS for r in self.rows]
        ints[len(INT_FIELDS):, at] = np.asarray(stops, dtype=np.int64).T
        for name, column in self._float_columns().items():
            floats[FLOAT_FIELDS.index(name), at] = column

    def _int_columns(self) -> dict[str, list[int]]:
        penalized = self.variant == PENALIZED
        return dict(
            top_k=[r.params.top_k if not r.greedy and 0 < r.params.top_k < self.vocab else self.vocab
                   for r in self.rows],
            num_output=[r.num_output for r in self.rows],
            min_tokens_until=[r.params.min_tokens if r.stop_ids else 0 for r in self.rows],
            count_weight=[int(penalized and r.penalized) for r in self.rows],
            is_greedy=[int(r.greedy) for r in self.rows])

    def _float_columns(self) -> dict[str, list[float]]:
        """The eager sampler's values: filters neutral on greedy rows, penalties as asked."""
        random = [not r.greedy for r in self.rows]
        return dict(
            temperature=[r.params.temperature if x else 1.0 for r, x in zip(self.rows, random)],
            top_p=[r.params.top_p if x else 1.0 for r, x in zip(self.rows, random)],
            min_p=[r.params.min_p if x else 0.0 for r, x in zip(self.rows, random)],
            repetition_penalty=[r.params.repetition_penalty for r in self.rows],
            frequency_penalty=[r.params.frequency_penalty for r in self.rows],
            presence_penalty=[r.params.presence_penalty for r in self.rows])


def plan_graph_sampling(so: SchedulerOutput, decodes: list[RunnerRequest], chain: StepHandle | None,
                        eos_token_id: int | None, vocab: int) -> GraphSamplingPlan | None:
    """The tail a step of `decodes` (all plain decode rows, in row order) samples with,
    or None when a row that samples needs the eager sampler."""
    if so.grammar_req_ids or so.scheduled_spec_decode_tokens:
        return None
    in_flight = chain.row_of if chain is not None else {}
    rows = []
    for i, req in enumerate(decodes):
        if req.num_computed_tokens + 1 < len(req.token_ids):
            continue  # a prompt chunk of one token: it samples nothing
        p = req.sampling_params
        if p.logprobs is not None or (p.seed is not None and p.temperature >= SAMPLING_EPS):
            return None
        src = in_flight.get(req.req_id)
        num_output = len(req.token_ids) - req.num_prompt_tokens + (src is not None)
        stop_ids = _pending_stop_ids(p, num_output, eos_token_id, vocab)
        if len(stop_ids) > NUM_STOP_IDS:
            return None
        rows.append(SampledRow(i, req, num_output, src, stop_ids))
    if any(r.penalized for r in rows):
        variant = PENALIZED
    elif all(r.greedy and not r.stop_ids for r in rows):
        variant = GREEDY
    else:
        variant = SAMPLE
    return GraphSamplingPlan(variant, rows, vocab, chain.sampled if chain is not None and rows else None)


def _pending_stop_ids(p: SamplingParams, num_output: int, eos_token_id: int | None, vocab: int) -> tuple[int, ...]:
    """The ids min_tokens masks now (the eager sampler's: EOS unless ignored, and the stop
    ids, within the vocab), or () when the row has its min_tokens already."""
    if p.min_tokens <= num_output:
        return ()
    ids = set(p.stop_token_ids or ())
    if eos_token_id is not None and not p.ignore_eos:
        ids.add(eos_token_id)
    return tuple(sorted(t for t in ids if t < vocab))
