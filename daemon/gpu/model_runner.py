"""The model runner: keeps the worker's copy of every running request, turns a
SchedulerOutput into one flattened forward pass over the paged KV cache, and samples.

Rows are ordered decodes first (one new token each, attended in one batch), then
prefill chunks. Logits are computed only for rows that sample (and for prompt
positions of requests that asked for prompt logprobs).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from llmd.gpu.attention import (AttentionMetadata, GatherWorkspace, model_kv_bytes_per_block,
                                new_model_kv_caches, set_decode_rows)
from llmd.gpu.attention_backends import resolve_attention_backend
from llmd.gpu.cuda_graphs import DecodeGraphs, build_decode_graphs, capture_sizes
from llmd.gpu.draft_model import DraftModel
from llmd.gpu.loader import load_model
from llmd.load_progress import LoadProgress
from llmd.gpu.kv_budget import MemoryBreakdown
from llmd.gpu.rejection_sampler import VerifyOutput, verify
from llmd.gpu.sampler import Sampler, SamplerOutput, SamplingMetadata, gather_logprobs
from llmd.step_messages import Logprobs, PromptLogprobs, RunnerOutput, SchedulerOutput
from llmd_client.protocol import SamplingParams

logger = logging.getLogger("llmd.model_runner")


@dataclass
class RunnerRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    block_ids_np: np.ndarray | None = field(default=None, repr=False)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class RunnerSettings:
    block_size: int
    max_model_len: int
    valid_vocab_size: int  # tokenizer size; wider logits are padding and never sampled
    eos_token_id: int | None
    seed: int
    cpu_threads: int | None = None  # torch intra-op threads when running on CPU
    attention_backend: str = "auto"  # "auto", "torch", "triton" or "flash_attn" (see attention_backends)
    # Draft-model speculation: the draft's directory and the drafts it makes per step.
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    # The scheduler's step limits: the shape of the largest step, which the CUDA memory
    # profile runs (profile_kv_budget); CUDA graphs for decode steps (see cuda_graphs) are
    # captured for batch sizes up to min(max_num_seqs, 512) unless enforce_eager.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enforce_eager: bool = False

    @property
    def max_sampled_rows(self) -> int:
        """The most logit rows one step samples: every request verifying every draft."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))


@dataclass
class _Pending:
    """A step whose sampled tokens are still on their way to the host (async scheduling
    with chained steps): the next step takes its decode inputs from `sampled` on the
    device, and the output is completed by _collect once the copy is done."""

    out: RunnerOutput
    ordered: list[RunnerRequest]  # the step's rows' requests, in row order
    sample_reqs: list[RunnerRequest]
    sampled: torch.Tensor | None  # [len(sample_reqs)] int64 on the device; None: out is complete
    host: SamplerOutput | None = None  # the sampler's output, copied (or copying) to the host
    ready: object | None = None  # torch.cuda.Event recorded after the copies
    row_of: dict[str, int] = field(default_factory=dict)  # req_id -> index in sampled


