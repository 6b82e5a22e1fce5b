"""The sampling half of a step: from the hidden states of the rows that sample to the
tokens each request emits, with their logprobs.

Per request one row is sampled, or (verifying k drafts) k + 1 rows go through the
rejection sampler. The sampling metadata is built from the worker's copy of each request
(penalties see its output so far; a grammar's bitmask rows are set). With tensor
parallelism rank 0 samples and broadcasts the tokens, the other ranks take them. On one
rank without a draft model the tokens stay on the device for the next step
(`sample_deferred`, `graph_step`), the host reading them when the step's handle is asked
for its output (StepHandle.output). Prompt logprobs are computed here too, in slices no
wider than a sampling step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.gpu.layers.greedy_head import greedy_head_of
from llmd.gpu.worker.draft_model import DraftModel
from llmd.gpu.sample.graph_sampler import GraphSampler
from llmd.gpu.sample.rejection_sampler import verify
from llmd.gpu.worker.runner_types import RunnerRequest, RunnerSettings, StepHandle, collect_logprobs
from llmd.gpu.sample.metadata import argmax_only
from llmd.gpu.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, gather_logprobs
from llmd.core.step_messages import GrammarRows, Logprobs, PromptLogprobs, RunnerOutput, SchedulerOutput


@dataclass
class _LastMetadata:
    """The metadata the last eager sampling step built, while it may serve the next."""

    req_ids: tuple[str, ...]  # its rows' requests, in row order
    num_outputs: list[int]  # each row's output tokens it counts (in-flight ones included)
    md: SamplingMetadata
    sampled: torch.Tensor | None = None  # [rows] the tokens it sampled, on the device


@dataclass(eq=False)  # compared by identity: it holds the model
class SamplingStep:
    """Samples for the runner holding `model` (its LM head computes the logits); with
    `drafter`, verifies the draft model's proposals against the q it kept."""

    model: torch.nn.Module
    sampler: Sampler
    settings: RunnerSettings
    drafter: DraftModel | None
    rank: int = 0  # tensor-parallel rank: rank 0 samples
    world_size: int = 1
    _last: _LastMetadata | None = None
    _argmax: torch.Tensor | None = None  # the LM head's tokens for this step's rows, all greedy

    def logits(self, hidden: torch.Tensor, rows: list[int], argmax_rows: list[int] | None = None) -> torch.Tensor:
        """The LM head on `rows` of `hidden` only (distinct and ascending); of the logits'
        rows `argmax_rows` (see argmax_rows) only the argmax is good."""
        if len(rows) != hidden.shape[0]:  # not every row samples
            hidden = hidden.index_select(0, _to_device(rows, hidden.device))
        head = greedy_head_of(self.model) if argmax_rows and len(argmax_rows) == len(rows) else None
        if head is not None:
            head.argmax = None  # (set again only by this call)
        logits = self.model.compute_logits(hidden, argmax_rows, self.settings.valid_vocab_size)
        self._argmax = head.argmax if head is not None else None
        return logits

    def _sampled(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """The sampler's tokens, or the LM head's where it found every row's argmax (every
        row greedy with nothing else to read: the sampler would take the same argmax)."""
        tokens, self._argmax = self._argmax, None
        return SamplerOutput(sampled_token_ids=tokens) if tokens is not None else self.sampler(logits, md)

    def argmax_rows(self, reqs: list[RunnerRequest], drafts: list[list[int]]) -> list[int] | None:
        """The rows of a step's logits whose token is their argmax and nothing else of them
        is read: every row of the requests of `reqs` that metadata.argmax_only admits (a
        request has one row, or len(drafts[i]) + 1 while its drafts are verified: a greedy
        row accepts while a draft is its argmax, then emits the argmax); None when none
        or ranks share the vocabulary."""
        if self.world_size > 1:
            return None
        rows, row = [], 0
        for i, req in enumerate(reqs):
            n = len(drafts[i]) + 1 if drafts else 1
            if argmax_only(req.sampling_params):
                rows += range(row, row + n)
            row += n
        return rows or None

    def sample(self, so: SchedulerOutput, grammar: GrammarRows | None, logits: torch.Tensor,
               reqs: list[RunnerRequest], drafts: list[list[int]], out: RunnerOutput) -> list[list[int]]:
        """The tokens each request emits, the same on every tensor-parallel rank: rank 0
        samples (logprobs into `out`; `grammar`: the rows of so.grammar_req_ids) and
        broadcasts them, the others receive them."""
        dev = logits.device
        if self.rank == 0:
            sampled = self._sample(so, grammar, logits, reqs, drafts, out)
            if self.world_size > 1:
                _broadcast_tokens(_pad_rows(sampled, len(reqs), drafts, dev))
            return sampled
        tokens = _pad_rows([], len(reqs), drafts, dev)
        _broadcast_tokens(tokens)
        return [[t for t in row if t >= 0] for row in tokens.tolist()]

    def _sample(self, so: SchedulerOutput, grammar: GrammarRows | None, logits: torch.Tensor,
                reqs: list[RunnerRequest], drafts: list[list[int]], out: RunnerOutput) -> list[list[int]]:
        """One sampled token per request, or (verifying drafts) the accepted drafts and
        one more. Logprobs go into `out`."""
        if so.scheduled_spec_decode_tokens:
            return self._verify(so, grammar, logits, reqs, drafts, out)
        result = self._sampled(logits, self._metadata(so, reqs, logits.device, grammar=grammar))
        self._last.sampled = result.sampled_token_ids
        tokens = [[t] for t in result.sampled_token_ids.tolist()]
        if result.logprobs_token_ids is not None:
            collect_logprobs(out, reqs, [[i] for i in range(len(reqs))], result)
        return tokens

    def _verify(self, so: SchedulerOutput, grammar: GrammarRows | None, logits: torch.Tensor,
                reqs: list[RunnerRequest], drafts: list[list[int]], out: RunnerOutput) -> list[list[int]]:
        """Rejection sampling of each request's drafts: one row per verified position,
        row i of a request sees drafts[:i] as output."""
        dev = logits.device
        settings = self.settings
        params, prompts, outputs, rows_of = [], [], [], {}
        for req, d in zip(reqs, drafts):
            rows_of[req.req_id] = range(len(params), len(params) + len(d) + 1)
            for i in range(len(d) + 1):
                params.append(req.sampling_params)
                prompts.append(req.token_ids[:req.num_prompt_tokens])
                outputs.append(req.output_token_ids + d[:i])
        md = SamplingMetadata.build(params, prompts, outputs, valid_vocab_size=settings.valid_vocab_size,
                                    eos_token_id=settings.eos_token_id, device=dev)
        if so.grammar_req_ids:  # a guided request's bitmask has a row for each of its positions
            md.set_grammar_bitmask([r for rid in so.grammar_req_ids for r in rows_of[rid]],
                                   _rows_of(grammar), dev)
        draft_probs = None  # n-gram drafts: point masses (and greedy rows need no q)
        if self.drafter is not None and not md.all_greedy:
            draft_probs = self.drafter.take_probs([r.req_id for r in reqs], drafts, md.num_rows,
                                                  md.vocab_limit)
        result = verify(self.sampler, logits, md, drafts, draft_probs)
        if result.logprobs_token_ids is not None:
            flat, rows = 0, []
            for ts in result.token_ids:
                rows.append(list(range(flat, flat + len(ts))))
                flat += len(ts)
            collect_logprobs(out, reqs, rows, result)
        return result.token_ids

    def _metadata(self, so: SchedulerOutput, reqs: list[RunnerRequest], dev: torch.device,
                  chain: StepHandle | None = None, grammar: GrammarRows | None = None) -> SamplingMetadata:
        """One sampling row per request (no drafts), grammar rows included. A request
        whose previous token a pending step still holds counts it as output: its length
        through a -1 stand-in (positions for seeds and min_tokens), its value added to the
        penalty counts on the device.

        A steady batch builds nothing: when the rows are the last eager step's requests in
        the same order, each one token further (the one that step sampled), its metadata
        is advanced by those tokens on the device (SamplingMetadata.append_sampled)
        instead of rebuilt from every row's prompt and output."""
        in_flight = chain.row_of if chain is not None else {}
        req_ids = tuple(r.req_id for r in reqs)
        num_outputs = [len(r.token_ids) - r.num_prompt_tokens + (r.req_id in in_flight) for r in reqs]
        last, self._last = self._last, None
        if last is not None and last.sampled is not None and last.req_ids == req_ids \
                and all(now == before + 1 for now, before in zip(num_outputs, last.num_outputs)):
            md = last.md
            md.append_sampled(last.sampled)
            md.grammar_bitmask = None
        else:
            md = self._build_metadata(reqs, dev, chain, in_flight)
        self._last = _LastMetadata(req_ids, num_outputs, md)
        if so.grammar_req_ids:
            row_of = {r.req_id: i for i, r in enumerate(reqs)}
            md.set_grammar_bitmask([row_of[rid] for rid in so.grammar_req_ids], _rows_of(grammar), dev)
        return md

    def _build_metadata(self, reqs: list[RunnerRequest], dev: torch.device, chain: StepHandle | None,
                        in_flight: dict[str, int]) -> SamplingMetadata:
        settings = self.settings
        md = SamplingMetadata.build(
            [r.sampling_params for r in reqs], [r.token_ids[:r.num_prompt_tokens] for r in reqs],
            [r.output_token_ids + [-1] if r.req_id in in_flight else r.output_token_ids for r in reqs],
            valid_vocab_size=settings.valid_vocab_size, eos_token_id=settings.eos_token_id, device=dev)
        rows = [i for i, r in enumerate(reqs) if r.req_id in in_flight]
        if md.output_counts is not None and rows:
            src = _to_device([in_flight[reqs[i].req_id] for i in rows], dev)
            md.output_counts.index_put_((_to_device(rows, dev),
                                         chain.sampled.index_select(0, src)),
                                        torch.ones(len(rows), dtype=md.output_counts.dtype, device=dev),
                                        accumulate=True)
        return md

    # -- tokens left on the device -----------------------------------------------------------
    def sample_deferred(self, so: SchedulerOutput, grammar: GrammarRows | None, logits: torch.Tensor,
                        reqs: list[RunnerRequest], ordered: list[RunnerRequest], out: RunnerOutput,
                        chain: StepHandle | None) -> StepHandle:
        """Sample without reading the tokens back: start their copy to the host and
        return the step's handle, its tokens pending."""
        dev = logits.device
        result = self._sampled(logits, self._metadata(so, reqs, dev, chain, grammar))
        self._last.sampled = result.sampled_token_ids
        host, ready = result, None
        if dev.type == "cuda":
            # Into pinned memory, behind this step's kernels only: the next step's work,
            # queued after, is not waited for.
            host = SamplerOutput(*(t.to("cpu", non_blocking=True) if t is not None else None
                                   for t in (result.sampled_token_ids, result.logprobs_token_ids,
                                             result.logprobs, result.ranks)))
            ready = torch.cuda.Event()
            ready.record()
        return StepHandle(out, ordered, reqs, result.sampled_token_ids, host, ready,
                           {r.req_id: i for i, r in enumerate(reqs)})

    def graph_step(self, out: RunnerOutput, ordered: list[RunnerRequest], reqs: list[RunnerRequest],
                   row_of: dict[str, int], tokens: torch.Tensor, sampler: GraphSampler) -> StepHandle:
        """A step its decode graph sampled: `tokens` [padded batch] on the device, row_of[i]
        the row of reqs[i]'s token. Their copy to pinned memory starts behind this step's
        kernels; the handle's output() waits for that copy (an event, not a blocking
        device-to-host copy) and reads it once."""
        host, ready = sampler.read_back(tokens)
        return StepHandle(out, ordered, reqs, tokens, SamplerOutput(host), ready, row_of)

    # -- prompt logprobs ------------------------------------------------------------------
    def prompt_logprobs(self, hidden: torch.Tensor, req: RunnerRequest, row0: int, first: int,
                        count: int) -> PromptLogprobs:
        """Logprobs of `count` prompt tokens from position first + 1, whose predicting
        rows start at row0 of `hidden`."""
        k = req.sampling_params.prompt_logprobs
        out = Logprobs(token_ids=[], logprobs=[], ranks=[])
        # In slices no wider than the rows a step samples: a chunk's full-vocab logits,
        # their fp32 log-softmax and rank masks would otherwise take ~9 bytes x vocab per
        # prompt token, more than the memory profile (which samples that many rows) saw.
        width = self.settings.max_sampled_rows
        for lo in range(0, count, width):
            n = min(width, count - lo)
            logits = self.model.compute_logits(hidden[row0 + lo:row0 + lo + n])
            logprobs = torch.log_softmax(self._mask_padded_vocab(logits), dim=-1)
            targets = torch.tensor(req.token_ids[first + 1 + lo:first + 1 + lo + n], dtype=torch.int64,
                                   device=logits.device)
            ids, lps, ranks = gather_logprobs(logprobs, targets, k)
            out.token_ids += ids.tolist()
            out.logprobs += lps.tolist()
            out.ranks += ranks.tolist()
        return PromptLogprobs(start=first, logprobs=out)

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        valid = self.settings.valid_vocab_size
        if valid < logits.shape[-1]:
            logits[:, valid:] = float("-inf")
        return logits


def _rows_of(grammar: GrammarRows | None) -> bytes:
    """A guided step's grammar rows, waited for (they were filled beside the forward)."""
    if grammar is None:
        raise RuntimeError("a step with guided requests came without their grammar rows")
    return grammar.wait()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices on `device` without waiting for it: torch.tensor(..., device=cuda)
    copies blocking, which also waits for the stream (and would stall a pending step
    behind the step before it); a non-blocking copy from pageable memory is staged at once."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _pad_rows(tokens: list[list[int]], num_reqs: int, drafts: list[list[int]],
              device: torch.device) -> torch.Tensor:
    """[num_reqs, 1 + most drafts] int64, -1 padded: the same shape on every TP rank."""
    width = 1 + max((len(d) for d in drafts), default=0)
    padded = torch.full((num_reqs, width), -1, dtype=torch.int64)
    for i, row in enumerate(tokens):
        padded[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return padded.to(device, non_blocking=True)


def _broadcast_tokens(tokens: torch.Tensor) -> None:
    """Rank 0's sampled tokens to every tensor-parallel rank (in place on the others).
    NCCL moves only tensors on this rank's CUDA device and gloo here only CPU ones, so a
    tensor elsewhere travels through a copy on the right device."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        home = torch.device("cuda", torch.cuda.current_device())
    else:
        home = torch.device("cpu")
    if tokens.dtype != torch.int64 or not tokens.is_contiguous() or tokens.device != home:
        buf = tokens.to(device=home, dtype=torch.int64).contiguous()
        dist.broadcast(buf, src=0)
        tokens.copy_(buf)
    else:
        dist.broadcast(tokens, src=0)
