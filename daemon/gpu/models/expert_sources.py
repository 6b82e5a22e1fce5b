"""A quantized checkpoint's experts as the loader hands them to mlp.ExpertWeights
(quant_plan.quantized_weights reads them): an AWQ / GPTQ expert's packed GGUF rows with
its input column order (`OrderedPackedSource`), an FP8 expert's e4m3 bytes and scales
(`FP8Source`), each sliced by rows (w13's share under tensor parallelism) or by whole
blocks of columns (w2's).

A GPTQ act-order expert's down projection takes its input columns (the intermediate
dimension) in any group order: sorted by group (int_groups.sorted_by_group) with x's
columns taken in that order, a rank's share of them would hold columns of every group,
any number of each, in blocks that cannot be cut. The intermediate dimension's order is
free, though: gate's and up's rows and down's columns permuted alike compute the same
sums. Where an expert's gate, up and down are all packed, its intermediate dimension is
put in the order down's columns sort into by group (`intermediate_orders`): down's
sorted blocks then take x (act(gate) * up) as it comes, with no input order, a rank's
share of them is whole blocks as for any other expert, and gate's and up's rows come in
that order (their own input orders, over the hidden size, stay). Each product is the
one the sorted columns gave with x taken in their order, value for value, and a rank
keeps no padding. A dense gated MLP is put in its down projection's order alike
(quant_plan._order_intermediate_dims, quant_linear.follow_intermediate_order).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.gguf_quant import PackedSource
from llmd.gpu.layers.quant.int_groups import intermediate_order
from llmd.gpu.layers.quant.scheme import QuantScheme

Parts = dict[tuple[str, int], dict[int | None, str]]


@dataclasses.dataclass
class OrderedPackedSource(PackedSource):
    """An expert's packed rows whose columns were sorted by group (act-order): x's columns
    go in `input_order` (None: as they come)."""

    input_order: torch.Tensor | None = None

    def columns(self, start: int, end: int) -> PackedSource:
        if self.input_order is not None:  # its blocks hold columns from anywhere in the row
            raise ValueError("is GPTQ act-order (desc_act): its weights cannot be split by input columns")
        return super().columns(start, end)


@dataclasses.dataclass
class FP8Source(PackedSource):
    """An FP8 expert's e4m3 bytes (`data`) and its `scales` [rows, groups] (quant/fp8)."""

    scales: torch.Tensor | None = None

    def rows(self, start: int, end: int) -> PackedSource:
        return dataclasses.replace(super().rows(start, end), scales=self.scales[start:end])

    def columns(self, start: int, end: int) -> PackedSource:
        """Its columns [start, end): the bytes, and the scales of whole groups of them."""
        groups = self.scales.shape[1]
        width = self.shape[1] // groups
        if groups > 1 and (start % width or end % width):
            raise ValueError(f"cannot be split at columns {start}:{end}: its scales are per {width} columns")
        scales = self.scales if groups == 1 else self.scales[:, start // width:end // width]
        return FP8Source(self.quant, self.data[:, start:end], (self.shape[0], end - start), scales)


def expert_parts(model: nn.Module, prefixes: Any, checkpoint_target: Any) -> Parts:
    """(experts module, expert) -> {part: checkpoint module} of the quantized expert
    projections among `prefixes` (part 0 gate, 1 up, None down)."""
    parts: Parts = {}
    for prefix in prefixes:
        target = checkpoint_target(model, prefix + ".weight")
        if target is None:
            continue
        module, _, attr = target[0].rpartition(".")
        if attr == "w13":
            parts.setdefault((module, target[1][0]), {})[target[1][1]] = prefix
        elif attr == "w2":
            parts.setdefault((module, target[1]), {})[None] = prefix
    return parts


def split_down_without_its_expert(parts: Parts) -> str | None:
    """The first down projection whose gate or up is not packed beside it (an act-order
    one's intermediate dimension cannot be reordered then: under TP its columns cannot
    be split)."""
    return next((p[None] for p in parts.values() if None in p and len(p) < 3), None)


def intermediate_orders(model: nn.Module, scheme: QuantScheme, experts: Any, checkpoint_target: Any, get: Any,
                        has: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """GPTQ act-order experts whose gate, up and down are all packed: checkpoint module
    -> ("rows", order) for gate and up, ("columns", order) for down, `order` the one down's
    columns sort into by group (module doc, int_groups.intermediate_order); none where it
    is theirs already. `get(name)` reads a checkpoint tensor, `has(name)` says whether
    there is one."""
    if not getattr(scheme, "act_order", False):
        return {}
    orders: dict[str, tuple[str, torch.Tensor]] = {}
    for parts in expert_parts(model, experts, checkpoint_target).values():
        if len(parts) < 3 or not has(f"{parts[None]}.g_idx"):
            continue
        order = intermediate_order(get(f"{parts[None]}.g_idx"))
        if order is not None:  # (groups not whole blocks: expert_blocks refuses the expert by name)
            orders.update({parts[0]: ("rows", order), parts[1]: ("rows", order), parts[None]: ("columns", order)})
    return orders
