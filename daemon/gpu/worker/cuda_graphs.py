"""CUDA graphs for decode steps.

A decode step launches a few kernels per layer, each doing little work: at small batch
sizes the GPU waits on Python and the launch queue. Replaying a captured graph launches
the whole forward at once. After the KV cache exists the runner captures the model's
decode forward (hidden states after the final norm) for a set of batch sizes, all
graphs sharing one memory pool (captured largest first, so the smaller ones reuse its
blocks), over static input buffers; a step whose rows are all plain decodes pads its
batch to the next captured size and replays that graph.

With a GraphSampler (graph_sampler) each size also has "tail" graphs, replayed right
after the forward's: the LM head over the padded batch and sampling (greedy, or the
general sampler), writing the tokens into a static buffer that is copied once to pinned
memory. The tails are captured after every forward graph, into the same pool (each
reads its size's forward output, which stays alive); a tail that fails to capture turns
in-graph sampling off and leaves the forward graphs. A step whose rows need the eager
sampler (logprobs, seeds, grammars; see graph_sampling_plan) replays the forward graph
only, and the LM head then runs on the real rows.

Padded rows never touch real KV: the cache has one scratch block past the blocks the
block pool manages (the pool never hands it out). A padded row is token 0 at position 0
with seq_len 1, its slot and its whole block table in the scratch block, so it writes
and reads only there (every padded row writes the same K/V into the same slot).

All int inputs of a step (ids, positions, slots, seq lens, block table, and the rows'
sampling parameters) are staged in one pinned host buffer and go to the device in one
non-blocking copy. The layout is per padded size b: [ids b | positions b | slots b |
seq lens b | table b x width | sampling b x WORDS_PER_ROW], so a step copies only its
own prefix (a step sampling eagerly or greedily stops before the sampling words); each
size's graphs read views at those offsets of one static device buffer.

`emulate=True` runs the same path (buffers, padding, scratch block, staged sampling
parameters) but calls the forward and the tail instead of replaying graphs: that is how
CPU tests check it.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from llmd.gpu.layers.attention import AttentionMetadata, GatherWorkspace, MetadataBuilder, pad_tables
from llmd.gpu.sample.graph_sampler import GREEDY, PENALIZED, SAMPLE, WORDS_PER_ROW, GraphSampler, RowParams, tail_fits
from llmd.gpu.worker.graph_sampling_plan import GraphSamplingPlan

logger = logging.getLogger("llmd.cuda_graphs")

MAX_GRAPH_BATCH = 512


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int | None = None) -> list[int]:
    """1, 2, 4, then multiples of 8 up to min(max_num_seqs, max_num_batched_tokens, 512):
    no step can hold more decode rows than either limit."""
    top = min(max_num_seqs, max_num_batched_tokens or max_num_seqs, MAX_GRAPH_BATCH)
    return [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))


class DecodeGraphs:
    """Static buffers and one graph per batch size for the decode forward of `model`
    over `kv_caches` (whose last block, `scratch_block`, is the padded rows')."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], sizes: list[int], block_size: int,
                 max_model_len: int, scratch_block: int, metadata: MetadataBuilder, device: torch.device,
                 workspace: GatherWorkspace | None = None, emulate: bool = False,
                 sampling: GraphSampler | None = None) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)  # table columns: blocks for max_model_len
        self.scratch_block = scratch_block
        self.device = device
        self.workspace = workspace
        self.emulate = emulate
        self.metadata = metadata  # the backend's builder: in the captured forward, before the model
        self.sampling = sampling  # None: the graphs end at the hidden states
        self.penalties_off = False  # set when the penalty tables found no room
        numel = self.max_batch * (4 + self.width + (WORDS_PER_ROW if sampling is not None else 0))
        pin = device.type == "cuda"
        self.staging = torch.zeros(numel, dtype=torch.int64, pin_memory=pin)
        self._staging_np = self.staging.numpy()
        self.static = torch.zeros(numel, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.tails: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}  # (size, variant) -> its tail
        self.pool = None
        self._copied: torch.cuda.Event | None = None  # the last step's copy out of staging
        self.num_replays = 0
        self.padded_sizes: dict[int, int] = {}  # padded size -> steps run at it (tests, stats)
        self.sampled_steps: dict[str, int] = {}  # tail variant -> steps that sampled in the graph

    # -- sizes and buffers --------------------------------------------------------------
    def padded_size(self, num_rows: int) -> int | None:
        """The smallest captured size holding num_rows rows; None when none does."""
        for b in self.sizes:
            if b >= num_rows:
                return b
        return None

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        s = self.static
        return s[0:b], s[b:2 * b], s[2 * b:3 * b], s[3 * b:4 * b], s[4 * b:4 * b + b * self.width].view(b, self.width)

    def _sampling_params(self, b: int, buffer: torch.Tensor) -> RowParams:
        """Size b's sampling parameters in `buffer` (the staging buffer or the static one)."""
        start = b * (4 + self.width)
        return RowParams.of(buffer[start:start + b * WORDS_PER_ROW], b)

    def has_tail(self, b: int, variant: str) -> bool:
        """Whether a step padded to b can sample with `variant` inside the graph."""
        if self.sampling is None or (variant == PENALIZED and self.sampling.penalties is None):
            return False
        if self.emulate:
            return tail_fits(variant, b, self.sampling.vocab_limit)
        return (b, variant) in self.tails

    def _stage(self, b: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
               tables: np.ndarray | list[list[int]]) -> int:
        """Write size b's inputs into the pinned buffer (real rows, then padded rows);
        returns how many elements the step copies."""
        n = len(input_ids)
        if self._copied is not None:
            # The last copy out of the pinned buffer must be done before it is rewritten
            # (a step that samples nothing never waited on the device).
            self._copied.synchronize()
        buf = self._staging_np
        scratch_slot = self.scratch_block * self.block_size
        for i, (values, pad) in enumerate(((input_ids, 0), (positions, 0), (slots, scratch_slot), (seq_lens, 1))):
            buf[i * b:i * b + n] = values
            buf[i * b + n:(i + 1) * b] = pad
        table = buf[4 * b:4 * b + b * self.width].reshape(b, self.width)
        table.fill(self.scratch_block)  # columns past a row's context are never attended
        if isinstance(tables, list):  # one list per row
            tables = pad_tables(tables)
        table[:n, :tables.shape[1]] = tables
        return 4 * b + b * self.width

    def _copy_in(self, count: int) -> None:
        """One non-blocking copy from pinned memory (asynchronous to the host on CUDA)."""
        self.static[:count].copy_(self.staging[:count], non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def _forward(self, b: int) -> torch.Tensor:
        ids, positions, slots, seq_lens, table = self._views(b)
        md = AttentionMetadata(slot_mapping=slots, num_decodes=b, decode_block_table=table, decode_seq_lens=seq_lens,
                               prefills=[], workspace=self.workspace)
        self.metadata.build(md)
        return self.model(ids, positions, self.kv_caches, md)

    def _tail(self, b: int, variant: str, params: RowParams | None = None, out: torch.Tensor | None = None) -> None:
        """What a tail graph captures: the LM head on size b's forward output and the
        sampler, into the static token buffer (or `out`, with `params`: a warm-up)."""
        hidden = self.outputs[b]
        self.sampling.tail(variant, self.model.compute_logits(hidden),
                           params if params is not None else self._sampling_params(b, self.static),
                           out if out is not None else self.sampling.tokens[:b])

    # -- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, sizes: Iterable[int]) -> None:
        """One forward of each size on padding rows alone (they write the scratch block
        only): capture's warm-up, also run emulated by the tests."""
        for b in sizes:
            count = self._stage(b, [], [], [], [], [])
            self.static[:count].copy_(self.staging[:count])  # blocking: staging is reused next size
            self._forward(b)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up every size (Triton compiles its kernels, the backend caches what it
        asks the device once), then capture them largest first into one pool. The
        warm-up inputs are all padding rows, so only the scratch block is written; a
        capture runs nothing, and every replay stages its own inputs first. Then the
        sampling tails (capture_tails)."""
        if self.emulate:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.warm_up(reversed(self.sizes))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's activations are not the pool's
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        if self.sampling is not None:
            self.capture_tails((GREEDY, SAMPLE))

    def capture_tails(self, variants: tuple[str, ...]) -> bool:
        """Capture `variants`' tails for the sizes their budget allows (after a warm-up
        on neutral parameters into a throwaway buffer: live tokens and tables keep their
        values). A failure drops in-graph sampling: False, with a warning."""
        sizes = [(b, v) for b in reversed(self.sizes) for v in variants if tail_fits(v, b, self.sampling.vocab_limit)]
        try:
            for b, _ in sizes:
                self.sampling.prepare_size(b)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for b, variant in sizes:
                    neutral = self.sampling.neutral_params(b)
                    self._tail(b, variant, neutral, torch.empty(b, dtype=torch.int64, device=self.device))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for b, variant in sizes:
                graph = torch.cuda.CUDAGraph()
                if variant != GREEDY:
                    graph.register_generator_state(self.sampling.generator())
                with torch.cuda.graph(graph, pool=self.pool):
                    self._tail(b, variant)
                self.tails[(b, variant)] = graph
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            self.tails.clear()
            self.sampling = None
            logger.warning("CUDA graphs: sampling tails failed to capture (%s: %s); decode graphs sample eagerly",
                           type(exc).__name__, exc)
            return False
        logger.info("CUDA graphs: captured %d sampling tails (%s)", len(sizes), ", ".join(variants))
        return True

    def enable_penalties(self) -> bool:
        """Make the penalty tables and capture the PENALIZED tails, the first time a
        graph step has a penalized row; False when either fails (penalized steps then
        sample eagerly)."""
        if self.sampling is None or self.penalties_off:
            return False
        if self.sampling.penalties is None:
            try:
                self.sampling.enable_penalties()
            except torch.OutOfMemoryError as exc:
                self.penalties_off = True
                logger.warning("CUDA graphs: no room for penalty tables (%s); penalized steps sample eagerly", exc)
                return False
            if not self.emulate:
                return self.capture_tails((PENALIZED,))
        return True

    def release(self) -> None:
        self.graphs.clear()
        self.tails.clear()
        self.outputs.clear()
        self.pool = None

    # -- one step -----------------------------------------------------------------------------
    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            tables: np.ndarray | list[list[int]], fix: tuple[torch.Tensor, torch.Tensor] | None = None,
            sample: GraphSamplingPlan | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of the n real decode rows (n <= max_batch). With real
        graphs the result is a view of the graph's output: valid until the next run.
        `fix` (rows, ids on the device) overwrites those rows' input ids after the copy
        in: tokens a pending step before this one sampled and the host does not have yet.
        With `sample` (has_tail must be true for it) the tail samples too, and the result
        is the tokens [b] of the padded batch (a view of the static token buffer, valid
        until the next sampling run; the real rows' tokens come first)."""
        n = len(input_ids)
        b = self.padded_size(n)
        if b is None:
            raise ValueError(f"{n} decode rows exceed the largest captured batch {self.max_batch}")
        count = self._stage(b, input_ids, positions, slots, seq_lens, tables)
        if sample is not None and sample.variant != GREEDY:
            sample.stage(self._sampling_params(b, self.staging))
            count += b * WORDS_PER_ROW
        self._copy_in(count)
        if fix is not None:
            self._views(b)[0].index_copy_(0, *fix)
        self.num_replays += 1
        self.padded_sizes[b] = self.padded_sizes.get(b, 0) + 1
        if sample is not None:
            self._before_tail(sample)
        if self.emulate:
            self.outputs[b] = self._forward(b)
        else:
            self.graphs[b].replay()
        if sample is None:
            return self.outputs[b][:n]
        if self.emulate:
            self._tail(b, sample.variant)
        else:
            self.tails[(b, sample.variant)].replay()
        return self.sampling.tokens[:b]

    def _before_tail(self, sample: GraphSamplingPlan) -> None:
        """Bring the penalty tables up to date for a PENALIZED tail (and count what it
        will add); tally the variant."""
        self.sampled_steps[sample.variant] = self.sampled_steps.get(sample.variant, 0) + 1
        if sample.variant != PENALIZED:
            return
        rows = [r for r in sample.rows if r.penalized]
        self.sampling.penalties.refresh([(r.row, r.req, r.in_flight) for r in rows], sample.in_flight)
        self.sampling.penalties.sampled([(r.row, r.req.req_id) for r in rows])


def build_decode_graphs(make: Callable[[], DecodeGraphs], device: torch.device) -> DecodeGraphs | None:
    """Capture (timing it and measuring the pool); on any failure free what capture made,
    log a warning naming the cause and return None: the runner then runs eagerly."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # so the difference below is the buffers and the pool
    before = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    graphs = None
    try:
        graphs = make()
        graphs.capture()
    except Exception as exc:
        cause = f"{type(exc).__name__}: {exc}"
        if graphs is not None:
            graphs.release()
    else:
        logger.info("CUDA graphs: captured %d decode graphs (batch sizes %d..%d) in %.2f s; graph pool %.1f MiB",
                    len(graphs.graphs), graphs.sizes[0], graphs.max_batch, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(device) - before) / 2**20)
        return graphs
    # Out of the except block: the traceback no longer holds the capture's frames (and
    # through them the buffers and the pool), so their memory can go back.
    graphs = None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", cause)
    return None
