"""The model runner: the worker's model, its KV cache and decode graphs, and the
lifecycle of a step. A SchedulerOutput updates the worker's copy of every running request
(input_batch), becomes one flattened forward pass over the paged KV cache (or a decode
graph's replay), and its sampling rows go to the sampling step (sampling_step); with a
draft model, the draft proposes after it. Every step returns a StepHandle (the step
contract); its tokens may stay on the device until the handle's output() is asked for,
and a step launched before that reads them there.

Rows are ordered decodes first (one new token each, attended in one batch), then
prefill chunks. Logits are computed only for rows that sample (and for prompt
positions of requests that asked for prompt logprobs); the rows of pooling requests
(embeddings) are pooled instead (pooling_step), and a step holding one runs eagerly.
"""
from __future__ import annotations

import gc
import logging

import torch

from llmd.gpu.layers.attention import GatherWorkspace, model_kv_bytes_per_block, new_model_kv_caches
from llmd.gpu.layers.attention_backends import metadata_builder, resolve_attention_backend
from llmd.gpu.layers.kv_quant import KVScales, cache_dtype, kv_cache_format
from llmd.gpu.worker.kv_calibration import kv_scales_for, set_kv_scales
from llmd.gpu.worker.cuda_graphs import DecodeGraphs, build_decode_graphs, capture_sizes
from llmd.gpu.worker.draft_model import DraftModel
from llmd.gpu.sample.graph_sampler import PENALIZED, GraphSampler, graph_sampling_enabled
from llmd.gpu.worker.graph_sampling_plan import plan_graph_sampling
from llmd.gpu.worker.input_batch import InputBatch, StepRows
from llmd.gpu.worker.kv_budget import MemoryBreakdown
from llmd.gpu.models.loader import load_model
from llmd.gpu.worker.memory_profile import ProfileSubject, profile_kv_budget, weight_storage
from llmd.gpu.worker.pooling_step import PoolingStep
from llmd.gpu.worker.runner_types import RunnerSettings, StepHandle, record_sampled
from llmd.gpu.sample.sampler import Sampler
from llmd.gpu.worker.sampling_step import SamplingStep
from llmd.gpu.worker.sleep_mode import HostWeights, free_released_memory
from llmd.load_progress import LoadProgress
from llmd.core.step_messages import GrammarRows, RunnerOutput, SchedulerOutput

