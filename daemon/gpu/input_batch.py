"""The inputs of one step, built from the worker's copy of every running request.

The scheduler sends a diff each step (new requests, new blocks, finished ids); `apply`
keeps the copy up to date. `prepare` orders the step's rows decodes first (one new token
each, attended in one batch), then prefill chunks, and builds the decode rows' host
inputs. A step whose rows are all plain decodes replays a CUDA graph on those lists
(`StepRows.fits_graph`, padding is the graphs' own); any other step runs eagerly on
`eager_inputs`: the flattened ids, positions, slot mapping and attention metadata.
After the forward, `StepRows.advance` moves every request past the step's tokens and
says which rows sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmd.gpu.attention import AttentionMetadata, GatherWorkspace, set_decode_rows
from llmd.gpu.cuda_graphs import DecodeGraphs
from llmd.gpu.runner_types import PendingStep, RunnerRequest
from llmd.step_messages import SchedulerOutput


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
    path stages them into its own buffers)."""

    decodes: list[RunnerRequest]
    prefills: list[tuple[RunnerRequest, int]]  # request, tokens it computes this step
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
        return [(r, 1) for r in self.decodes] + self.prefills

    def fits_graph(self, so: SchedulerOutput, graphs: DecodeGraphs | None) -> bool:
        """A step replays a graph when every row is a plain decode (one new token, no
        drafts, no prompt logprobs to compute) and the batch fits a captured size."""
        if (graphs is None or self.prefills or not self.decodes or len(self.decodes) > graphs.max_batch
                or so.scheduled_spec_decode_tokens or so.scheduled_spec_tail_tokens):
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
        """The step's rows (decodes first) with the decode rows' inputs. A decode row
        whose last token `chain` (the step before, still on the device) sampled reads it
        from there: its id is a placeholder, overwritten on the device through `fix`."""
        rows = StepRows(decodes=[], prefills=[])
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            if n == 1:
                rows.decodes.append(req)
            else:
                rows.prefills.append((req, n))
        bs = self.block_size
        fix_rows: list[int] = []
        fix_src: list[int] = []
        for req in rows.decodes:
            pos = req.num_computed_tokens
            if pos < len(req.token_ids):
                rows.input_ids.append(req.token_ids[pos])
            else:  # still on the device: taken from the earlier step's sampled tokens
                fix_rows.append(len(rows.input_ids))
                fix_src.append(chain.row_of[req.req_id])
                rows.input_ids.append(0)
            rows.positions.append(pos)
            rows.slots.append(req.block_ids[pos // bs] * bs + pos % bs)
            rows.seq_lens.append(pos + 1)
            rows.tables.append(req.block_ids[:(pos + bs) // bs])
        if fix_rows:
            index = torch.tensor(fix_src, dtype=torch.int64, device=self.device)
            rows.fix = (torch.tensor(fix_rows, dtype=torch.int64, device=self.device),
                        chain.sampled.index_select(0, index))
        return rows

    def eager_inputs(self, so: SchedulerOutput,
                     rows: StepRows) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the whole step, flattened:
        the decode rows, then each prefill chunk (a request verifying drafts computes its
        last token followed by the drafts)."""
        bs, dev = self.block_size, self.device
        input_ids = list(rows.input_ids)
        pieces_pos: list[np.ndarray] = [np.asarray(rows.positions, dtype=np.int64)]
        pieces_slot: list[np.ndarray] = [np.asarray(rows.slots, dtype=np.int64)]
        prefill_meta = []
        start = len(rows.decodes)
        spec = so.scheduled_spec_decode_tokens
        for req, n in rows.prefills:
            s = req.num_computed_tokens
            input_ids.extend(req.token_ids[s:s + n] if req.req_id not in spec else req.token_ids[s:] + spec[req.req_id])
            pos = np.arange(s, s + n, dtype=np.int64)
            if req.block_ids_np is None:
                req.block_ids_np = np.asarray(req.block_ids, dtype=np.int64)
            pieces_pos.append(pos)
            pieces_slot.append(req.block_ids_np[pos // bs] * bs + pos % bs)
            block_tensor = torch.from_numpy(req.block_ids_np[:(s + n + bs - 1) // bs]).to(dev)
            prefill_meta.append((start, n, s, block_tensor))
            start += n
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        if rows.fix is not None:
            ids_t.index_copy_(0, *rows.fix)
        pos_t = torch.from_numpy(np.concatenate(pieces_pos)).to(dev)
        md = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(pieces_slot)).to(dev),
                               num_decodes=len(rows.decodes), decode_block_table=None, decode_seq_lens=None,
                               prefills=prefill_meta, workspace=self.workspace)
        if rows.decodes:
            set_decode_rows(md, rows.tables, rows.seq_lens, bs, dev, mask=self.decode_mask)
        return ids_t, pos_t, md
