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

from llmd.gpu.layers.attention import AttentionMetadata, GatherWorkspace, MetadataBuilder, set_decode_rows
from llmd.gpu.worker.cuda_graphs import DecodeGraphs
from llmd.gpu.worker.runner_types import StepHandle, RunnerRequest
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
    pooling: list[tuple[RunnerRequest, int, int, int]] = field(default_factory=list)
    """(request, its first row, first position, count): each pooling request's chunk."""


@dataclass
class StepRows:
    """One step's rows in order, and the decode rows' inputs as host arrays (the graph
    path stages them into its own buffers): one row per plain decode, then 1 + k rows per
    request verifying k drafts."""

    decodes: list[RunnerRequest]
    prefills: list[tuple[RunnerRequest, int]]  # request, tokens it computes this step
    verifies: list[tuple[RunnerRequest, int]] = field(default_factory=list)  # request, 1 + its drafts
    input_ids: np.ndarray = field(default_factory=lambda: _EMPTY)
    positions: np.ndarray = field(default_factory=lambda: _EMPTY)
    slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    seq_lens: np.ndarray = field(default_factory=lambda: _EMPTY)
    tables: np.ndarray = field(default_factory=lambda: _EMPTY.reshape(0, 0))
    """[rows, blocks] int64: each decode row's block table, as wide as the longest row
    needs; columns past a row's context hold whatever its batch row held (never read)."""
    fix: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, ids on the device): decode rows whose input token a pending step before
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
        if graphs is None or self.prefills or not len(self.input_ids) or len(self.input_ids) > graphs.max_batch:
            return False
        return not any(r.pooling_params is not None or
                       (r.wants_prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens - 1)
                       for r in self.decodes)

    def advance(self, spec: dict[str, list[int]]) -> SamplePlan:
        """Count this step's tokens as computed for every row's request; the rows that
        sample, the prompt-logprobs jobs and the pooling requests' chunks (`spec`: the
        drafts each request verifies)."""
        plan = SamplePlan()
        row = 0
        for req, n in self.ordered:
            s = req.num_computed_tokens
            if req.wants_prompt_logprobs and s < req.num_prompt_tokens - 1:
                count = min(s + n, req.num_prompt_tokens - 1) - s
                plan.prompt_logprobs.append((req, row, s, count))
            req.num_computed_tokens = s + n
            if req.pooling_params is not None:
                plan.pooling.append((req, row, s, n))
            elif s + n >= len(req.token_ids):
                drafts = spec.get(req.req_id, [])
                plan.reqs.append(req)
                plan.drafts.append(drafts)
                plan.rows.extend(range(row + n - 1 - len(drafts), row + n))
            row += n
        return plan


_EMPTY = np.zeros(0, dtype=np.int64)