class ModelRunner:
    decode_graphs: DecodeGraphs | None = None  # set by initialize_kv_cache when graphs are on

    def __init__(self, model_dir: str, settings: RunnerSettings, device: torch.device,
                 dtype: torch.dtype, rank: int = 0, world_size: int = 1,
                 progress: LoadProgress | None = None) -> None:
        """With world_size > 1 (tensor parallelism, process group already initialised)
        this runner holds rank `rank`'s shard: its own q/kv heads, so its KV cache holds
        only its kv heads. Every rank runs every step; rank 0 samples and the sampled
        tokens are broadcast to the others."""
        self.settings = settings
        self.block_size = settings.block_size
        self.device = device
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        if settings.cpu_threads and device.type == "cpu":
            torch.set_num_threads(settings.cpu_threads)
        self.attention_backend = resolve_attention_backend(settings.attention_backend, device, settings.block_size,
                                                           dtype)
        # CUDA: what the device held before our weights (profile_kv_budget's baseline).
        self._cuda_before_load: tuple[int, int, int] | None = None  # free, allocated, reserved
        if device.type == "cuda":
            self._cuda_before_load = (torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device),
                                      torch.cuda.memory_reserved(device))
        self.model = load_model(model_dir, dtype, device, settings.max_model_len, rank, world_size,
                                self.attention_backend, progress)
        self.vocab_size = self.model.config.vocab_size
        self.sampler = Sampler(seed=settings.seed)
        self.requests: dict[str, RunnerRequest] = {}
        self._pending: _Pending | None = None  # chained steps: the last step, not yet collected
        self.kv_caches: list[torch.Tensor] = []
        self.workspace = GatherWorkspace()
        self.drafter: DraftModel | None = None
        if settings.draft_model:
            if world_size > 1:
                raise ValueError("a draft model does not run with tensor parallelism yet")
            self.drafter = DraftModel(settings, device, dtype, self.attention_backend, self.sampler,
                                      self.workspace)

    # -- KV cache -------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        """Both models' bytes when there is a draft model: its cache has as many blocks."""
        total = model_kv_bytes_per_block(self.model, self.block_size, self.dtype)
        if self.drafter is not None:
            total += self.drafter.kv_cache_bytes_per_block()
        return total

    def profile_kv_budget(self, gpu_memory_utilization: float, extra_reserved_bytes: int = 0) -> MemoryBreakdown:
        """CUDA: the KV cache budget from a profile of the largest step (memory_profile)."""
        from llmd.gpu.memory_profile import profile_kv_budget

        return profile_kv_budget(self, gpu_memory_utilization, extra_reserved_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """num_blocks are the block pool's; the cache has one more, the scratch block
        that padded rows of a graph step write and read (the pool never hands it out)."""
        self.release_decode_graphs()
        self.kv_caches = new_model_kv_caches(self.model, num_blocks + 1, self.block_size, self.dtype, self.device)
        if self.drafter is not None:  # the same blocks as the target's, scratch included
            self.drafter.initialize_kv_cache(num_blocks + 1)
        if self._decode_graphs_wanted():
            self.init_decode_graphs()

    @property
    def scratch_block(self) -> int:
        return self.kv_caches[0].shape[2] - 1

    def _graphs_off_reason(self) -> str | None:
        """Why decode steps will not use CUDA graphs on this runner (None: they will)."""
        if self.device.type != "cuda":
            return "not a CUDA device"
        if self.settings.enforce_eager:
            return "enforce_eager is set"
        if self.attention_backend == "torch":
            return ("the 'torch' attention backend builds its shapes on the host each step "
                    "(graphs need 'triton' or 'flash_attn')")
        if self.drafter is not None:
            return "the draft model runs its own forward every step"
        if self.world_size > 1:
            return "tensor parallelism is not captured"
        return None

    def _decode_graphs_wanted(self) -> bool:
        reason = self._graphs_off_reason()
        if reason is None:
            return True
        if self.device.type == "cuda":
            log = logger.info if self.settings.enforce_eager else logger.warning
            log("CUDA graphs off: %s; decode steps run eagerly", reason)
        return False

    def init_decode_graphs(self, emulate: bool = False) -> None:
        """Capture the decode graphs over the current KV cache (a failure leaves
        decode_graphs None: eager steps). emulate=True (tests, any device) builds the
        same static buffers, padding and scratch-block rows but calls the forward."""
        self.release_decode_graphs()

        def make() -> DecodeGraphs:
            return DecodeGraphs(self.model, self.kv_caches, capture_sizes(self.settings.max_num_seqs,
                                                                          self.settings.max_num_batched_tokens),
                                self.block_size, self.settings.max_model_len, self.scratch_block,
                                self.attention_backend, self.device, self.workspace, emulate=emulate)

        self.decode_graphs = make() if emulate else build_decode_graphs(make, self.device)

    def release_decode_graphs(self) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None

    def release_kv_cache(self) -> None:
        self._pending = None
        self.release_decode_graphs()
        self.kv_caches = []
        if self.drafter is not None:
            self.drafter.kv_caches = []

    # -- one step -------------------------------------------------------------------
    def _apply_scheduler_output(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.forget(so.finished_req_ids)
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

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        if self._pending is not None:  # a chained step before this one: its tokens first
            self._collect(self._pending)
            self._pending = None
        return self._execute(so, None, defer=False)

    @property
    def supports_chaining(self) -> bool:
        """Whether execute_model_chained can leave a step's tokens on the device: one rank
        (no token broadcast), no draft model (it drafts from the host tokens)."""
        return self.world_size == 1 and self.drafter is None

    @torch.inference_mode()
    def execute_model_chained(self, so: SchedulerOutput) -> RunnerOutput | None:
        """Async scheduling: launch `so` without waiting for its sampled tokens, then
        return the output of the step before it (None if there was none). Decode rows
        whose last token that earlier step sampled read it on the device, so the device
        goes from one step to the next while the host reads the earlier one's tokens.
        A step that cannot go that way (drafts to verify) has the earlier step's tokens
        collected first."""
        prev, self._pending = self._pending, None
        earlier = None
        defer = self._can_defer(so)
        if prev is not None and not defer:
            earlier, prev = self._collect(prev), None
        result = self._execute(so, prev, defer=defer)
        self._pending = result if isinstance(result, _Pending) else _Pending(result, [], [], None)
        if prev is not None:
            earlier = self._collect(prev)
        return earlier

    def flush(self) -> RunnerOutput | None:
        """The output of the last chained step (None if it was already returned)."""
        prev, self._pending = self._pending, None
        return self._collect(prev) if prev is not None else None

    def _can_defer(self, so: SchedulerOutput) -> bool:
        return (self.supports_chaining and self.rank == 0 and not so.scheduled_spec_decode_tokens
                and not so.scheduled_spec_tail_tokens)

    def _collect(self, p: _Pending) -> RunnerOutput:
        """Wait for a deferred step's tokens, append them, and complete its output."""
        if p.sampled is None:
            return p.out
        if p.ready is not None:
            p.ready.synchronize()
        tokens = p.host.sampled_token_ids.tolist()
        if p.host.logprobs_token_ids is not None:
            self._collect_logprobs(p.out, p.sample_reqs, [[i] for i in range(len(p.sample_reqs))], p.host)
        sampled_by_req = {r.req_id: [t] for r, t in zip(p.sample_reqs, tokens)}
        for req in p.ordered:
            new = sampled_by_req.get(req.req_id, [])
            req.token_ids.extend(new)
            p.out.req_ids.append(req.req_id)
            p.out.sampled_token_ids.append(new)
        return p.out

    def _execute(self, so: SchedulerOutput, chain: _Pending | None, defer: bool) -> RunnerOutput | _Pending:
        self._apply_scheduler_output(so)
        if not so.num_scheduled_tokens:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        bs = self.block_size
        decodes: list[RunnerRequest] = []
        prefills: list[tuple[RunnerRequest, int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            if n == 1:
                decodes.append(req)
            else:
                prefills.append((req, n))

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        fix_rows: list[int] = []  # decode rows whose token the chained step before sampled
        fix_src: list[int] = []
        for req in decodes:
            pos = req.num_computed_tokens
            if pos < len(req.token_ids):
                input_ids.append(req.token_ids[pos])
            else:  # still on the device: taken from the earlier step's sampled tokens
                fix_rows.append(len(input_ids))
                fix_src.append(chain.row_of[req.req_id])
                input_ids.append(0)
            positions.append(pos)
            slots.append(req.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(req.block_ids[:(pos + bs) // bs])
        num_decode_tokens = len(input_ids)
        fix = None
        if fix_rows:
            index = torch.tensor(fix_src, dtype=torch.int64, device=self.device)
            fix = (torch.tensor(fix_rows, dtype=torch.int64, device=self.device), chain.sampled.index_select(0, index))
        if self._is_graph_step(so, decodes, prefills):
            hidden = self.decode_graphs.run(input_ids, positions, slots, seq_lens, tables, fix=fix)
            return self._finish_step(so, hidden, decodes, prefills, chain, defer)

        pieces_pos: list[np.ndarray] = []
        pieces_slot: list[np.ndarray] = []
        prefill_meta = []
        start = num_decode_tokens
        spec = so.scheduled_spec_decode_tokens
        for req, n in prefills:
            s = req.num_computed_tokens
            # A request verifying drafts computes its last token followed by the drafts.
            input_ids.extend(req.token_ids[s:s + n] if req.req_id not in spec else req.token_ids[s:] + spec[req.req_id])
            pos = np.arange(s, s + n, dtype=np.int64)
            if req.block_ids_np is None:
                req.block_ids_np = np.asarray(req.block_ids, dtype=np.int64)
            pieces_pos.append(pos)
            pieces_slot.append(req.block_ids_np[pos // bs] * bs + pos % bs)
            num_blocks = (s + n + bs - 1) // bs
            block_tensor = torch.from_numpy(req.block_ids_np[:num_blocks]).to(self.device)
            prefill_meta.append((start, n, s, block_tensor))
            start += n

        pos_np = np.concatenate([np.asarray(positions, dtype=np.int64)] + pieces_pos)
        slot_np = np.concatenate([np.asarray(slots, dtype=np.int64)] + pieces_slot)
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        if fix is not None:
            ids_t.index_copy_(0, *fix)
        pos_t = torch.from_numpy(pos_np).to(dev)
        slot_t = torch.from_numpy(slot_np).to(dev)
        md = AttentionMetadata(
            slot_mapping=slot_t,
            num_decodes=len(decodes),
            decode_block_table=None,
            decode_seq_lens=None,
            prefills=prefill_meta,
            workspace=self.workspace,
        )
        if decodes:
            set_decode_rows(md, tables, seq_lens, bs, dev, mask=self.attention_backend == "torch")

        hidden = self.model(ids_t, pos_t, self.kv_caches, md)
        if self.drafter is not None:
            self.drafter.forward(ids_t, pos_t, md)
        return self._finish_step(so, hidden, decodes, prefills, chain, defer)

    def _is_graph_step(self, so: SchedulerOutput, decodes: list[RunnerRequest],
                       prefills: list[tuple[RunnerRequest, int]]) -> bool:
        """A step replays a graph when every row is a plain decode (one new token, no
        drafts, no prompt logprobs to compute) and the batch fits a captured size."""
        graphs = self.decode_graphs
        if (graphs is None or prefills or not decodes or len(decodes) > graphs.max_batch
                or so.scheduled_spec_decode_tokens or so.scheduled_spec_tail_tokens):
            return False
        return not any(r.sampling_params.prompt_logprobs is not None
                       and r.num_computed_tokens < r.num_prompt_tokens - 1 for r in decodes)

    def _finish_step(self, so: SchedulerOutput, hidden: torch.Tensor, decodes: list[RunnerRequest],
                     prefills: list[tuple[RunnerRequest, int]], chain: _Pending | None = None,
                     defer: bool = False) -> RunnerOutput | _Pending:
        """Logits of the rows that sample (and prompt logprobs), sampling, bookkeeping.
        With `defer`, the sampled tokens stay on the device (see _Pending)."""
        dev = self.device
        spec = so.scheduled_spec_decode_tokens
        # Rows that sample: requests whose known tokens are all computed after this step
        # (all 1 + k rows of a request verifying k drafts).
        sample_reqs: list[RunnerRequest] = []
        sample_rows: list[int] = []
        sample_drafts: list[list[int]] = []
        prompt_lp_jobs: list[tuple[RunnerRequest, int, int, int]] = []  # req, row0, first pos, count
        row = 0
        ordered = [(r, 1) for r in decodes] + prefills
        for req, n in ordered:
            s = req.num_computed_tokens
            if req.sampling_params.prompt_logprobs is not None and s < req.num_prompt_tokens - 1:
                count = min(s + n, req.num_prompt_tokens - 1) - s
                prompt_lp_jobs.append((req, row, s, count))
            req.num_computed_tokens = s + n
            if s + n >= len(req.token_ids):
                drafts = spec.get(req.req_id, [])
                sample_reqs.append(req)
                sample_drafts.append(drafts)
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
            row += n

        out = RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs={}, prompt_logprobs={})
        if dev.type == "cuda":
            out.device_memory_bytes = torch.cuda.memory_reserved(dev)
        for req, row0, first, count in prompt_lp_jobs:
            out.prompt_logprobs[req.req_id] = self._prompt_logprobs(hidden, req, row0, first, count)

        sampled: list[list[int]] = []
        if sample_reqs:
            if len(sample_rows) == hidden.shape[0]:  # every row samples (rows are distinct, ascending)
                logits = self.model.compute_logits(hidden)
            else:
                idx = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
                logits = self.model.compute_logits(hidden.index_select(0, idx))
            if defer:
                return self._sample_deferred(so, logits, sample_reqs, [r for r, _ in ordered], out, chain)
            if self.rank == 0:
                sampled = self._sample(so, logits, sample_reqs, sample_drafts, out)
                if self.world_size > 1:
                    _broadcast_tokens(_pad_rows(sampled, len(sample_reqs), sample_drafts, dev))
            else:  # tensor-parallel rank > 0: take rank 0's tokens
                tokens = _pad_rows([], len(sample_reqs), sample_drafts, dev)
                _broadcast_tokens(tokens)
                sampled = [[t for t in row if t >= 0] for row in tokens.tolist()]
        sampled_by_req = {r.req_id: t for r, t in zip(sample_reqs, sampled)}
        for req, _ in ordered:
            out.req_ids.append(req.req_id)
            tokens = sampled_by_req.get(req.req_id, [])
            req.token_ids.extend(tokens)
            out.sampled_token_ids.append(tokens)
        if self.drafter is not None:
            # A request that sampled has used (or dropped) its proposal: only new ones count.
            self.drafter.forget([r.req_id for r in sample_reqs])
            if so.draft_max_num_tokens:
                out.draft_token_ids = self.drafter.propose(sample_reqs, so.draft_max_num_tokens)
        return out

    def _sampling_metadata(self, so: SchedulerOutput, reqs: list[RunnerRequest], dev: torch.device,
                           chain: _Pending | None = None) -> SamplingMetadata:
        """One sampling row per request (no drafts), grammar rows included. A request
        whose previous token a chained step still holds counts it as output: its length
        through a -1 stand-in (positions for seeds and min_tokens), its value added to the
        penalty counts on the device."""
        settings = self.settings
        in_flight = chain.row_of if chain is not None else {}
        md = SamplingMetadata.build(
            [r.sampling_params for r in reqs], [r.token_ids[:r.num_prompt_tokens] for r in reqs],
            [r.output_token_ids + [-1] if r.req_id in in_flight else r.output_token_ids for r in reqs],
            valid_vocab_size=settings.valid_vocab_size, eos_token_id=settings.eos_token_id, device=dev)
        rows = [i for i, r in enumerate(reqs) if r.req_id in in_flight]
        if md.output_counts is not None and rows:
            src = torch.tensor([in_flight[reqs[i].req_id] for i in rows], dtype=torch.int64, device=dev)
            md.output_counts.index_put_((torch.tensor(rows, dtype=torch.int64, device=dev),
                                         chain.sampled.index_select(0, src)),
                                        torch.ones(len(rows), dtype=md.output_counts.dtype, device=dev),
                                        accumulate=True)
        if so.grammar_req_ids:
            row_of = {r.req_id: i for i, r in enumerate(reqs)}
            md.set_grammar_bitmask([row_of[rid] for rid in so.grammar_req_ids], so.grammar_bitmask, dev)
        return md

    def _sample_deferred(self, so: SchedulerOutput, logits: torch.Tensor, reqs: list[RunnerRequest],
                         ordered: list[RunnerRequest], out: RunnerOutput, chain: _Pending | None) -> _Pending:
        """Sample without reading the tokens back: start their copy to the host and
        return the step as pending."""
        dev = logits.device
        result = self.sampler(logits, self._sampling_metadata(so, reqs, dev, chain))
        host, ready = result, None
        if dev.type == "cuda":
            # Into pinned memory, behind this step's kernels only: the next step's work,
            # queued after, is not waited for.
            host = SamplerOutput(*(t.to("cpu", non_blocking=True) if t is not None else None
                                   for t in (result.sampled_token_ids, result.logprobs_token_ids,
                                             result.logprobs, result.ranks)))
            ready = torch.cuda.Event()
            ready.record()
        return _Pending(out, ordered, reqs, result.sampled_token_ids, host, ready,
                        {r.req_id: i for i, r in enumerate(reqs)})

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor, reqs: list[RunnerRequest],
                drafts: list[list[int]], out: RunnerOutput) -> list[list[int]]:
        """The tokens each request emits: one sampled token, or (verifying drafts) the
        accepted drafts and one more. Logprobs go into `out`."""
        dev = logits.device
        settings = self.settings
        if not so.scheduled_spec_decode_tokens and not so.scheduled_spec_tail_tokens:
            result = self.sampler(logits, self._sampling_metadata(so, reqs, dev))
            tokens = [[t] for t in result.sampled_token_ids.tolist()]
            if result.logprobs_token_ids is not None:
                rows = [[i] for i in range(len(reqs))]
                self._collect_logprobs(out, reqs, rows, result)
            return tokens
        # One row per verified position: row i of a request sees drafts[:i] as output.
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
            md.set_grammar_bitmask([r for rid in so.grammar_req_ids for r in rows_of[rid]], so.grammar_bitmask, dev)
        tails = [so.scheduled_spec_tail_tokens.get(r.req_id) for r in reqs]
        draft_probs = None  # n-gram drafts: point masses (and greedy rows need no q)
        if self.drafter is not None and not md.all_greedy:
            draft_probs = self.drafter.take_probs([r.req_id for r in reqs], drafts, tails, md.num_rows,
                                                  md.vocab_limit)
        result = verify(self.sampler, logits, md, drafts, draft_probs, tails)
        if result.logprobs_token_ids is not None:
            flat, rows = 0, []
            for ts in result.token_ids:
                rows.append(list(range(flat, flat + len(ts))))
                flat += len(ts)
            self._collect_logprobs(out, reqs, rows, result)
        return result.token_ids

    @staticmethod
    def _collect_logprobs(out: RunnerOutput, reqs: list[RunnerRequest], rows: list[list[int]],
                          result: SamplerOutput | VerifyOutput) -> None:
        """rows[i]: the result rows of request i's emitted tokens, in order."""
        ids = result.logprobs_token_ids.tolist()
        lps = result.logprobs.tolist()
        ranks = result.ranks.tolist()
        for req, req_rows in zip(reqs, rows):
            k = req.sampling_params.logprobs
            if k is None:
                continue
            out.logprobs[req.req_id] = Logprobs(token_ids=[ids[r][:k + 1] for r in req_rows],
                                                logprobs=[lps[r][:k + 1] for r in req_rows],
                                                ranks=[ranks[r] for r in req_rows])

    def _prompt_logprobs(self, hidden: torch.Tensor, req: RunnerRequest, row0: int, first: int,
                         count: int) -> PromptLogprobs:
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


def _pad_rows(tokens: list[list[int]], num_reqs: int, drafts: list[list[int]],
              device: torch.device) -> torch.Tensor:
    """[num_reqs, 1 + most drafts] int64, -1 padded: the same shape on every TP rank."""
    width = 1 + max((len(d) for d in drafts), default=0)
    padded = torch.full((num_reqs, width), -1, dtype=torch.int64)
    for i, row in enumerate(tokens):
        padded[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return padded.to(device)


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
