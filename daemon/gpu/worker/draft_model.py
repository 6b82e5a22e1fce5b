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

The draft steps sample one batch: every request drafting after this step has a row in
each of them, ordered by how many drafts it makes, so the requests still drafting at
step j are a prefix of the rows. The forward runs on that prefix; the rows after it
(requests that reached their limit) sample from zero logits and their draws are
dropped. So the sampling metadata is built once, the input ids of step j > 0 are step
j - 1's sampled tokens on the device, and the drafts are read back once, after the last
step. With decode graphs (`init_decode_graphs`: a DecodeGraphs over the draft model and
its cache, whose scratch block has the target's block id) each draft step replays one,
and so does the draft's forward over the target's step when the target replays a graph
(the step's decode rows, verify rows included: `forward_decode_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmd.gpu.layers.attention import (AttentionMetadata, GatherWorkspace, model_kv_bytes_per_block,
                                       new_model_kv_caches, set_decode_rows)
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.layers.kv_quant import KVCacheFormat, KVScales
from llmd.gpu.worker.kv_calibration import kv_scales_for, set_kv_scales
from llmd.gpu.worker.cuda_graphs import DecodeGraphs, build_decode_graphs
from llmd.gpu.worker.input_batch import InputBatch
from llmd.gpu.models.loader import load_model
from llmd.gpu.worker.runner_types import RunnerRequest, RunnerSettings
from llmd.gpu.sample.sampler import SAMPLING_EPS, Sampler, SamplingMetadata

# Seeded rows draw their drafts from a stream apart from the target's sampling and
# acceptance draws at the same position: rejection sampling needs them independent.
DRAFT_SALT = 0xD2AF_7ED0_5EED_0001


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), vocab_limit]: q per draft; None on greedy requests