class InputBatch:
    """The worker's copy of every running request (`requests`, by id) and the step
    inputs built from it.

    Persistent: each request holds a row of `block_table` (a host array kept across
    steps, grown when a row or a column more is needed) from the step it arrives to the
    step it finishes; the scheduler's diff writes only the new blocks into it. A decode
    step's rows are then gathered from the table with a few array operations (slots,
    block tables, context lengths), whatever the batch and the contexts' lengths: the
    host work per step grows with the batch by a few list reads per row, not with its
    blocks."""

    def __init__(self, block_size: int, device: torch.device, workspace: GatherWorkspace,
                 metadata: MetadataBuilder) -> None:
        """`metadata`: the model's attention backend's builder, run on each step's
        metadata once it is made."""
        self.block_size = block_size
        self.device = device
        self.workspace = workspace
        self.metadata = metadata
        self.requests: dict[str, RunnerRequest] = {}
        self.block_table = np.zeros((8, 16), dtype=np.int64)  # [row, block index] -> block id
        self.num_blocks = np.zeros(8, dtype=np.int64)  # per row: blocks the request holds
        self._free_rows: list[int] = list(range(7, -1, -1))

    def apply(self, so: SchedulerOutput) -> None:
        """The scheduler's diff: drop finished requests, add new ones, extend the blocks
        and computed counts of the others."""
        for req_id in so.finished_req_ids:
            req = self.requests.pop(req_id, None)
            if req is not None:
                self._free_rows.append(req.row)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)  # resumed without a finish in between
            req = self.requests[new.req_id] = RunnerRequest(
                req_id=new.req_id,
                token_ids=new.prompt_token_ids + new.output_token_ids,
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
                row=old.row if old is not None else self._take_row(),
                pooling_params=new.pooling_params,
            )
            self.num_blocks[req.row] = 0
            self._add_blocks(req.row, new.block_ids)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            req = self.requests[req_id]
            if new_blocks:
                self._add_blocks(req.row, new_blocks)
            req.num_computed_tokens = num_computed

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = len(self.num_blocks)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _add_blocks(self, row: int, blocks: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(blocks)
        if end > self.block_table.shape[1]:
            wider = np.zeros((len(self.block_table), max(end, 2 * self.block_table.shape[1])), dtype=np.int64)
            wider[:, :self.block_table.shape[1]] = self.block_table
            self.block_table = wider
        self.block_table[row, start:end] = blocks
        self.num_blocks[row] = end

    def prepare(self, so: SchedulerOutput, chain: StepHandle | None) -> StepRows:
        """The step's rows (decodes, verifying requests, prefill chunks) with the decode
        rows' inputs. A decode row whose last token `chain` (the step before, still on the
        device) sampled reads it from there: its id is a placeholder, overwritten on the
        device through `fix`. A verifying request's rows are its last token and drafts."""
        rows = StepRows(decodes=[], prefills=[])
        spec = so.scheduled_spec_decode_tokens
        requests = self.requests
        for req_id, n in so.num_scheduled_tokens.items():
            req = requests[req_id]
            if n == 1:
                rows.decodes.append(req)
            elif req_id in spec:
                rows.verifies.append((req, n))
            else:
                rows.prefills.append((req, n))
        batch_rows = [r.row for r in rows.decodes]
        positions = [r.num_computed_tokens for r in rows.decodes]
        # A decode's token is known unless the pending step before sampled it (then 0
        # here, the device's value through `fix`).
        ids = [t[p] if p < len(t) else 0 for t, p in zip((r.token_ids for r in rows.decodes), positions)]
        fix_rows = [i for i, (r, p) in enumerate(zip(rows.decodes, positions)) if p >= len(r.token_ids)]
        for req, n in rows.verifies:
            s = req.num_computed_tokens
            tokens = req.token_ids[s:] + spec[req.req_id]
            if len(tokens) != n:
                raise RuntimeError(f"request {req.req_id}: {n} tokens scheduled to verify, but {len(tokens)} "
                                   "known after its computed ones (its last token and the drafts)")
            batch_rows += [req.row] * n
            positions += range(s, s + n)
            ids += tokens
        if ids:
            rows.input_ids = np.asarray(ids, dtype=np.int64)
            rows.positions = np.asarray(positions, dtype=np.int64)
            rows.slots, rows.seq_lens, rows.tables = self.decode_rows(np.asarray(batch_rows, dtype=np.int64),
                                                                      rows.positions)
        if fix_rows:
            index = to_device([chain.row_of[rows.decodes[i].req_id] for i in fix_rows], self.device)
            rows.fix = (to_device(fix_rows, self.device), chain.sampled.index_select(0, index))
        return rows

    def decode_rows(self, batch_rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slots, context lengths and block tables of decode rows: row i is position
        positions[i] of the request in batch row batch_rows[i], attending to keys 0 ..
        positions[i] (the draft model's rows too: its cache has the same blocks). Raises
        RuntimeError for a position past its request's blocks."""
        bs = self.block_size
        block = positions // bs
        past = block >= self.num_blocks[batch_rows]
        if past.any():
            i = int(np.argmax(past))
            owner = next(r.req_id for r in self.requests.values() if r.row == batch_rows[i])
            raise RuntimeError(f"position {positions[i]} of request {owner} is past its "
                               f"{self.num_blocks[batch_rows[i]]} KV blocks: the scheduler reserved no slot for it")
        slots = self.block_table[batch_rows, block] * bs + positions % bs
        width = int(block.max()) + 1 if len(block) else 0
        return slots, positions + 1, self.block_table[batch_rows, :width]

    def eager_inputs(self, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the whole step, flattened:
        the decode rows (verify rows included), then each prefill chunk."""
        bs, dev = self.block_size, self.device
        pieces_ids: list[np.ndarray] = [rows.input_ids]
        pieces_pos: list[np.ndarray] = [rows.positions]
        pieces_slot: list[np.ndarray] = [rows.slots]
        prefill_meta = []
        start = rows.num_decode_rows
        for req, n in rows.prefills:
            s = req.num_computed_tokens
            pieces_ids.append(np.asarray(req.token_ids[s:s + n], dtype=np.int64))
            pos = np.arange(s, s + n, dtype=np.int64)
            blocks = self.block_table[req.row]
            pieces_pos.append(pos)
            pieces_slot.append(blocks[pos // bs] * bs + pos % bs)
            block_tensor = to_device(blocks[:(s + n + bs - 1) // bs], dev)
            prefill_meta.append((start, n, s, block_tensor))
            start += n
        ids_t = to_device(np.concatenate(pieces_ids), dev)
        if rows.fix is not None:
            ids_t.index_copy_(0, *rows.fix)
        pos_t = to_device(np.concatenate(pieces_pos), dev)
        md = AttentionMetadata(slot_mapping=to_device(np.concatenate(pieces_slot), dev),
                               num_decodes=rows.num_decode_rows, decode_block_table=None, decode_seq_lens=None,
                               prefills=prefill_meta, workspace=self.workspace)
        if rows.num_decode_rows:
            set_decode_rows(md, rows.tables, rows.seq_lens, dev)
        self.metadata.build(md)
        return ids_t, pos_t, md
