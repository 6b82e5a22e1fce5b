"""The inputs of one step, built from the worker's copy of every running request.

The scheduler sends a diff each step (new requests, new blocks, finished ids); `apply`
keeps the copy up to date. `prepare` orders the step's rows decodes first (one new token
each, attended in one batch), then the requests verifying drafts, then prefill chunks,
and builds the decode rows' host inputs. A step whose rows are all decode rows replays a
CUDA graph on those lists (`StepRows.fits_graph`, padding is the graphs' own); any other
step runs eagerly on `eager_inputs`: the flattened ids, positions, slot mapping and
attention metadata. After the forward, `StepRows.advance` moves every request past the
step's tokens and says which rows sample.

A request verifying k drafts computes 1 + k tokens: its last sampled token at position
p, then the drafts at p + 1 .. p + k. It runs as 1 + k decode rows, row i holding token
i at position p + i with seq_len p + i + 1 and the request's block table, rather than
as one prefill row of 1 + k tokens. That is the same attention: every backend (torch,
triton, flash_attn) writes the whole step's K/V through the slot mapping before any row
attends, so row i sees exactly keys 0 .. p + i, its causal prefix, as the prefill row's
query i does (and a sliding-window layer cuts each decode row at seq_len - window, the
prefill query's window). A request's rows are contiguous and in token order, after
the plain decodes and before any prefill chunk (`StepRows.ordered`), so `advance` finds
its 1 + k sampling rows as it did in the prefill row, and a step of decodes and
verifies fits a decode graph. The cost is that each of the 1 + k rows reads the context
again: small next to a decode step's weight reads for the few drafts a step verifies.
Eager steps take the same rows, so a verify step computes the same numbers with or
without graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmd.gpu.layers.attention import AttentionMetadata, GatherWorkspace, set_decode_rows
from llmd.gpu.worker.cuda_graphs import DecodeGraphs
from llmd.gpu.worker.runner_types import PendingStep, RunnerRequest
from llmd.core.step_messages import SchedulerOutput


def to_device(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`. Non-blocking: a plain copy from pageable
    memory would wait for the stream, i.e. for the step before this one (on CUDA the
    host buffer is staged at once, so the temporary may go right after)."""
    return torch.as_tensor(values, dtype=torch.int64).to(device, non_blocking=True)


@dataclass
class SamplePlan:
    """The rows of a step that sample: requests whose known tokens are all computed
    after it (all 1 + k rows of a request verifying k drafts), and the prompt positions
    whose logprobs were asked for."""

    reqs: list[RunnerRequest] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # hidden-state rows whose logits are sampled, ascending
    drafts: list[list[int]] = field(default_factory=list)  # per request in reqs: the drafts it verifies
    prompt_logprobs: list[tuple[RunnerRequest, int, int, int]] = field(default_factory=list)
    """(request, its first row, first position, count) for each prompt-logprobs job."""


