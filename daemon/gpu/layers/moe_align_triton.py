"""moe_align.moe_align_block_size's work list in one Triton launch (a decode step's MoE
layer otherwise spends ~12 small torch kernels on it, more than the experts' own matmul
at a few tokens: docs/benchmarks.md, the H200's packed experts). One program does it all,
so nothing needs a grid-wide sync or a host round trip, and a CUDA graph captures it:

1. each expert's pairs counted (a one-hot [C, E] tile per chunk of C pairs, summed down);
2. each expert's run padded to the block and its start (an exclusive scan over experts);
3. sorted_ids filled with the padding value, then (after a barrier: the same addresses)
   each pair written at its expert's start plus how many earlier pairs chose the same
   expert (the one-hot tile's running scan down the pairs, plus the chunks before);
4. each row block's expert: how many runs end at or before its first row (searchsorted),
   the last expert past the last run.

The same integers as the torch ops, in the same order (tests/moe_align_cases.py). The
chunks loop inside the one program, so its time grows with the pairs: moe_align uses it
up to TRITON_MAX_PAIRS (every decode graph's batch) and the torch ops above."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32  # pairs a one-hot tile holds
FILL = 256  # slots of sorted_ids a fill store writes
BLOCKS = 64  # row blocks an expert lookup takes


@triton.jit
def _moe_align_kernel(IDS, SORTED, EXPERT_IDS, NUM_PADDED, num_pairs, capacity, num_experts,
                      BS: tl.constexpr, EP: tl.constexpr, C: tl.constexpr, FILL: tl.constexpr,
                      BLOCKS: tl.constexpr):
    e = tl.arange(0, EP)  # lanes past num_experts count no pair: their runs are empty
    counts = tl.zeros([EP], tl.int32)
    for start in range(0, num_pairs, C):
        i = start + tl.arange(0, C)
        ids = tl.load(IDS + i, mask=i < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BS - 1) // BS * BS
    end = tl.cumsum(padded, axis=0)
    for start in range(0, capacity, FILL):
        j = start + tl.arange(0, FILL)
        tl.store(SORTED + j, tl.zeros([FILL], tl.int64) + num_pairs, mask=j < capacity)
    tl.debug_barrier()  # the fill's stores before the pairs' (some the same slots)
    running = end - padded  # where each expert's next pair goes
    for start in range(0, num_pairs, C):
        i = start + tl.arange(0, C)
        ids = tl.load(IDS + i, mask=i < num_pairs, other=-1).to(tl.int32)
        hits = (ids[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(hits, axis=0) - hits  # earlier pairs of this chunk, per expert
        dest = tl.sum(hits * (running[None, :] + before), axis=1)
        tl.store(SORTED + dest, i.to(tl.int64), mask=i < num_pairs)
        running += tl.sum(hits, axis=0)
    for start in range(0, capacity // BS, BLOCKS):
        b = start + tl.arange(0, BLOCKS)
        expert = tl.sum(((b * BS)[:, None] >= end[None, :]).to(tl.int32), axis=1)
        tl.store(EXPERT_IDS + b, tl.minimum(expert, num_experts - 1).to(tl.int64), mask=b < capacity // BS)
    tl.store(NUM_PADDED, tl.sum(padded).to(tl.int64))


def moe_align_triton(flat: torch.Tensor, block_size: int, num_experts: int,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_block_size's three tensors for the pairs' experts `flat` [pairs] (int32 or
    int64) and a sorted-id buffer of `capacity` rows (padded_capacity)."""
    device = flat.device
    sorted_ids = torch.empty(capacity, dtype=torch.int64, device=device)
    expert_ids = torch.empty(capacity // block_size, dtype=torch.int64, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_padded, flat.numel(), capacity, num_experts,
                            BS=block_size, EP=triton.next_power_of_2(num_experts), C=CHUNK, FILL=FILL,
                            BLOCKS=BLOCKS, num_warps=4)
    return sorted_ids, expert_ids, num_padded
