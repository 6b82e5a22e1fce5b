"""Speculative decoding, the scheduler's side: the n-gram (prompt lookup) proposer and
the acceptance counters. No torch: the worker verifies the drafts (rejection_sampler)."""
from __future__ import annotations

import msgspec
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Drafts for a request from its own tokens (prompt + output): find the last n
    tokens (n = max ... min) earlier in the sequence and propose the k tokens that
    followed that occurrence.

    The most recent occurrence wins. An editor that asks for a rewrite of code it has
    just shown the model is reproducing the latest copy of that text (with its own
    small edits); older occurrences are more often boilerplate that continued
    differently, so the latest match is the one most likely to be continued verbatim.
    """

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k = k
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        total = len(token_ids)
        if k <= 0 or total < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            # Windows that start at 0 .. total-n-1: every earlier occurrence, never the
            # suffix itself (it would "match" with nothing after it).
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []


class SpecDecodeStats(msgspec.Struct):
    """Drafted and accepted tokens since start; accepted_per_position[i] counts steps in
    which draft i+1 was accepted (so the acceptance rate falls with position)."""

    num_drafts: int = 0  # steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying step: accepted drafts plus the one sampled token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