@dataclass
class StepRows:
    """One step's rows in order, and the decode rows' inputs as host lists (the graph
    path stages them into its own buffers): one row per plain decode, then 1 + k rows per
    request verifying k drafts."""

    decodes: list[RunnerRequest]
    prefills: list[tuple[RunnerRequest, int]]  # request, tokens it computes this step
    verifies: list[tuple[RunnerRequest, int]] = field(default_factory=list)  # request, 1 + its drafts
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    fix: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, ids on the device): decode rows whose input token a chained step before
    this one sampled and the host does not have yet."""

    @property
    def ordered(self) -> list[tuple[RunnerRequest, int]]:
        return [(r, 1) for r in self.decodes] + self.verifies + self.prefills

    @property
    def num_decode_rows(self) -> int:
        return len(self.input_ids)

    def fits_graph(self, graphs: DecodeGraphs | None) -> bool:
        """A step replays a graph when every row is a decode row (plain decodes and
        verify rows; no prefill chunk, no prompt logprobs to compute) and they fit a
        captured size."""
        if graphs is None or self.prefills or not self.input_ids or len(self.input_ids) > graphs.max_batch:
            return False
        return not any(r.sampling_params.prompt_logprobs is not None
                       and r.num_computed_tokens < r.num_prompt_tokens - 1 for r in self.decodes)

    def advance(self, spec: dict[str, list[int]]) -> SamplePlan:
        """Count this step's tokens as computed for every row's request; the rows that
        sample and the prompt-logprobs jobs (`spec`: the drafts each request verifies)."""
        plan = SamplePlan()
        row = 0
        for req, n in self.ordered:
            s = req.num_computed_tokens
            if req.sampling_params.prompt_logprobs is not None and s < req.num_prompt_tokens - 1:
                count = min(s + n, req.num_prompt_tokens - 1) - s
                plan.prompt_logprobs.append((req, row, s, count))
            req.num_computed_tokens = s + n
            if s + n >= len(req.token_ids):
                drafts = spec.get(req.req_id, [])
                plan.reqs.append(req)
                plan.drafts.append(drafts)
                plan.rows.extend(range(row + n - 1 - len(drafts), row + n))
            row += n
        return plan


class InputBatch:
    """The worker's copy of every running request (`requests`, by id) and the step
    inputs built from it."""

    def __init__(self, block_size: int, device: torch.device, workspace: GatherWorkspace,
                 attention_backend: str) -> None:
        self.block_size = block_size
        self.device = device
        self.workspace = workspace
        self.decode_mask = attention_backend == "torch"  # the torch backend attends through a mask
        self.requests: dict[str, RunnerRequest] = {}

    def apply(self, so: SchedulerOutput) -> None:
        """The scheduler's diff: drop finished requests, add new ones, extend the blocks
        and computed counts of the others."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequest(
                req_id=new.req_id,
                token_ids=new.prompt_token_ids + new.output_token_ids,
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            req = self.requests[req_id]
            if new_blocks:
                req.block_ids.extend(new_blocks)
                req.block_ids_np = None
            req.num_computed_tokens = num_computed

    def prepare(self, so: SchedulerOutput, chain: PendingStep | None) -> StepRows:
        """The step's rows (decodes, verifying requests, prefill chunks) with the decode
        rows' inputs. A decode row whose last token `chain` (the step before, still on the
        device) sampled reads it from there: its id is a placeholder, overwritten on the
        device through `fix`. A verifying request's rows are its last token and drafts."""
        rows = StepRows(decodes=[], prefills=[])
        spec = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            if n == 1:
                rows.decodes.append(req)
            elif req_id in spec:
                rows.verifies.append((req, n))
            else:
                rows.prefills.append((req, n))
        fix_rows: list[int] = []
        fix_src: list[int] = []
        for req in rows.decodes:
            pos = req.num_computed_tokens
            if pos < len(req.token_ids):
                self._decode_row(rows, req, pos, req.token_ids[pos])
            else:  # still on the device: taken from the earlier step's sampled tokens
                fix_rows.append(len(rows.input_ids))
                fix_src.append(chain.row_of[req.req_id])
                self._decode_row(rows, req, pos, 0)
        for req, n in rows.verifies:
            s = req.num_computed_tokens
            tokens = req.token_ids[s:] + spec[req.req_id]
            if len(tokens) != n:
                raise RuntimeError(f"request {req.req_id}: {n} tokens scheduled to verify, but {len(tokens)} "
                                   "known after its computed ones (its last token and the drafts)")
            for i, token in enumerate(tokens):
                self._decode_row(rows, req, s + i, token)
        if fix_rows:
            index = to_device(fix_src, self.device)
            rows.fix = (to_device(fix_rows, self.device),
                        chain.sampled.index_select(0, index))
        return rows

    def _decode_row(self, rows: StepRows, req: RunnerRequest, pos: int, token: int) -> None:
        """One decode row: `token` at position `pos` of `req`, attending to keys 0 .. pos."""
        bs = self.block_size
        rows.input_ids.append(token)
        rows.positions.append(pos)
        rows.slots.append(req.block_ids[pos // bs] * bs + pos % bs)
        rows.seq_lens.append(pos + 1)
        rows.tables.append(req.block_ids[:(pos + bs) // bs])

    def eager_inputs(self, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the whole step, flattened:
        the decode rows (verify rows included), then each prefill chunk."""
        bs, dev = self.block_size, self.device
        input_ids = list(rows.input_ids)
        pieces_pos: list[np.ndarray] = [np.asarray(rows.positions, dtype=np.int64)]
        pieces_slot: list[np.ndarray] = [np.asarray(rows.slots, dtype=np.int64)]
        prefill_meta = []
        start = rows.num_decode_rows
        for req, n in rows.prefills:
            s = req.num_computed_tokens
            input_ids.extend(req.token_ids[s:s + n])
            pos = np.arange(s, s + n, dtype=np.int64)
            if req.block_ids_np is None:
                req.block_ids_np = np.asarray(req.block_ids, dtype=np.int64)
            pieces_pos.append(pos)
            pieces_slot.append(req.block_ids_np[pos // bs] * bs + pos % bs)
            block_tensor = to_device(req.block_ids_np[:(s + n + bs - 1) // bs], dev)
            prefill_meta.append((start, n, s, block_tensor))
            start += n
        ids_t = to_device(input_ids, dev)
        if rows.fix is not None:
            ids_t.index_copy_(0, *rows.fix)
        pos_t = to_device(np.concatenate(pieces_pos), dev)
        md = AttentionMetadata(slot_mapping=to_device(np.concatenate(pieces_slot), dev),
                               num_decodes=rows.num_decode_rows, decode_block_table=None, decode_seq_lens=None,
                               prefills=prefill_meta, workspace=self.workspace)
        if rows.input_ids:
            set_decode_rows(md, rows.tables, rows.seq_lens, bs, dev, mask=self.decode_mask)
        return ids_t, pos_t, md