class DraftModel:
    decode_graphs: DecodeGraphs | None = None  # set by init_decode_graphs

    def __init__(self, settings: RunnerSettings, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
                 attention_backend: str, sampler: Sampler, workspace: GatherWorkspace, batch: InputBatch) -> None:
        """`batch`: the target's input batch, whose block tables the draft's rows read;
        `cache_dtype`: its KV cache's elements, as the target's (kv_cache_dtype)."""
        self.settings = settings
        self.batch = batch
        self.device = device
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self.kv_scales: list[KVScales] | None = None  # its own, with a quantized cache
        self.k = settings.num_speculative_tokens
        self.attention_backend = attention_backend
        self.model = load_model(settings.draft_model, dtype, device, settings.max_model_len,
                                attention_backend=attention_backend, dequantize=settings.dequantize,
                                int8_activations=settings.cpu_int8_activations)
        self.attention_metadata = metadata_builder(self.model, settings.block_size, device)
        self.sampler = sampler
        self.workspace = workspace
        self.kv_caches: list[torch.Tensor] = []
        self.proposals: dict[str, Proposal] = {}

    # -- KV cache (same blocks and block ids as the target's) ---------------------------
    def kv_cache_bytes_per_block(self) -> int:
        return model_kv_bytes_per_block(self.model, self.settings.block_size, self.cache_dtype)

    def initialize_kv_cache(self, num_blocks: int, kv_format: KVCacheFormat | None = None,
                            calibration: dict | None = None) -> None:
        """A quantized cache (`kv_format`) gets the draft's own scales first, calibrated
        as the target's (kv_calibration, with the target's `calibration` settings)."""
        self.release_decode_graphs()
        self.kv_caches = []
        if kv_format is not None and self.kv_scales is None:
            self.kv_scales = kv_scales_for(self.model, kv_format, **calibration)
            set_kv_scales(self.model, self.kv_scales)
        self.kv_caches = new_model_kv_caches(self.model, num_blocks, self.settings.block_size, self.cache_dtype,
                                             self.device)

    @property
    def scratch_block(self) -> int:
        """The cache's last block: padded rows write and read only there (the target's
        cache has the same block ids, this one included)."""
        return self.kv_caches[0].shape[2] - 1

    # -- decode graphs ----------------------------------------------------------------------
    def init_decode_graphs(self, sizes: list[int], emulate: bool = False) -> None:
        """Capture the draft's decode graphs over its current cache for batch sizes `sizes`
        (the target's); a failure leaves decode_graphs None (eager draft steps)."""
        self.release_decode_graphs()

        def make() -> DecodeGraphs:
            return DecodeGraphs(self.model, self.kv_caches, sizes, self.settings.block_size,
                                self.settings.max_model_len, self.scratch_block, self.attention_metadata,
                                self.device, self.workspace, emulate=emulate)

        self.decode_graphs = make() if emulate else build_decode_graphs(make, self.device)

    def release_decode_graphs(self) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None

    # -- each step ------------------------------------------------------------------------
    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.proposals.pop(req_id, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """The target's forward over the step's tokens: fills the draft's cache."""
        self.attention_metadata.build(md)
        self.model(input_ids, positions, self.kv_caches, md)

    def forward_decode_rows(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                            seq_lens: np.ndarray, tables: np.ndarray,
                            fix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The hidden states of decode rows given as DecodeGraphs.run takes them (`fix`
        included): a replay of the draft's graph when one holds them, else the eager
        forward. The runner calls it with the rows its own decode graph ran on (forward()
        for a graph step); the draft steps call it for theirs."""
        graphs = self.decode_graphs
        if graphs is not None and len(input_ids) <= graphs.max_batch:
            return graphs.run(input_ids, positions, slots, seq_lens, tables, fix=fix)
        dev = self.device
        ids = torch.from_numpy(input_ids).to(dev)
        if fix is not None:
            ids.index_copy_(0, *fix)
        md = AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(dev),
                               num_decodes=len(input_ids), decode_block_table=None, decode_seq_lens=None,
                               prefills=[], workspace=self.workspace)
        set_decode_rows(md, tables, seq_lens, dev)
        self.attention_metadata.build(md)
        return self.model(ids, torch.from_numpy(positions).to(dev), self.kv_caches, md)

    def take_probs(self, req_ids: list[str], drafts: list[list[int]], num_rows: int, width: int) -> torch.Tensor:
        """q for the verify rows (see rejection_sampler.verify: request j owns
        len(drafts[j]) + 1 rows), zero where no draft is tested or the request is greedy."""
        q = torch.zeros(num_rows, width, dtype=torch.float32, device=self.device)
        row = 0
        for req_id, d in zip(req_ids, drafts):
            proposal = self.proposals.get(req_id)
            if d:
                if proposal is None or proposal.token_ids[:len(d)] != d:
                    raise RuntimeError(f"request {req_id}: drafts to verify {d} are not the draft "
                                       "model's proposal")
                if proposal.probs is not None:
                    q[row:row + len(d)] = proposal.probs[:len(d)]
            row += len(d) + 1
        return q

    @torch.inference_mode()
    def propose(self, reqs: list[RunnerRequest], limits: dict[str, int]) -> dict[str, list[int]]:
        """Drafts for each request in `limits` (its token_ids end with the token just
        emitted): min(k, limit - known tokens) of them, decoded one position at a time,
        all requests batched. Keeps each proposal (with q) for the next step."""
        todo = [(r, min(self.k, limits[r.req_id] - len(r.token_ids))) for r in reqs if r.req_id in limits]
        todo = sorted([(r, n) for r, n in todo if n > 0], key=lambda t: -t[1])  # still drafting: a prefix
        if not todo:
            return {}
        rows = [r for r, _ in todo]
        md = SamplingMetadata.build(
            [r.sampling_params for r in rows], [r.token_ids[:r.num_prompt_tokens] for r in rows],
            [r.output_token_ids for r in rows], valid_vocab_size=self.settings.valid_vocab_size,
            eos_token_id=self.settings.eos_token_id, device=self.device)
        md.max_num_logprobs = None
        every_row = torch.arange(len(rows), dtype=torch.int64, device=self.device)
        step_tokens: list[torch.Tensor] = []
        step_probs: list[torch.Tensor | None] = []
        for j in range(todo[0][1]):
            live = sum(1 for _, n in todo if n > j)
            fix = None
            if j:
                md.append_sampled(step_tokens[-1])
                fix = (every_row[:live], step_tokens[-1][:live])
            logits = self._draft_logits(rows[:live], j, fix)
            if live < len(rows):  # requests done drafting: zero logits, their draws dropped
                logits = F.pad(logits, (0, 0, 0, len(rows) - live))
            logits, _ = self.sampler.prepare(self.sampler.mask(logits, md), md)
            tokens, q = self.sampler.sample(logits, md, keep_probs=True, salt=DRAFT_SALT)
            step_tokens.append(tokens)
            step_probs.append(q)
        drafted = torch.stack(step_tokens, dim=1).tolist()  # the one read back of the drafts
        drafts: dict[str, list[int]] = {}
        for i, (r, n) in enumerate(todo):
            drafts[r.req_id] = drafted[i][:n]
            random = step_probs[0] is not None and r.sampling_params.temperature >= SAMPLING_EPS
            q = torch.stack([step_probs[j][i] for j in range(n)]) if random else None
            self.proposals[r.req_id] = Proposal(drafts[r.req_id], q)
        return drafts

    def _draft_logits(self, reqs: list[RunnerRequest], j: int,
                      fix: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Draft step j: request i's input at position len(token_ids) - 1 + j (its last
        token at j = 0, after that the token drafted at j - 1, on the device in `fix`).
        Returns the logits [len(reqs), vocab]."""
        n = len(reqs)
        positions = np.fromiter((len(r.token_ids) - 1 + j for r in reqs), dtype=np.int64, count=n)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=n)
        slots, seq_lens, tables = self.batch.decode_rows(rows, positions)
        input_ids = np.fromiter((r.token_ids[-1] for r in reqs), dtype=np.int64, count=n) if j == 0 \
            else np.zeros(n, dtype=np.int64)
        hidden = self.forward_decode_rows(input_ids, positions, slots, seq_lens, tables, fix)
        return self.model.compute_logits(hidden)
