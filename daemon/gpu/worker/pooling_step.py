"""The pooling half of a step: embeddings from the final hidden states (after the final
norm, as transformers' `last_hidden_state` and sentence-transformers see them) of the
pooling requests' rows.

A pooling request's prompt may be computed over several steps (chunked prefill), so
each chunk adds to the request's partial state (RunnerRequest.pooled_partial): MEAN
keeps the float32 sum of the hidden states so far, CLS the first token's; LAST needs
only the last row of the final chunk. The step that computes the last prompt token
finishes the vector: the mean (the sum over the prompt's length), then its first
`dimensions` components, then L2 normalisation when asked. Every state starts at the
prompt's first token: the scheduler gives MEAN and CLS requests no prefix-cache hit.

The step's finished vectors are read back to the host together, at once (on CUDA a
sync): pooling steps are prefill steps, whose compute dwarfs one small copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmd.gpu.worker.runner_types import RunnerRequest

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(eq=False)
class PoolingStep:
    """Pools by `pooling_type` ("LAST", "MEAN" or "CLS") for every pooling request."""

    pooling_type: str

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def pool(self, hidden: torch.Tensor, chunks: list[tuple[RunnerRequest, int, int, int]]) -> dict[str, list[float]]:
        """Add each chunk (request, its first row in `hidden`, its first position, its
        token count) to its request's state; the finished vectors of the requests whose
        prompt this step completed, by request id."""
        finished: list[tuple[str, torch.Tensor]] = []
        for req, row0, first, count in chunks:
            pooled = self._add_chunk(req, hidden[row0:row0 + count], first)
            if pooled is not None:
                finished.append((req.req_id, self._finish(req, pooled)))
        if not finished:
            return {}
        flat = torch.cat([v for _, v in finished]).cpu().tolist()  # one read-back for the step
        out: dict[str, list[float]] = {}
        start = 0
        for req_id, vector in finished:
            out[req_id] = flat[start:start + len(vector)]
            start += len(vector)
        return out

    def _add_chunk(self, req: RunnerRequest, rows: torch.Tensor, first: int) -> torch.Tensor | None:
        """The request's pooled hidden state (float32) when this chunk ends its prompt,
        else None (the chunk is kept in its partial state)."""
        if first == 0:
            req.pooled_partial = None
        elif self.pooling_type != "LAST" and req.pooled_partial is None:
            raise RuntimeError(f"pooling request {req.req_id} starts at position {first} with no pooled state "
                               f"({self.pooling_type} pooling needs every position from the first)")
        last = first + len(rows) >= req.num_prompt_tokens
        if self.pooling_type == "LAST":
            return rows[-1].float() if last else None
        if self.pooling_type == "CLS":
            if first == 0:
                req.pooled_partial = rows[0].float().clone()  # kept past this step's buffers
            return req.pooled_partial if last else None
        chunk_sum = rows.float().sum(dim=0)
        req.pooled_partial = chunk_sum if req.pooled_partial is None else req.pooled_partial + chunk_sum
        return req.pooled_partial / req.num_prompt_tokens if last else None

    @staticmethod
    def _finish(req: RunnerRequest, pooled: torch.Tensor) -> torch.Tensor:
        """The request's first `dimensions` components (Matryoshka), L2-normalized if it
        asked."""
        params = req.pooling_params
        req.pooled_partial = None
        if params.dimensions is not None:
            pooled = pooled[:params.dimensions]
        if params.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled
