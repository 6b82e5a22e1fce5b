"""CUDA graphs for decode steps.

A decode step launches a few kernels per layer, each doing little work: at small batch
sizes the GPU waits on Python and the launch queue. Replaying a captured graph launches
the whole forward at once. After the KV cache exists the runner captures the model's
decode forward (hidden states after the final norm) for a set of batch sizes, all
graphs sharing one memory pool (captured largest first, so the smaller ones reuse its
blocks), over static input buffers; a step whose rows are all plain decodes pads its
batch to the next captured size and replays that graph.

The LM head and sampling stay out of the graph: the sampler is driven from the host
(per-request parameters, grammar bitmasks, the tokens read back), the logits GEMM then
runs on the real rows only (the vocab-wide GEMM is the largest per-row cost, padded rows
would waste it), and the logits of a row come from the same GEMM shape as in an eager
step.

Padded rows never touch real KV: the cache has one scratch block past the blocks the
block pool manages (the pool never hands it out). A padded row is token 0 at position 0
with seq_len 1, its slot and its whole block table in the scratch block, so it writes
and reads only there (every padded row writes the same K/V into the same slot).

All int inputs of a step (ids, positions, slots, seq lens, block table) are staged in
one pinned host buffer and go to the device in one non-blocking copy. The layout is
per padded size b: [ids b | positions b | slots b | seq lens b | table b x width], so
a step copies only its own prefix; each size's graph reads views at those offsets of
one static device buffer.

`emulate=True` runs the same path (buffers, padding, scratch block) but calls the
forward instead of replaying a graph: that is how CPU tests check it.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from llmd.gpu.attention import AttentionMetadata, GatherWorkspace, build_decode_mask

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
                 max_model_len: int, scratch_block: int, attention_backend: str, device: torch.device,
                 workspace: GatherWorkspace | None = None, emulate: bool = False) -> None:
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
        # The torch backend builds its decode mask from the table; the kernels need none.
        self.needs_mask = attention_backend == "torch"
        numel = self.max_batch * (4 + self.width)
        pin = device.type == "cuda"
        self.staging = torch.zeros(numel, dtype=torch.int64, pin_memory=pin)
        self._staging_np = self.staging.numpy()
        self.static = torch.zeros(numel, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._copied: torch.cuda.Event | None = None  # the last step's copy out of staging
        self.num_replays = 0
        self.padded_sizes: dict[int, int] = {}  # padded size -> steps run at it (tests, stats)

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

    def _stage(self, b: int, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
               tables: list[list[int]]) -> int:
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
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
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
        if self.needs_mask:
            build_decode_mask(md, self.block_size)
        return self.model(ids, positions, self.kv_caches, md)

    # -- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up every size (Triton compiles its kernels, the backend caches what it
        asks the device once), then capture them largest first into one pool. The
        warm-up inputs are all padding rows, so only the scratch block is written; a
        capture runs nothing, and every replay stages its own inputs first."""
        if self.emulate:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                count = self._stage(b, [], [], [], [], [])
                self.static[:count].copy_(self.staging[:count])  # blocking: staging is reused next size
                self._forward(b)
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

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    # -- one step -----------------------------------------------------------------------------
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]], fix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of the n real decode rows (n <= max_batch). With real
        graphs the result is a view of the graph's output: valid until the next run.
        `fix` (rows, ids on the device) overwrites those rows' input ids after the copy
        in: tokens a chained step before this one sampled and the host does not have yet."""
        n = len(input_ids)
        b = self.padded_size(n)
        if b is None:
            raise ValueError(f"{n} decode rows exceed the largest captured batch {self.max_batch}")
        self._copy_in(self._stage(b, input_ids, positions, slots, seq_lens, tables))
        if fix is not None:
            self._views(b)[0].index_copy_(0, *fix)
        self.num_replays += 1
        self.padded_sizes[b] = self.padded_sizes.get(b, 0) + 1
        if self.emulate:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        return self.outputs[b][:n]


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
