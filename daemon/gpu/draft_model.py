"""Draft-model speculation, the worker's side: a small model sharing the target's
vocabulary proposes up to k tokens per request after each step, from its own paged KV
cache.

The draft's cache has as many blocks as the target's and is addressed through the same
block tables and slot mapping, so the scheduler's allocation serves both models. Every
step the draft runs the target's forward over the step's tokens, so its cache holds
every computed token, drafts under verification included (rejected ones are overwritten
later, exactly as in the target's cache). After sampling, for each request the scheduler
named in `draft_max_num_tokens`, it decodes from the token just emitted, all such
requests batched. Those decode steps write K/V at positions past the request's known
tokens: the scheduler reserved the slots (allocate_slots' num_lookahead_tokens), and a
position outside the request's blocks raises instead of writing anywhere.

Each draft is chosen as the target would choose at that position: the same
SamplingMetadata (penalties, min_tokens, temperature, top-k / top-p / min-p, the seeded
position), the argmax on greedy rows, a draw on random rows. For random rows the draft's
distribution q is kept here, by request, for the next step's rejection sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.gpu.attention import (AttentionMetadata, GatherWorkspace, model_kv_bytes_per_block,
                                new_model_kv_caches, set_decode_rows)
from llmd.gpu.loader import load_model
from llmd.gpu.runner_types import RunnerRequest, RunnerSettings
from llmd.gpu.sampler import SAMPLING_EPS, Sampler, SamplingMetadata

# Seeded rows draw their drafts from a stream apart from the target's sampling and
# acceptance draws at the same position: rejection sampling needs them independent.
DRAFT_SALT = 0xD2AF_7ED0_5EED_0001


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), vocab_limit]: q per draft; None on greedy requests


class DraftModel:
    def __init__(self, settings: RunnerSettings, device: torch.device, dtype: torch.dtype,
                 attention_backend: str, sampler: Sampler, workspace: GatherWorkspace) -> None:
        self.settings = settings
        self.device = device
        self.dtype = dtype
        self.k = settings.num_speculative_tokens
        self.attention_backend = attention_backend
        self.model = load_model(settings.draft_model, dtype, device, settings.max_model_len,
                                attention_backend=attention_backend)
        self.sampler = sampler
        self.workspace = workspace
        self.kv_caches: list[torch.Tensor] = []
        self.proposals: dict[str, Proposal] = {}

    # -- KV cache (same blocks and block ids as the target's) ---------------------------
    def kv_cache_bytes_per_block(self) -> int:
        return model_kv_bytes_per_block(self.model, self.settings.block_size, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = new_model_kv_caches(self.model, num_blocks, self.settings.block_size, self.dtype,
                                             self.device)

    # -- each step ------------------------------------------------------------------------
    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.proposals.pop(req_id, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """The target's forward over the step's tokens: fills the draft's cache."""
        self.model(input_ids, positions, self.kv_caches, md)

    def take_probs(self, req_ids: list[str], drafts: list[list[int]], tails: list[int | None],
                   num_rows: int, width: int) -> torch.Tensor:
        """q for the verify rows (see rejection_sampler.verify: request j owns
        len(drafts[j]) + 1 rows), zero where no draft is tested or the request is greedy."""
        q = torch.zeros(num_rows, width, dtype=torch.float32, device=self.device)
        row = 0
        for req_id, d, tail in zip(req_ids, drafts, tails):
            tested = d + ([] if tail is None else [tail])
            proposal = self.proposals.get(req_id)
            if tested:
                if proposal is None or proposal.token_ids[:len(tested)] != tested:
                    raise RuntimeError(f"request {req_id}: drafts to verify {tested} are not the draft "
                                       "model's proposal")
                if proposal.probs is not None:
                    q[row:row + len(tested)] = proposal.probs[:len(tested)]
            row += len(d) + 1
        return q

    @torch.inference_mode()
    def propose(self, reqs: list[RunnerRequest], limits: dict[str, int]) -> dict[str, list[int]]:
        """Drafts for each request in `limits` (its token_ids end with the token just
        emitted): min(k, limit - known tokens) of them, decoded one position at a time,
        all requests batched. Keeps each proposal (with q) for the next step."""
        todo = [(r, min(self.k, limits[r.req_id] - len(r.token_ids))) for r in reqs if r.req_id in limits]
        todo = [(r, n) for r, n in todo if n > 0]
        drafts: dict[str, list[int]] = {r.req_id: [] for r, _ in todo}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r, _ in todo}
        md = tokens = None
        for j in range(max((n for _, n in todo), default=0)):
            rows = [r for r, n in todo if n > j]
            if md is None or len(rows) < md.num_rows:  # first step, or a request reached its limit
                md = SamplingMetadata.build(
                    [r.sampling_params for r in rows], [r.token_ids[:r.num_prompt_tokens] for r in rows],
                    [r.output_token_ids + drafts[r.req_id] for r in rows],
                    valid_vocab_size=self.settings.valid_vocab_size, eos_token_id=self.settings.eos_token_id,
                    device=self.device)
                md.max_num_logprobs = None
            else:
                md.append_sampled(tokens)
            logits = self._decode(rows, [drafts[r.req_id][-1] if j else r.token_ids[-1] for r in rows], j)
            logits, _ = self.sampler.prepare(self.sampler.mask(logits, md), md)
            tokens, q = self.sampler.sample(logits, md, keep_probs=True, salt=DRAFT_SALT)
            for i, (r, t) in enumerate(zip(rows, tokens.tolist())):
                drafts[r.req_id].append(t)
                if q is not None and r.sampling_params.temperature >= SAMPLING_EPS:
                    probs[r.req_id].append(q[i])
        for r, _ in todo:
            rows_q = probs[r.req_id]
            self.proposals[r.req_id] = Proposal(drafts[r.req_id], torch.stack(rows_q) if rows_q else None)
        return drafts

    def _decode(self, reqs: list[RunnerRequest], input_ids: list[int], j: int) -> torch.Tensor:
        """One draft decode step: request i's input_ids[i] at position len(token_ids) - 1 + j.
        Returns the logits [len(reqs), vocab]."""
        bs = self.settings.block_size
        positions, slots, tables = [], [], []
        for r in reqs:
            pos = len(r.token_ids) - 1 + j
            if pos // bs >= len(r.block_ids):
                raise RuntimeError(f"draft position {pos} of request {r.req_id} is past its "
                                   f"{len(r.block_ids)} KV blocks: the scheduler reserved no slot for it")
            positions.append(pos)
            slots.append(r.block_ids[pos // bs] * bs + pos % bs)
            tables.append(r.block_ids[:pos // bs + 1])
        dev = self.device
        md = AttentionMetadata(slot_mapping=torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(dev),
                               num_decodes=len(reqs), decode_block_table=None, decode_seq_lens=None,
                               prefills=[], workspace=self.workspace)
        set_decode_rows(md, tables, [p + 1 for p in positions], bs, dev,
                        mask=self.attention_backend == "torch")
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_caches, md)
        return self.model.compute_logits(hidden)
