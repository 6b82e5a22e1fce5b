"""Tensor parallelism (Megatron-style) for the decoder models: how one rank's share is
laid out (TPShape). The layers that hold the shares and load them are in linear.py; with
one rank they make no distributed call at all.

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

An intermediate dimension (a dense MLP's, the experts', the shared expert's: each a
`role`) is split in equal shares unless its down projection is kept packed in blocks
the equal share would cut (`units`: a GGUF's K-quants are 256 weights wide; Qwen3-30B-A3B's
experts are 768 wide, 384 a rank at TP=2): then each rank takes whole blocks, as even as
they go (768 over 2 ranks: 512 and 256). Every rank computes the same shares; the gate /
up rows and the down columns of a rank are the same range, so the all-reduce of down's
partial sums is the layer's output whatever the split. A rank that would get no block is
refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TPShape:
    """How one rank's share of an attention block and MLP is laid out."""

    rank: int
    world_size: int
    num_heads: int  # this rank's q heads
    num_kv_heads: int  # this rank's kv heads
    kv_head_start: int  # the first global kv head this rank holds
    vocab_per_rank: int  # rows of this rank's embedding / LM head (the last may be padding)
    vocab_start: int
    vocab_end: int  # exclusive, <= vocab_size
    units: tuple[tuple[str, int], ...] = ()  # (role, columns) a share of that role must be a multiple of

    def share(self, role: str | None, size: int) -> tuple[int, int]:
        """This rank's [start, end) of an intermediate dimension of `size` whose role is
        `role` (module doc; None: equal shares)."""
        return split_share(size, self.rank, self.world_size, dict(self.units).get(role, 1) if role else 1, role)


def split_share(size: int, rank: int, world_size: int, unit: int = 1, role: str | None = None) -> tuple[int, int]:
    """Rank `rank`'s [start, end) of `size` columns split over `world_size` ranks in whole
    `unit`s: equal shares where they hold whole units, else the units as even as they go
    (the first ranks one more); a ValueError if a rank would get none."""
    if size % (world_size * unit) == 0:
        per = size // world_size
        return rank * per, (rank + 1) * per
    units, extra = divmod(size // unit, world_size)
    if size % unit or units == 0:
        raise ValueError(f"tensor_parallel_size {world_size} cannot split the {role or 'intermediate'} dimension "
                         f"({size}) in whole blocks of {unit} weights, the width of its packed down projection's "
                         "blocks (dequantize=True (--dequantize) loads it dense)")
    start = (rank * units + min(rank, extra)) * unit
    return start, start + (units + (rank < extra)) * unit


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


def tp_shape(config: Any, rank: int, world_size: int, units: dict[str, int] | None = None) -> TPShape:
    """Rank `rank`'s share; `units`: role -> the columns its intermediate shares must be
    a multiple of (module doc)."""
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
                   vocab_per_rank=per, vocab_start=start,
                   vocab_end=min(start + per, config.vocab_size), units=tuple(sorted((units or {}).items())))
