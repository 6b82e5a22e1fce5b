"""The fused MoE kernel's work list: (token, expert) pairs grouped by expert, each
expert's run padded to the kernel's row block (vLLM's `moe_align_block_size`): on CUDA up
to TRITON_MAX_PAIRS pairs in one Triton launch (moe_align_triton), else in torch ops;
neither needs a host sync, so a CUDA graph can capture them."""
from __future__ import annotations

import torch


def padded_capacity(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Rows of the sorted-id buffer for `num_pairs` (token, expert) pairs: each expert
    that gets any pads its run by at most block_size - 1, and at most
    min(num_pairs, num_experts) experts get any. A function of the batch size alone."""
    worst = num_pairs + min(num_pairs, num_experts) * (block_size - 1)
    return -(-worst // block_size) * block_size


# Up to this many (pair, expert) cells a pair's rank within its expert comes from a scan
# over a one-hot matrix (comparisons and a cumsum: capturable in a CUDA graph); above it,
# from a stable sort. Every decode graph size fits (512 rows x 8 of 128 experts: 2^19
# cells), so captured steps never sort: torch's CUDA sorts run CUB's, whose capture has
# failed for some sizes (NVIDIA/cccl#5661); large prefill steps run eagerly.
ONE_HOT_CELLS = 1 << 21


def rank_within_expert(flat: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each pair (in pair order), how many earlier pairs chose the same expert
    (`counts`: pairs per expert)."""
    num_pairs, num_experts = flat.numel(), counts.numel()
    if num_pairs * num_experts <= ONE_HOT_CELLS:
        hits = (flat[:, None] == torch.arange(num_experts, device=flat.device)).to(torch.int32)
        return hits.cumsum(0, dtype=torch.int32).gather(1, flat[:, None]).squeeze(1).long() - 1
    order = torch.sort(flat, stable=True).indices
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in sorted order
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(num_pairs, device=flat.device) - first[flat[order]]
    return rank


# Pairs up to which CUDA takes the one-launch kernel: a decode step of 32 tokens at top-8.
# Its one program loops over the pairs in chunks, twice, so past some size ~12 torch
# kernels over the whole GPU are faster; where is not yet measured on a GPU.
TRITON_MAX_PAIRS = 256


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel's work list, computed on the device without a host sync:

    - sorted_ids [padded_capacity] int64: pair indices (t * top_k + k) grouped by expert,
      each expert's run starting at a multiple of block_size, in pair order within it;
      padding holds num_pairs (no pair: the kernel masks it);
    - expert_ids [padded_capacity // block_size] int64: the expert of each row block
      (blocks past the last run repeat the last expert; the kernel skips them);
    - num_padded [1] int64: where the last run's padding ends.

    `use_triton`: the one-launch kernel (None: on CUDA up to TRITON_MAX_PAIRS pairs)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    if use_triton is None:
        use_triton = flat.is_cuda and num_pairs <= TRITON_MAX_PAIRS
    if use_triton:
        from llmd.gpu.layers.moe_align_triton import moe_align_triton

        return moe_align_triton(flat.contiguous(), block_size, num_experts,
                                padded_capacity(num_pairs, num_experts, block_size))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded_counts, 0)
    dest = (padded_end - padded_counts)[flat] + rank_within_expert(flat, counts)
    capacity = padded_capacity(num_pairs, num_experts, block_size)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, torch.arange(num_pairs, device=device))
    block_starts = torch.arange(0, capacity, block_size, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids, padded_end[-1:]
