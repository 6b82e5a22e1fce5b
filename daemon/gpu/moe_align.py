"""The fused MoE kernel's work list: (token, expert) pairs grouped by expert, each
expert's run padded to the kernel's row block (vLLM's `moe_align_block_size`, here in
torch ops that need no host sync, so a CUDA graph can capture them)."""
from __future__ import annotations

import torch


def padded_capacity(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Rows of the sorted-id buffer for `num_pairs` (token, expert) pairs: each expert
    that gets any pads its run by at most block_size - 1, and at most
    min(num_pairs, num_experts) experts get any. A function of the batch size alone."""
    worst = num_pairs + min(num_pairs, num_experts) * (block_size - 1)
    return -(-worst // block_size) * block_size


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel's work list, computed on the device without a host sync:

    - sorted_ids [padded_capacity] int64: pair indices (t * top_k + k) grouped by expert,
      each expert's run starting at a multiple of block_size; padding holds num_pairs
      (no pair: the kernel masks it);
    - expert_ids [padded_capacity // block_size] int64: the expert of each row block
      (blocks past the last run repeat the last expert; the kernel skips them);
    - num_padded [1] int64: where the last run's padding ends.

    Within an expert, pairs keep their order (a stable sort), so a token's rows come
    in the same order on every run."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    capacity = padded_capacity(num_pairs, num_experts, block_size)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded_counts, 0)
    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (padded_end - padded_counts)[sorted_experts] + rank_in_expert
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, order)
    block_starts = torch.arange(0, capacity, block_size, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids, padded_end[-1:]