logger = logging.getLogger("llmd.model_runner")


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
                                                           dtype, settings.kv_cache_dtype)
        # The KV cache's elements: the model's dtype, or a quantized format whose per-layer
        # scales are calibrated once, before the cache is first made (kv_calibration).
        self.kv_format = kv_cache_format(settings.kv_cache_dtype)
        self.cache_dtype = cache_dtype(settings.kv_cache_dtype, dtype)
        self.kv_scales: list[KVScales] | None = None
        self.model_dir = model_dir
        self.sampler = Sampler(seed=settings.seed)  # kept through sleep: its seeded generators go on
        self._last: StepHandle | None = None  # the last step launched (its tokens may be pending)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0  # the block pool's, once the KV cache is sized (wake allocates it again)
        self.sleep_level: int | None = None  # 1 or 2 while asleep (see sleep)
        self._host_weights: HostWeights | None = None  # level 1 on CUDA: the weights, in pinned host memory
        self._emulated_graphs = False  # asleep: the decode graphs before were emulated (CPU tests)
        self._load_model(progress)

    def _load_model(self, progress: LoadProgress | None) -> None:
        """The model (and draft model) from the files, and what is built over it."""
        settings, device, dtype = self.settings, self.device, self.dtype
        # CUDA: what the device held before our weights (profile_kv_budget's baseline).
        self._cuda_before_load: tuple[int, int, int] | None = None  # free, allocated, reserved
        if device.type == "cuda":
            # Garbage from an earlier engine in this process (a reference cycle holding its
            # tensors) would otherwise be freed during the load and make the weights'
            # allocator difference come out short, even negative.
            gc.collect()
            torch.cuda.empty_cache()
            self._cuda_before_load = (torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device),
                                      torch.cuda.memory_reserved(device))
        self.model = load_model(self.model_dir, dtype, device, settings.max_model_len, self.rank, self.world_size,
                                self.attention_backend, progress, dequantize=settings.dequantize,
                                int8_activations=settings.cpu_int8_activations)
        if getattr(self.model, "kv_amax", None) is not None and self.kv_format is None and self.rank == 0:
            logger.info("the checkpoint has per-layer K/V cache scales: kv_cache_dtype fp8 or int8 uses them "
                        "(kv_cache_dtype %s keeps K/V unquantized)", settings.kv_cache_dtype)
        self.vocab_size = self.model.config.vocab_size
        self.workspace = GatherWorkspace()
        self.attention_metadata = metadata_builder(self.model, self.block_size, device)
        self.batch = InputBatch(self.block_size, device, self.workspace, self.attention_metadata)
        self.drafter: DraftModel | None = None
        if settings.draft_model:
            if self.world_size > 1:
                raise ValueError("a draft model does not run with tensor parallelism yet")
            self.drafter = DraftModel(settings, device, dtype, self.cache_dtype, self.attention_backend, self.sampler,
                                      self.workspace, self.batch)
        self.sampling = SamplingStep(self.model, self.sampler, settings, self.drafter, self.rank, self.world_size)
        self.pooling = PoolingStep(settings.pooling_type)

    def kv_scale_source(self) -> str:
        """Where a quantized KV cache's scales come from: "checkpoint" (its own per-layer
        scales), "calibrated" (a prefill at start, kv_calibration); "" for a float cache."""
        if self.kv_format is None:
            return ""
        return "checkpoint" if getattr(self.model, "kv_amax", None) is not None else "calibrated"

    def weight_bytes(self) -> dict[str, int]:
        """This rank's weight bytes by how they are kept (memory_profile.weight_storage),
        the draft model's included."""
        kinds = weight_storage(self.model)
        if self.drafter is not None:
            for kind, n in weight_storage(self.drafter.model).items():
                kinds[kind] = kinds.get(kind, 0) + n
        return kinds

    # -- KV cache -------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        """Both models' bytes when there is a draft model: its cache has as many blocks."""
        total = model_kv_bytes_per_block(self.model, self.block_size, self.cache_dtype)
        if self.drafter is not None:
            total += self.drafter.kv_cache_bytes_per_block()
        return total

    def profile_kv_budget(self, gpu_memory_utilization: float, extra_reserved_bytes: int = 0) -> MemoryBreakdown:
        """CUDA: the KV cache budget from a profile of the largest step (memory_profile),
        keeping room for the decode graphs when they will be captured."""
        s = self.settings
        graph_batch = 0
        if self._graphs_off_reason() is None:
            graph_batch = capture_sizes(s.max_sampled_rows, s.max_num_batched_tokens)[-1]
        subject = ProfileSubject(self.model, s, self.device, self.cache_dtype, self._cuda_before_load,
                                 self.kv_cache_bytes_per_block(), graph_batch,
                                 None if self.drafter is None else self.drafter.model)
        return profile_kv_budget(subject, gpu_memory_utilization, extra_reserved_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """num_blocks are the block pool's; the cache has one more, the scratch block
        that padded rows of a graph step write and read (the pool never hands it out).
        A quantized cache's scales are set first, once: the checkpoint's or calibrated (kv_calibration)."""
        self.release_decode_graphs()
        self.num_blocks = num_blocks
        self.kv_caches = []
        if self.kv_format is not None:
            if self.kv_scales is None:
                self.kv_scales = kv_scales_for(self.model, self.kv_format, **self._calibration_settings())
            set_kv_scales(self.model, self.kv_scales)  # again after a level-2 wake: the model is a new one
        self.kv_caches = new_model_kv_caches(self.model, num_blocks + 1, self.block_size, self.cache_dtype,
                                             self.device)
        if self.drafter is not None:  # the same blocks as the target's, scratch included
            self.drafter.initialize_kv_cache(num_blocks + 1, self.kv_format, self._calibration_settings())
        if self._decode_graphs_wanted():
            self.init_decode_graphs()

    def _calibration_settings(self) -> dict:
        s = self.settings
        return dict(block_size=s.block_size, max_tokens=min(s.max_model_len, s.max_num_batched_tokens),
                    vocab_size=s.valid_vocab_size, dtype=self.dtype, device=self.device)

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
        # A verify step runs 1 + k decode rows per request (input_batch): sizes up to every sequence verifying.
        sizes = capture_sizes(self.settings.max_sampled_rows, self.settings.max_num_batched_tokens)

        def make() -> DecodeGraphs:
            return DecodeGraphs(self.model, self.kv_caches, sizes, self.block_size, self.settings.max_model_len,
                                self.scratch_block, self.attention_metadata, self.device, self.workspace,
                                emulate=emulate, sampling=self._graph_sampler(max(sizes)))

        self.decode_graphs = make() if emulate else build_decode_graphs(make, self.device)
        if self.drafter is not None:
            self.drafter.init_decode_graphs(sizes, emulate=emulate)

    def _graph_sampler(self, max_batch: int) -> GraphSampler | None:
        """The in-graph sampler of the decode graphs (graph_sampler), where this runner
        samples alone and nothing reads the tokens in the step: no draft model (it drafts
        from the step's tokens on the host), one rank; not with LLMD_GRAPH_SAMPLING=0."""
        if self.drafter is not None or self.world_size > 1 or not graph_sampling_enabled():
            return None
        return GraphSampler(self.sampler, self.settings.valid_vocab_size, max_batch, self.device)

    def release_decode_graphs(self) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        if self.drafter is not None:
            self.drafter.release_decode_graphs()

    def release_kv_cache(self) -> None:
        self._last = None
        self.release_decode_graphs()
        self.kv_caches = []
        if self.drafter is not None:
            self.drafter.kv_caches = []

    # -- sleep mode -----------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Give memory back while the model is idle (no request in the batch may run
        until wake_up). Every level frees the KV cache, the decode graphs and the gather
        workspace. Level 1 keeps the weights: on CUDA copied to pinned host memory (the
        device's freed), on CPU where they are (host memory already). Level 2 drops them
        (wake_up loads them from the files again). A model asleep at level 1 asked for
        level 2 drops its host copies; asked for level 1 at level 2 it stays at 2."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level is not None and self.sleep_level >= level:
            return
        if self.sleep_level is None:  # wake_up builds the graphs again as they were
            self._emulated_graphs = self.decode_graphs is not None and self.decode_graphs.emulate
        self.release_kv_cache()
        self.workspace.release()
        if level == 1 and self.device.type == "cuda":
            models = [self.model] + ([self.drafter.model] if self.drafter is not None else [])
            self._host_weights = HostWeights(models, pin=True)
        if level == 2:
            self._host_weights = None
            self.model = self.drafter = self.sampling = self.batch = self.attention_metadata = None
        self.sleep_level = level
        free_released_memory(self.device)

    def wake_up(self) -> None:
        """Back to serving as before sleep: the weights restored (level 1) or loaded
        again (level 2), the KV cache allocated at its size, the decode graphs captured
        over it. The prefix cache's blocks are gone: the scheduler forgets them."""
        if self.sleep_level is None:
            return
        if self.sleep_level == 2:
            self._load_model(None)
        elif self._host_weights is not None:
            self._host_weights.restore(self.device)
            self._host_weights = None
        self.sleep_level = None
        self.initialize_kv_cache(self.num_blocks)  # on CUDA the decode graphs are captured again over it
        if self._emulated_graphs and self.decode_graphs is None:
            self.init_decode_graphs(emulate=True)  # as tests on the CPU had them

    # -- one step -------------------------------------------------------------------
    def _apply_scheduler_output(self, so: SchedulerOutput) -> None:
        self.batch.apply(so)
        if self.drafter is not None:
            self.drafter.forget(so.finished_req_ids)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar: GrammarRows | None = None) -> StepHandle:
        """Launch one step (`grammar`: its guided requests' rows, waited for just before
        sampling); its handle gives the RunnerOutput (StepHandle.output). When
        the step before is still pending (its tokens on the device: nobody asked for its
        output yet), this step's decode rows read those tokens there, so the device goes
        from one step to the next while the host reads the earlier one's. A step that
        cannot go that way (drafts to verify, a draft model, tensor parallelism) has the
        earlier step's tokens read first, and comes back complete."""
        prev, self._last = self._last, None
        defer = self._can_defer(so)
        if prev is not None and prev.pending and not defer:
            prev.output()
        chain = prev if prev is not None and prev.pending else None
        result = self._execute(so, grammar, chain, defer)
        handle = result if isinstance(result, StepHandle) else StepHandle(result)
        handle.before = chain
        self._last = handle
        return handle

    def _can_defer(self, so: SchedulerOutput) -> bool:
        """Whether this step's tokens may stay on the device: one rank (no token
        broadcast), no draft model (it drafts from the host tokens), no drafts to verify."""
        return self.world_size == 1 and self.drafter is None and not so.scheduled_spec_decode_tokens

    def _execute(self, so: SchedulerOutput, grammar: GrammarRows | None, chain: StepHandle | None,
                 defer: bool) -> RunnerOutput | StepHandle:
        """One step: the forward (a decode graph's replay when every row is a plain
        decode), then _finish_step. `chain`: the step before, its tokens on the device."""
        self._apply_scheduler_output(so)
        if not so.num_scheduled_tokens:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        rows = self.batch.prepare(so, chain)
        if rows.fits_graph(self.decode_graphs):
            sampled = self._sample_in_graph(so, rows, chain, defer)
            if sampled is not None:
                return sampled
            hidden = self.decode_graphs.run(rows.input_ids, rows.positions, rows.slots, rows.seq_lens, rows.tables,
                                            fix=rows.fix)
            if self.drafter is not None:
                self.drafter.forward_decode_rows(rows.input_ids, rows.positions, rows.slots, rows.seq_lens,
                                                 rows.tables, rows.fix)
        else:
            ids_t, pos_t, md = self.batch.eager_inputs(rows)
            hidden = self.model(ids_t, pos_t, self.kv_caches, md)
            if self.drafter is not None:
                self.drafter.forward(ids_t, pos_t, md)
        return self._finish_step(so, grammar, hidden, rows, chain, defer)

    def _sample_in_graph(self, so: SchedulerOutput, rows: StepRows, chain: StepHandle | None,
                         defer: bool) -> RunnerOutput | StepHandle | None:
        """A graph step whose graph samples too: the forward's graph and its sampling tail
        replayed, the tokens copied to pinned memory behind an event (and, with `defer`,
        left there for the next step). None when a row needs the eager sampler or no tail
        fits the batch: the caller then replays the forward graph alone."""
        graphs = self.decode_graphs
        if graphs.sampling is None:
            return None
        plan = plan_graph_sampling(so, rows.decodes, chain, self.settings.eos_token_id, graphs.sampling.vocab_limit)
        if plan is None or (plan.variant == PENALIZED and not graphs.enable_penalties()) \
                or not graphs.has_tail(graphs.padded_size(len(rows.input_ids)), plan.variant):
            return None
        sample_reqs = rows.advance(so.scheduled_spec_decode_tokens).reqs
        tokens = graphs.run(rows.input_ids, rows.positions, rows.slots, rows.seq_lens, rows.tables, fix=rows.fix,
                            sample=plan)
        handle = self.sampling.graph_step(self._new_output(), [r for r, _ in rows.ordered], sample_reqs,
                                          {r.req.req_id: r.row for r in plan.rows}, tokens, graphs.sampling)
        return handle if defer else handle.output()

    def _new_output(self) -> RunnerOutput:
        out = RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs={}, prompt_logprobs={})
        if self.device.type == "cuda":
            out.device_memory_bytes = torch.cuda.memory_reserved(self.device)
        return out

    def _finish_step(self, so: SchedulerOutput, grammar: GrammarRows | None, hidden: torch.Tensor, rows: StepRows,
                     chain: StepHandle | None = None, defer: bool = False) -> RunnerOutput | StepHandle:
        """Logits of the rows that sample (and prompt logprobs), the pooling requests'
        pooled states, sampling, bookkeeping, then the draft model's proposals. With `defer`, the sampled tokens stay on the
        device (see StepHandle)."""
        plan = rows.advance(so.scheduled_spec_decode_tokens)
        out = self._new_output()
        for req, row0, first, count in plan.prompt_logprobs:
            out.prompt_logprobs[req.req_id] = self.sampling.prompt_logprobs(hidden, req, row0, first, count)
        if plan.pooling:
            out.pooled = self.pooling.pool(hidden, plan.pooling)
        ordered = [r for r, _ in rows.ordered]
        sampled: list[list[int]] = []
        if plan.reqs:
            logits = self.sampling.logits(hidden, plan.rows, self.sampling.argmax_rows(plan.reqs, plan.drafts))
            if defer:
                return self.sampling.sample_deferred(so, grammar, logits, plan.reqs, ordered, out, chain)
            sampled = self.sampling.sample(so, grammar, logits, plan.reqs, plan.drafts, out)
        record_sampled(out, ordered, plan.reqs, sampled)
        if self.drafter is not None:
            # A request that sampled has used (or dropped) its proposal: only new ones count.
            self.drafter.forget([r.req_id for r in plan.reqs])
            if so.draft_max_num_tokens:
                out.draft_token_ids = self.drafter.propose(plan.reqs, so.draft_max_num_tokens)
        return out
