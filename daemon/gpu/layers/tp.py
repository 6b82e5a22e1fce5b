"""Tensor parallelism (Megatron-style) for the decoder models.

Each rank holds a slice of every large weight; the model code picks these layers only
when world_size > 1, so the single-rank path has no distributed calls at all.

* column-parallel linears (fused QKV, fused gate/up) need no communication: each rank
  computes its own heads / its own slice of the intermediate size;
* row-parallel linears (o_proj, down_proj) multiply the rank's input slice and
  all-reduce the partial sums; the bias is added once, after the reduce;
* the embedding is split by vocab rows: a rank looks up the ids in its range, zeros the
  others, and the all-reduce assembles the full rows (sums with zeros: exact);
* the LM head is split by vocab rows too; every rank computes its slice of the logits and
  an all-gather gives every rank the full logits (only rank 0 samples).

KV heads are split like q heads when num_kv_heads >= world_size; when there are fewer
KV heads than ranks they are replicated: rank r uses kv head r * num_kv_heads // world_size
(which is the kv head of all of rank r's q heads, since world_size % num_kv_heads == 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TPShape:
    """How one rank's share of an attention block and MLP is laid out."""

    rank: int
    world_size: int
    num_heads: int  # this rank's q heads
    num_kv_heads: int  # this rank's kv heads
    kv_head_start: int  # the first global kv head this rank holds
    intermediate_size: int  # this rank's slice of the MLP
    vocab_per_rank: int  # rows of this rank's embedding / LM head (the last may be padding)
    vocab_start: int
    vocab_end: int  # exclusive, <= vocab_size


def check_tp_config(config: Any, world_size: int) -> None:
    """Raise ValueError (naming tensor_parallel_size) if the model cannot be split."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's "
                         f"num_attention_heads ({heads})")
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's "
                         f"num_key_value_heads ({kv}) or be a multiple of it")
    # Dense MLPs, and a mixture-of-experts model's experts and shared expert, are all
    # split along their intermediate dimension.
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(config, field, None)
        if size is not None and size % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {field} ({size})")


def tp_shape(config: Any, rank: int, world_size: int) -> TPShape:
    check_tp_config(config, world_size)
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    if kv >= world_size:
        kv_local, kv_start = kv // world_size, rank * (kv // world_size)
    else:
        kv_local, kv_start = 1, rank * kv // world_size
    per = -(-config.vocab_size // world_size)
    start = min(rank * per, config.vocab_size)
    return TPShape(rank=rank, world_size=world_size, num_heads=heads // world_size,
                   num_kv_heads=kv_local, kv_head_start=kv_start,
                   intermediate_size=config.intermediate_size // world_size,
                   vocab_per_rank=per, vocab_start=start,
                   vocab_end=min(start + per, config.vocab_size))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b, with W split along its input dim."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shape: TPShape, hidden_size: int) -> None:
        super().__init__()
        self.start, self.end = shape.vocab_start, shape.vocab_end
        self.weight = nn.Parameter(torch.empty(shape.vocab_per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out)
        return out


class ParallelLMHead(nn.Module):
    """Each rank's vocab rows; forward all-gathers the full logits (width vocab_size)."""

    def __init__(self, shape: TPShape, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.world_size = shape.world_size
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(shape.vocab_per_rank, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def shard_checkpoint_tensor(name: str, sl: Any, shape: TPShape, head_dim: int) -> torch.Tensor:
    """This rank's piece of checkpoint tensor `name`, read from a safetensors slice `sl`
    (only the piece is materialised). `name` is the checkpoint's (HF) name."""
    def rows(a: int, b: int) -> torch.Tensor:
        return sl[a:b]

    def cols(a: int, b: int) -> torch.Tensor:
        return sl[:, a:b]

    r = shape.rank
    if ".q_proj." in name:
        size = shape.num_heads * head_dim
        return rows(r * size, (r + 1) * size)
    if ".k_proj." in name or ".v_proj." in name:
        a = shape.kv_head_start * head_dim
        return rows(a, a + shape.num_kv_heads * head_dim)
    if name.endswith(".o_proj.weight"):
        size = shape.num_heads * head_dim
        return cols(r * size, (r + 1) * size)
    if ".gate_proj." in name or ".up_proj." in name:
        size = shape.intermediate_size
        return rows(r * size, (r + 1) * size)
    if name.endswith(".down_proj.weight"):
        size = shape.intermediate_size
        return cols(r * size, (r + 1) * size)
    if name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight"):
        return rows(shape.vocab_start, shape.vocab_end)
    return sl[:]  # replicated: norms, o_proj/down_proj biases, q/k norms
