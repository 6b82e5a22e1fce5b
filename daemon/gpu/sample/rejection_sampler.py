"""Verifying draft tokens (speculative decoding) without changing what is sampled.

A request with k drafts d_1..d_k has k+1 logit rows: row i is the target's distribution
p_i for the position after d_1..d_i (row 0: after the last sampled token). Row i's
sampling parameters see d_1..d_i as generated output (penalties, min_tokens, the seeded
position), so p_i is exactly what plain decoding would sample from there.

Leviathan et al.'s rule: draft d_i, drawn from the draft distribution q_i, is accepted
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn
from normalize(max(p_i - q_i, 0)); if all k are accepted, a bonus token is drawn from
p_k. Each emitted token is then distributed exactly as under p. A draft model gives q
(after the same temperature / top-k / top-p / min-p as the target's rows). N-gram drafts
come without one: q is a point mass on d_i, and the rule reads: accept d_i with
probability p_i(d_i); at the first rejection sample from p_i with d_i removed. Greedy
rows reduce to: accept while d_i is the argmax, then emit the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.gpu.sample.sampler import Sampler, SamplingMetadata, gather_logprobs

# Seeded rows draw their acceptance tests from a stream apart from the sampling noise.
ACCEPT_SALT = 0x5EC0_DEC0_DE5A_17ED


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then one sampled token
    rows: list[list[int]]  # the logit row each of those tokens was chosen at
    # When any row asked for logprobs, over all emitted tokens in order (flattened):
    logprobs_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


def verify(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]],
           draft_probs: torch.Tensor | None = None) -> VerifyOutput:
    """logits/md: one row per position, request j owning len(drafts[j]) + 1 consecutive
    rows in order. draft_probs: None (point-mass drafts) or [rows, md.vocab_limit], row r
    the q of the draft tested at row r (ignored on rows without a draft and on greedy
    rows). Returns what
    each request emits this step."""
    draft_of_row: list[int] = []
    for d in drafts:
        draft_of_row += d + [-1]
    if len(draft_of_row) != md.num_rows:
        raise ValueError(f"{md.num_rows} logit rows for {len(draft_of_row)} verify positions")
    device = logits.device
    draft = torch.tensor(draft_of_row, dtype=torch.int64, device=device)
    has_draft = draft >= 0
    safe_draft = draft.clamp(min=0).view(-1, 1)

    logits, raw_logprobs = sampler.prepare(sampler.mask(logits, md), md)
    greedy = logits.argmax(dim=-1)
    if md.all_greedy:
        accept, recovered = greedy == draft, greedy
    else:
        probs = sampler.filter(logits, md).softmax(dim=-1)
        p_draft = probs.gather(1, safe_draft).squeeze(1)
        if draft_probs is None:  # q: a point mass on the draft
            q_draft = torch.ones_like(p_draft)
            residual = probs.scatter(1, safe_draft, torch.zeros_like(p_draft).view(-1, 1))
        else:
            q_draft = draft_probs.gather(1, safe_draft).squeeze(1)
            residual = (probs - draft_probs).clamp_(min=0.0)
        # u < p/q, written so that q(d) = 0 needs no division (u < 1: min(1, .) is implied).
        accept = sampler.uniform(p_draft, md, salt=ACCEPT_SALT) * q_draft < p_draft
        residual = torch.where(has_draft.view(-1, 1), residual, probs)
        # Guard rounding: a draft that held all the mass leaves nothing to draw from.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        recovered = sampler.race(residual, md)
        if not md.all_random:
            accept = torch.where(md.is_greedy, greedy == draft, accept)
            recovered = torch.where(md.is_greedy, greedy, recovered)
    accept &= has_draft

    accepted = accept.tolist()
    recovered_ids = recovered.tolist()
    out = VerifyOutput(token_ids=[], rows=[])
    row = 0
    for d in drafts:
        n = 0
        while n < len(d) and accepted[row + n]:
            n += 1
        out.token_ids.append(d[:n] + [recovered_ids[row + n]])
        out.rows.append(list(range(row, row + n + 1)))
        row += len(d) + 1
    if raw_logprobs is not None:
        rows = torch.tensor([r for rs in out.rows for r in rs], dtype=torch.int64, device=device)
        tokens = torch.tensor([t for ts in out.token_ids for t in ts], dtype=torch.int64, device=device)
        out.logprobs_token_ids, out.logprobs, out.ranks = gather_logprobs(
            raw_logprobs.index_select(0, rows), tokens, md.max_num_logprobs)
    return out
