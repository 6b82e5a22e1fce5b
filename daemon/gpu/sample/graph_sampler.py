"""Sampling inside a captured decode graph: the LM head and the sampler as a graph
"tail" replayed right after the decode forward's graph, writing each row's token into a
static device buffer that is copied once to pinned host memory.

What a tail computes is the eager sampler's own arithmetic (sampler.py), branch-free:
every stage runs on every row with per-row parameters read from static device buffers,
and a stage a row does not use gets neutral values (temperature 1, top-k = vocab,
top-p 1, min-p 0, repetition penalty 1, other penalties 0, min_tokens 0), which leave its
logits exactly as they were. Top-k and top-p use the sort-based rule
(`apply_top_k_top_p_sorted`, what the eager sampler runs on CUDA); min_tokens masks up
to NUM_STOP_IDS stop ids per row; the penalties reuse `apply_penalties` over tables kept
on the device (graph_penalties); the draw is the sampler's exponential race from its
batch generator, which the graph registers (torch's graph-safe RNG: every replay draws
fresh numbers; on CPU the same code draws from the same generator). So a greedy row gets
the eager sampler's token for the same logits (the argmax of the same values, ties to
the lowest id) and a random row a draw from the same distribution, with other random
numbers. The LM head runs over the padded batch, as the forward does: on a GPU a row's
logits come from a GEMM of b rows where an eager step's has n.

On CUDA torch.sort runs CUB's radix sorts; the capture failure reported for some sizes
(NVIDIA/cccl#5661) is in DeviceSegmentedSort, another algorithm, but any tail that fails
to capture turns in-graph sampling off and keeps the forward graphs (capture_tails).

Variants, captured per batch size (after the forward graphs, into their pool):
- GREEDY: LM head and argmax, about two kernels. Greedy serving and most batch-1
  benchmarks take it.
- SAMPLE: min_tokens, temperature, top-k/top-p, min-p and the race, greedy rows taking
  the argmax: one variant with neutral parameters rather than one per filter set (a
  filter costs a few kernels, a variant one capture per size), ~30 kernels, a vocab-wide
  sort among them. Measured emulated on CPU (vocab 32k, one thread, under load) it costs
  90-130x GREEDY at batch 1-64, the sort most of it: greedy steps must not pay it.
- PENALIZED: SAMPLE with the penalties, the sampled tokens added to the counts in the
  graph (+7-15 % over SAMPLE on CPU). Kept apart for memory more than time: its tables
  ([max_batch, vocab], 5 bytes a cell) and graphs are made the first time a graph step
  has a penalized row (graph_penalties), so a server that never sees one holds neither.
A tail is captured only where its rows x vocab fits a budget (GREEDY_TAIL_CELLS,
SAMPLE_TAIL_CELLS): the graph pool holds its logits and, for the sampling variants, the
sort's buffers, private to the pool; larger batches sample eagerly after the forward
graph (their launches are a small share of a large step).

LLMD_GRAPH_SAMPLING=0 (read when a runner captures its graphs) turns the tails off:
every graph step samples eagerly after the forward graph, the A/B switch of the in-graph
sampling's figures (as LLMD_FUSED_OPS is the fused ops').

Per-row parameters are staged by the host (graph_sampling_plan) into the decode graphs'
pinned int64 buffer after the forward's inputs, field by field: NUM_INTS int64 rows,
then the float32 fields packed two to a word, so one non-blocking copy takes all of a
step's inputs to the device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from llmd.gpu.sample.graph_penalties import PenaltyTables
from llmd.gpu.sample.sampler import Sampler, SamplingMetadata, apply_min_tokens, apply_penalties
from llmd.gpu.sample.filters import apply_top_k_top_p_sorted, apply_min_p
from llmd_client.protocol import SamplingParams

GREEDY, SAMPLE, PENALIZED = "greedy", "sample", "penalized"
GRAPH_SAMPLING_ENV = "LLMD_GRAPH_SAMPLING"


def graph_sampling_enabled() -> bool:
    """False when LLMD_GRAPH_SAMPLING is 0/off (the A/B switch), True when unset, 1 or on."""
    value = os.environ.get(GRAPH_SAMPLING_ENV, "").strip().lower()
    if value not in ("", "0", "1", "off", "on"):
        raise ValueError(f"{GRAPH_SAMPLING_ENV} must be 0 or 1 (or off, on), got {value!r}")
    return value not in ("0", "off")

# Budgets of rows x vocab for a captured tail: the greedy tail holds the logits (bf16 and
# float32: 6 bytes a cell, ~100 MB at the cap), the sampling tails the sort's buffers too
# (~32 bytes a cell, ~130 MB at the cap). Vocab 32k: greedy to batch 512, sampling to 128;
# vocab 152k: greedy to 104, sampling to 24.
GREEDY_TAIL_CELLS = 1 << 24
SAMPLE_TAIL_CELLS = 1 << 22

INT_FIELDS = ("top_k", "num_output", "min_tokens_until", "count_weight", "is_greedy")
NUM_STOP_IDS = 4  # min_tokens stop ids per row (EOS and up to three stop_token_ids)
NUM_INTS = len(INT_FIELDS) + NUM_STOP_IDS
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# Values that leave a row's logits as they are (and the ints 0, top_k the vocab size).
NEUTRAL_FLOATS = (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)
WORDS_PER_ROW = NUM_INTS + len(FLOAT_FIELDS) // 2  # int64 words per row in the staging buffer


@dataclass
class RowParams:
    """One padded size's per-row parameters: views of a [WORDS_PER_ROW * b] int64 buffer
    (the static device buffer, the pinned staging buffer, or a warm-up's own)."""

    ints: torch.Tensor  # [NUM_INTS, b] int64: INT_FIELDS, then the stop ids
    floats: torch.Tensor  # [len(FLOAT_FIELDS), b] float32

    @classmethod
    def of(cls, words: torch.Tensor, b: int) -> RowParams:
        return cls(words[:NUM_INTS * b].view(NUM_INTS, b),
                   words[NUM_INTS * b:WORDS_PER_ROW * b].view(torch.float32).view(len(FLOAT_FIELDS), b))

    def fill_neutral(self, vocab: int) -> None:
        """Every row neutral: what a padded row and a row that does not sample get."""
        self.ints.zero_()
        self.ints[INT_FIELDS.index("top_k")] = vocab
        for i, value in enumerate(NEUTRAL_FLOATS):
            self.floats[i] = value

    def int_column(self, name: str) -> torch.Tensor:
        return self.ints[INT_FIELDS.index(name)].view(-1, 1)

    def float_column(self, name: str) -> torch.Tensor:
        return self.floats[FLOAT_FIELDS.index(name)].view(-1, 1)


def tail_fits(variant: str, rows: int, vocab: int) -> bool:
    """Whether `variant` is captured for a padded batch of `rows` (the cell budgets)."""
    return rows * vocab <= (GREEDY_TAIL_CELLS if variant == GREEDY else SAMPLE_TAIL_CELLS)


def tail_pool_bytes(max_batch: int, vocab: int) -> int:
    """Device bytes the sampling tails of decode graphs up to `max_batch` rows may hold
    beside the forward graphs: the greedy and sampling tails' buffers at the largest
    size each is captured for (the cell budgets' bytes per cell), the penalty tables
    (5 bytes a cell, made lazily) and the static per-row buffers. An upper bound for
    the KV sizing (memory_profile), which runs before anything is captured."""
    cells = max_batch * vocab
    tails = min(cells, GREEDY_TAIL_CELLS) * 6 + min(cells, SAMPLE_TAIL_CELLS) * 32
    return tails + cells * 5 + max_batch * (WORDS_PER_ROW + 2) * 8 * 2


class GraphSampler:
    """The device half of in-graph sampling for one set of decode graphs: the static
    token buffer, the pinned buffers the tokens are read back through, the penalty
    tables once made, and the tail each variant captures."""

    def __init__(self, sampler: Sampler, vocab_limit: int, max_batch: int, device: torch.device) -> None:
        self.sampler = sampler
        self.vocab_limit = vocab_limit  # logits are cut to the tokenizer's vocab, as the eager sampler does
        self.max_batch = max_batch
        self.device = device
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        # Two host buffers: with pending steps a step's copy lands while the host still
        # reads the one before it.
        self._host = [torch.zeros(max_batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._ready = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self._next_host = 0
        self.penalties: PenaltyTables | None = None
        self._neutral_md: dict[int, SamplingMetadata] = {}
        self._pair_rows: dict[int, torch.Tensor] = {}

    def generator(self) -> torch.Generator:
        """The generator the race draws from on this device (the sampler's batch
        generator): a graph that samples registers it."""
        return self.sampler.batch_generator(self.device)

    def neutral_params(self, b: int) -> RowParams:
        """Neutral parameters for b rows on the device, apart from the static ones (warm-ups)."""
        params = RowParams.of(torch.empty(b * WORDS_PER_ROW, dtype=torch.int64, device=self.device), b)
        params.fill_neutral(self.vocab_limit)
        return params

    def prepare_size(self, b: int) -> None:
        """What a tail of size b reads besides the parameters, made before its capture:
        the metadata skeleton and the row of each (row, stop id) pair."""
        if b not in self._neutral_md:
            self._neutral_md[b] = SamplingMetadata.build([SamplingParams()] * b, [[]] * b, [[]] * b,
                                                         valid_vocab_size=self.vocab_limit, device=self.device)
            self._pair_rows[b] = torch.arange(b, dtype=torch.int64, device=self.device).repeat(NUM_STOP_IDS)
        self.generator()  # created before a capture registers it

    # -- what a tail graph captures -------------------------------------------------------
    def tail(self, variant: str, logits: torch.Tensor, params: RowParams, out: torch.Tensor) -> None:
        """Tokens of the logits' rows into `out` ([b] int64): no host sync, no branch on
        a tensor's value, shapes fixed by b."""
        logits = logits[:, :self.vocab_limit]
        if variant == GREEDY:
            out.copy_(logits.argmax(dim=-1))
            return
        penalized = variant == PENALIZED
        self.prepare_size(logits.shape[0])  # done before a capture; here for emulated graphs
        md = self._metadata(params, penalized)
        logits = apply_min_tokens(logits.float(), md)
        if penalized:
            logits = apply_penalties(logits, md)
        greedy = logits.argmax(dim=-1)
        filtered = apply_top_k_top_p_sorted(logits / md.temperature, md.top_k, md.top_p)
        probs = apply_min_p(filtered, md.log_min_p).softmax(dim=-1)
        out.copy_(torch.where(md.is_greedy, greedy, self.sampler.race(probs, md)))
        if penalized:
            weight = params.int_column("count_weight").to(torch.float32)
            md.output_counts.scatter_add_(1, out.view(-1, 1), weight)

    def _metadata(self, p: RowParams, penalized: bool) -> SamplingMetadata:
        """The eager sampler's metadata over the static parameters (the stages it reads
        all set; greedy rows chosen per row)."""
        b = p.ints.shape[1]
        tables = {}
        if penalized:
            tables = dict(repetition_penalty=p.float_column("repetition_penalty"),
                          frequency_penalty=p.float_column("frequency_penalty"),
                          presence_penalty=p.float_column("presence_penalty"),
                          prompt_mask=self.penalties.prompt_mask[:b], output_counts=self.penalties.counts[:b])
        return replace(
            self._neutral_md[b], all_random=False, is_greedy=p.ints[INT_FIELDS.index("is_greedy")].bool(),
            temperature=p.float_column("temperature"), top_k=p.int_column("top_k"), top_p=p.float_column("top_p"),
            log_min_p=p.float_column("min_p").log(), min_tokens_rows=self._pair_rows[b],
            min_tokens_ids=p.ints[len(INT_FIELDS):].reshape(-1),
            min_tokens_until=p.ints[INT_FIELDS.index("min_tokens_until")].repeat(NUM_STOP_IDS),
            num_output_tokens_t=p.ints[INT_FIELDS.index("num_output")], **tables)

    # -- tokens back to the host -------------------------------------------------------------
    def read_back(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the copy of `tokens` (a prefix of the static buffer) into a pinned
        buffer; returns it and the event recorded after the copy (None off CUDA, where
        the copy is done on return). The host reads the buffer once, after the event."""
        k = self._next_host
        self._next_host ^= 1
        host = self._host[k][:tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        ready = self._ready[k]
        if ready is not None:
            ready.record()
        return host, ready

    def enable_penalties(self) -> None:
        """Make the penalty tables (the PENALIZED tails read them); raises when the
        device has no room."""
        if self.penalties is None:
            self.penalties = PenaltyTables(self.max_batch, self.vocab_limit, self.device)
