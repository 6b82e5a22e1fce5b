"""The penalty tables a decode graph's PENALIZED tail reads: per graph row, the prompt's
tokens (repetition penalty) and the output's token counts (all three penalties), kept
on the device between steps.

How they stay current, and why: the tail adds each sampled token to its row's counts in
the graph (one scatter of b elements), so while a request keeps its row nothing crosses
to the device. The host remembers which request each row holds and how many of its
output tokens the row has counted; a row whose request or count differs (the batch
changed, the row's last step sampled eagerly or without the penalties) is rebuilt before
the replay from the request's tokens (one zero fill and one scatter over all rebuilt
rows, plus its token still on the device when a pending step sampled it). The eager
sampler instead rebuilds [rows, vocab] tables from every row's whole history each step;
here a steady batch costs nothing and a change costs the changed rows' tokens.
Rows of requests without penalties are left as they are: their neutral parameters make
the tables' values irrelevant.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class PenaltyRow(Protocol):
    """What the tables read of a row's request (the runner's RunnerRequest has it)."""

    req_id: str
    token_ids: list[int]  # the prompt's, then the output's
    num_prompt_tokens: int


class PenaltyTables:
    """[max_batch, vocab] prompt presence (bool) and output counts (float32, as the eager
    sampler's), and which request's tokens each row holds."""

    def __init__(self, max_batch: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(max_batch, vocab, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(max_batch, vocab, dtype=torch.bool, device=device)
        self._held: list[tuple[str, int] | None] = [None] * max_batch  # (req_id, output tokens counted)

    def refresh(self, rows: Sequence[tuple[int, PenaltyRow, int | None]], in_flight: torch.Tensor | None) -> None:
        """Make rows hold their request's tokens: `rows` are (row, request, index of its
        last token in `in_flight`, the earlier pending step's tokens on the device, or None
        when the host has all of them). Only rows whose table is stale are rebuilt."""
        stale, new_owner = [], []
        for row, req, src in rows:
            counted = len(req.token_ids) - req.num_prompt_tokens + (src is not None)
            held = self._held[row]
            if held != (req.req_id, counted):
                stale.append((row, req, src))
                new_owner.append(held is None or held[0] != req.req_id)
                self._held[row] = (req.req_id, counted)
        if not stale:
            return
        self._rebuild_counts(stale, in_flight)
        owners = [(row, req) for (row, req, _), new in zip(stale, new_owner) if new]
        if owners:
            index = self._index([row for row, _ in owners])
            self.prompt_mask.index_fill_(0, index, False)
            flat = self._flat([row for row, _ in owners], [r.token_ids[:r.num_prompt_tokens] for _, r in owners])
            self.prompt_mask.view(-1).index_fill_(0, flat, True)

    def _rebuild_counts(self, stale: list[tuple[int, PenaltyRow, int | None]],
                        in_flight: torch.Tensor | None) -> None:
        self.counts.index_fill_(0, self._index([row for row, _, _ in stale]), 0.0)
        flat = self._flat([row for row, _, _ in stale], [r.token_ids[r.num_prompt_tokens:] for _, r, _ in stale])
        self.counts.view(-1).index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=self.device))
        pending = [(row, src) for row, _, src in stale if src is not None]
        if pending:
            tokens = in_flight.index_select(0, self._index([src for _, src in pending]))
            self.counts.index_put_((self._index([row for row, _ in pending]), tokens),
                                   torch.ones(len(pending), dtype=torch.float32, device=self.device),
                                   accumulate=True)

    def sampled(self, rows: Sequence[tuple[int, str]]) -> None:
        """The tail counted one more token on each of `rows` (row, req_id)."""
        for row, req_id in rows:
            held = self._held[row]
            self._held[row] = (req_id, held[1] + 1)

    # Host lists go to the device without waiting for it: a non-blocking copy from pageable
    # memory is staged at once (a blocking .to() would also wait for the stream).
    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _flat(self, rows: list[int], token_lists: list[Sequence[int]]) -> torch.Tensor:
        """Flat indices row * vocab + token of every in-vocab token of each row's list."""
        lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
        tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
        flat = np.repeat(np.asarray(rows, dtype=np.int64), lengths) * self.vocab + tokens
        return torch.from_numpy(flat[(tokens >= 0) & (tokens < self.vocab)]).to(self.device, non_blocking=True)
