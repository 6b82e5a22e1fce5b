"""Speculative decoding as the scheduler plans it, one request at a time: which drafts a
request verifies in a step, whether the worker drafts for it after the step (a draft
model) and how many KV slots those drafts need, and which drafts it takes into its
next step (the n-gram proposer's, or the draft model's, cut by its grammar). No torch:
the worker verifies the drafts (rejection_sampler)."""
from __future__ import annotations

from llmd.config import SpeculativeConfig
from llmd.core.request import Request
from llmd.core.spec_decode import NgramProposer


class DraftPlanner:
    def __init__(self, spec: SpeculativeConfig | None, structured=None) -> None:
        """`structured`: the StructuredOutputManager whose grammars cut guided drafts."""
        self.structured = structured
        self.proposer: NgramProposer | None = None
        # Draft-model speculation: drafts per step, proposed by the worker after sampling.
        self.num_draft_model_tokens = 0
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max)
        elif spec is not None:
            self.num_draft_model_tokens = spec.num_speculative_tokens

    def forget(self, request_id: str) -> None:
        """The request ended: drop what the proposer kept of it."""
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's proposed drafts that fit this step: only in decode (one known
        token to compute), within the token budget, and never more than the request may
        still emit (all accepted drafts plus the token sampled after them)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or num_new != 1 or request.num_computed_tokens + 1 != request.num_tokens:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def drafts_for(self, request: Request, num_computed_after: int) -> bool:
        """Whether the worker drafts for the request after this step (draft model): it
        samples in this step (all its known tokens computed) and speculates."""
        return bool(self.num_draft_model_tokens) and num_computed_after == request.num_tokens \
            and request.speculative

    def lookahead(self, request: Request, end: int) -> int:
        """KV slots to reserve past the `end` tokens this step computes (drafts included)
        for the drafts the worker writes after it: num_draft_model_tokens, but none past
        what the request may still emit. With them the worker may draft up to `end +
        lookahead + 1` tokens: its draft steps write K/V at every drafted position but the
        last, so within the reserved slots (the most is when every draft is accepted and
        drafting starts at position `end`)."""
        last_useful = request.num_prompt_tokens + request.max_tokens - 2
        return min(self.num_draft_model_tokens, max(0, last_useful - end))

    def take_drafts(self, request: Request, model_drafts: list[int]) -> None:
        """The drafts to verify at the request's next step: the n-gram proposer's, or
        those the draft model made in the worker. A guided request's are cut at the first
        token its grammar refuses or that ends it. A draft-model draft is sampled, so
        dropping it for its value would bias what is emitted: the cut-off one stays, as
        the last draft. Its row masks it out if the grammar refuses it (always rejected,
        then), and if it ends the grammar and is accepted the request ends there; either
        way the row after it is never used, and its rows allow every token
        (bitmask_filler)."""
        drafts = model_drafts
        if self.proposer is not None:  # its index of the request's tokens grows by this step's only
            drafts = self.proposer.propose(request.all_token_ids, req_id=request.request_id)
        if drafts and request.grammar is not None:
            valid = self.structured.validate_drafts(request.grammar, drafts)
            drafts = valid if self.proposer is not None else drafts[:len(valid) + 1]
        request.spec_token_ids = drafts
