"""A linear layer's weight loaded from an AWQ, GPTQ or FP8 checkpoint and kept packed.

`use_quantized(layer, scheme, modules)` (before the weights are loaded, after the model
was built) puts a `QuantizedWeights` on the layer as `quant_method`: the loader hands it
the checkpoint tensors its scheme names (`qweight`, `qzeros`, `scales`, `g_idx`; FP8's
`weight`, its scale, `input_scale`), and it keeps this rank's piece of each (the layer's
output rows of each part — q/k/v, gate/up — and with row parallelism its input columns,
read from the file as slices). `finalize(layer)` then turns the pieces into what the
layer multiplies with, part by part (each part of a fused projection has its own scales
and zero points, and may differ in packed type):

* AWQ / GPTQ (int_groups): `weight` the parts' rows in llama.cpp's block formats, one
  after the other (a flat uint8 tensor), multiplied through the GGUF kernels
  (gguf_quant.GGUFMatmul on CPU, cuda_matmul.TritonGGUFMatmul on CUDA) by `IntGroupMatmul`; act-order columns sorted by group, with
  x's columns taken in the same order (`input_order_*`, one per run of parts sharing
  it: q/k/v and gate/up usually do) — but for a down projection whose gated MLP follows
  its group order (`follow_intermediate_order`: gate/up's rows in it, down's sorted
  columns taking x as it comes, no padding under TP);
* FP8 (fp8): `weight` the e4m3 bytes [out, in] and `weight_scales` [out, groups],
  multiplied by fp8.FP8Matmul (on CUDA cuda_matmul.TritonFP8Matmul).

The packed tensors are put on the device the layer's placeholders were moved to.

`quant` is the storage's name in the memory account (`awq-int4`, `gptq-int8`,
`fp8-e4m3`); `quant_tensors` the layer's other tensors counted with it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.gguf_quant import GGUFMatmul, PackedPart, packed_parts
from llmd.gpu.layers.linear import ColumnSplitLinear, RowParallelLinear, Shard, VocabRows, WeightLoading, shape_of
from llmd.gpu.layers.quant.fp8 import FP8Matmul, FP8Rows, fp8_rows, join
from llmd.gpu.layers.quant.int_groups import BLOCK, IntGroups, awq_groups, gptq_groups
from llmd.gpu.layers.quant.scheme import FP8Scheme, IntGroupScheme, QuantScheme


@dataclass(frozen=True)
class Piece:
    """What one checkpoint tensor gives a layer: part `part`'s output rows [out) of the
    tensor (a fused checkpoint tensor: offset by the parts before), input columns [cols)."""

    part: int
    out: tuple[int, int]
    cols: tuple[int, int]


def layer_columns(layer: nn.Module) -> tuple[tuple[int, int], int]:
    """(this rank's input columns of the whole weight, the whole weight's columns)."""
    if isinstance(layer, RowParallelLinear):
        return layer.columns, layer.full_in_features
    return (0, layer.in_features), layer.in_features


def layer_pieces(layer: nn.Module) -> dict[Shard, list[Piece]]:
    """The pieces of each checkpoint shard a layer keeps (None: the whole projection as
    one tensor, fused in the checkpoint or not)."""
    cols, _ = layer_columns(layer)
    if isinstance(layer, VocabRows):  # this rank's vocabulary rows (the padding rows: finalize's)
        return {None: [Piece(0, (layer.start, layer.end), cols)]}
    if not isinstance(layer, ColumnSplitLinear):
        return {None: [Piece(0, (0, layer.out_features), cols)]}
    table: dict[Shard, list[Piece]] = {s: [Piece(i, layer.source_rows(s), cols)] for i, s in enumerate(layer.parts)}
    fused, offset = [], 0
    for i, (shard, full) in enumerate(zip(layer.parts, layer.full_sizes())):
        a, b = layer.source_rows(shard)
        fused.append(Piece(i, (offset + a, offset + b), cols))
        offset += full
    table[None] = fused
    return table


def check_alignment(layer: nn.Module, scheme: QuantScheme, modules: dict[Shard, str]) -> None:
    """ValueError naming the checkpoint module if this rank's share of the layer does not
    fall on the packing's boundaries (or tensor parallelism cuts it elsewhere)."""
    (c, d), _ = layer_columns(layer)
    where = next(iter(modules.values()))
    if isinstance(scheme, IntGroupScheme):
        out_step, col_step = (8 if scheme.method == "awq" else 32 // scheme.bits), BLOCK
    else:
        out_step, col_step = 1, scheme.block[1] if scheme.block else 1
    pieces = layer_pieces(layer)
    rows = [p.out for shard in modules for p in pieces.get(shard, [])]
    split = " (tensor_parallel_size cannot split this checkpoint here)" if getattr(layer, "world_size", 1) > 1 else ""
    for what, spans, step in (("output rows", rows, out_step), ("input columns", [(c, d)], col_step)):
        if any(a % step or b % step for a, b in spans):
            raise ValueError(f"{where}: its {what} do not start and end on multiples of {step} "
                             f"({scheme.label} packing){split}")


class QuantizedWeights(WeightLoading):
    """The loader's side of a quantized layer (module doc): takes the checkpoint tensors
    its scheme names and keeps this rank's pieces until `finalize`."""

    def __init__(self, layer: nn.Module, scheme: QuantScheme, modules: dict[Shard, str]) -> None:
        self.scheme = scheme
        self.pieces = layer_pieces(layer)
        self.parts = len(self.pieces[None]) if isinstance(layer, ColumnSplitLinear) else 1
        self.modules = modules  # checkpoint module of each shard (for messages)
        self.full_columns = layer_columns(layer)[1]
        self.pending: dict[tuple[str, int], torch.Tensor] = {}
        self.loaded: dict[int, Piece] = {}  # the piece each part was read as
        self.intermediate: tuple[str, torch.Tensor, tuple[int, int]] | None = None  # follow_intermediate_order's

    def follow_intermediate_order(self, layer: nn.Module, order: torch.Tensor, share: tuple[int, int]) -> None:
        """A GPTQ act-order gated MLP's intermediate dimension put in `order`, the one its
        down projection's columns sort into by group (models/expert_sources.py; before
        loading): the gate/up layer keeps rows order[share] of each part, the down layer
        the columns [share) of its columns sorted — each reads its parts whole."""
        if isinstance(layer, RowParallelLinear):
            self.intermediate = ("columns", order, share)
            self.pieces = {s: [Piece(p.part, p.out, (0, self.full_columns)) for p in pieces]
                           for s, pieces in self.pieces.items()}
            return
        self.intermediate = ("rows", order, share)
        fused, offset = [], 0
        for i, (shard, full) in enumerate(zip(layer.parts, layer.full_sizes())):
            self.pieces[shard] = [Piece(i, (0, full), self.pieces[shard][0].cols)]
            fused.append(Piece(i, (offset, offset + full), self.pieces[shard][0].cols))
            offset += full
        self.pieces[None] = fused

    def shards(self, name: str) -> tuple[Shard, ...]:
        if name not in self.scheme.required_names:
            return ()
        return tuple(self.modules)

    def load(self, name: str, param: nn.Parameter, source: Any, shard: Shard = None) -> None:
        if shard not in self.pieces:
            raise ValueError(f"is not one of this projection's parts {tuple(k for k in self.pieces if k is not None)}")
        for piece in self.pieces[shard]:
            self.pending[(name, piece.part)] = self._read(name, source, piece)
            self.loaded[piece.part] = piece

    def _read(self, name: str, source: Any, piece: Piece) -> torch.Tensor:
        """This rank's piece of checkpoint tensor `name` (module doc of int_groups / fp8)."""
        (a, b), (c, d) = piece.out, piece.cols
        if isinstance(self.scheme, FP8Scheme):
            return _read_fp8(name, source, piece, self.scheme)
        group = self.scheme.group_size if self.scheme.group_size > 0 else self.full_columns
        # act-order: a share of the input columns holds columns of any group (g_idx), so
        # every group's zero points and scales (int_groups pads each group's run)
        groups = (0, -(-self.full_columns // group)) if self.scheme.act_order else (c // group, -(-d // group))
        pack = 8 if self.scheme.method == "awq" else 32 // self.scheme.bits
        if name == "g_idx":
            return source[c:d]
        if name in ("scales", "qzeros") and shape_of(source)[0] != -(-self.full_columns // group):
            raise ValueError(f"has {shape_of(source)[0]} rows of groups, but {self.full_columns} input columns in "
                             f"groups of {group} (quantization_config.group_size) make {-(-self.full_columns // group)}")
        if name == "scales":
            return _block_of(source, groups, (a, b))
        if name == "qzeros":
            return _block_of(source, groups, (a // pack, b // pack))
        if self.scheme.method == "awq":  # qweight [in, out / 8]
            return _block_of(source, (c, d), (a // pack, b // pack))
        return _block_of(source, (c // pack, d // pack), (a, b))  # GPTQ qweight [in / pack, out]

    def part_names(self) -> list[str]:
        return [self.modules.get(s, self.modules.get(None, "?")) for s in list(self.pieces)[:self.parts]]


def _block_of(source: Any, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """source[rows, cols] (of a safetensors slice, only that block is read)."""
    return source[rows[0]:rows[1], cols[0]:cols[1]]


def _read_fp8(name: str, source: Any, piece: Piece, scheme: FP8Scheme) -> torch.Tensor:
    (a, b), (c, d) = piece.out, piece.cols
    if name == "weight":
        return _block_of(source, (a, b), (c, d))
    shape = shape_of(source)
    if name == "input_scale" or len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):
        return source[...]  # one per tensor
    if scheme.block is None:  # one per output row
        return source[a:b]
    rows, cols = scheme.block
    return _block_of(source, (a // rows, -(-b // rows)), (c // cols, -(-d // cols)))


def use_quantized(layer: nn.Module, scheme: QuantScheme, modules: dict[Shard, str]) -> None:
    """Make `layer` take its weight from the checkpoint's packed tensors (module doc);
    before loading. `modules`: the checkpoint module of each shard."""
    check_alignment(layer, scheme, modules)
    del layer.weight
    for name in scheme.checkpoint_names:  # placeholders the loader finds by name
        layer.register_parameter(name, nn.Parameter(torch.empty(0), requires_grad=False))
    layer.quant_method = QuantizedWeights(layer, scheme, modules)
    layer.quant = scheme.label


def finalize(layer: nn.Module) -> None:
    """Turn the loaded pieces into the layer's packed weight (module doc)."""
    method: QuantizedWeights = layer.quant_method
    device = getattr(layer, method.scheme.checkpoint_names[0]).device  # the model's (its placeholders were moved)
    for name in method.scheme.checkpoint_names:
        delattr(layer, name)
    names = method.part_names()
    if isinstance(method.scheme, FP8Scheme):
        rows = join([_fp8_part(method, i, names[i]) for i in range(method.parts)])
        rows = FP8Rows(_padded(layer, rows.bytes), _padded(layer, rows.scales))
        _set_weight(layer, rows.bytes, device)
        layer.weight_scales = nn.Parameter(rows.scales.to(device), requires_grad=False)
        layer.quant_tensors = ("weight_scales",)
    else:
        _finalize_int(layer, method, names, device)
    method.pending.clear()


def _fp8_part(method: QuantizedWeights, i: int, where: str) -> FP8Rows:
    piece = method.loaded[i]
    weight = method.pending[("weight", i)]
    want = (piece.out[1] - piece.out[0], piece.cols[1] - piece.cols[0])
    if tuple(weight.shape) != want or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{where}: weight is {weight.dtype} of shape {tuple(weight.shape)}, expected "
                         f"float8_e4m3fn {want}")
    scale = method.pending[(method.scheme.scale_name, i)]
    return fp8_rows(weight, scale, method.scheme.block, piece.out[0], piece.cols[0], where)


def _int_part(method: QuantizedWeights, i: int, where: str) -> IntGroups:
    s = method.scheme
    p, piece = method.pending, method.loaded[i]
    c = piece.cols[0]
    if s.method == "awq":
        groups = awq_groups(p[("qweight", i)], p[("qzeros", i)], p[("scales", i)], s.group_size, c)
    else:
        group = s.group_size if s.group_size > 0 else method.full_columns
        groups = gptq_groups(p[("qweight", i)], p[("qzeros", i)], p[("scales", i)], p.get(("g_idx", i)), s.bits,
                             group, s.zeros_minus_one, 0 if s.act_order else c, all_groups=s.act_order)
    groups.check_shape(piece.out[1] - piece.out[0], piece.cols[1] - piece.cols[0], where)
    return groups


def _finalize_int(layer: nn.Module, method: QuantizedWeights, names: list[str], device: torch.device) -> None:
    """Each part as GGUF blocks (its columns sorted by group), runs of parts sharing one
    column order as one unit of the matmul."""
    quants, rows, orders = [], [], []
    for i in range(method.parts):
        groups = _int_part(method, i, names[i])
        groups, order = (groups.sorted_by_group() if method.intermediate is None  # (follow_intermediate_order)
                         else groups.sorted_in(*method.intermediate, names[i]))
        quant, packed = groups.gguf_rows(names[i])
        quants.append(quant)
        rows.append(_padded(layer, packed))
        orders.append(order)
    _set_weight(layer, torch.cat([r.reshape(-1) for r in rows]), device)
    units, offset = [], 0
    for i in range(method.parts):
        if i == 0 or not _same_order(orders[i], orders[i - 1]):
            units.append(([], orders[i]))
        units[-1][0].append(i)
    layer.int_units = []
    tensors = []
    for u, (members, order) in enumerate(units):
        cols = layer.in_features if order is None else order.numel()  # (a padded order: more)
        parts = packed_parts([quants[i] for i in members], [rows[i].shape[0] for i in members], cols)
        parts = tuple(PackedPart(q.quant, q.start, q.end, q.offset + offset) for q in parts)
        offset += sum(rows[i].numel() for i in members)
        name = None
        if order is not None:
            name = f"input_order_{u}"
            layer.register_buffer(name, order.to(device))
            tensors.append(name)
        layer.int_units.append((name, parts))
    layer.quant_tensors = tuple(tensors)


def _padded(layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """A vocabulary table's rows (a quantized LM head's: one part) with zero rows after
    them to the layer's rows (the last rank's padding under TP: zero blocks, zero scales,
    weights 0 in every packed type); any other layer's as they are."""
    missing = layer.out_features - rows.shape[0] if isinstance(layer, VocabRows) else 0
    return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])]) if missing > 0 else rows


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _set_weight(layer: nn.Module, data: torch.Tensor, device: torch.device) -> None:
    layer.weight = nn.Parameter(data.to(device).contiguous(), requires_grad=False)


@dataclass
class PackedUnit:
    """What a GGUF matmul (gguf_quant.GGUFMatmul, on CUDA cuda_matmul.TritonGGUFMatmul)
    reads of a layer, for one run of parts (no bias: the layer's is added once, after
    every unit)."""

    in_features: int
    weight: torch.Tensor
    packed_parts: tuple[PackedPart, ...]
    bias: None = None
    reduce: bool = True


class IntGroupMatmul:
    """x -> x W^T (+ b unless the layer reduces) over an AWQ/GPTQ layer's packed units
    (module doc), each multiplied by `unit_matmul(unit)`."""

    def __init__(self, layer: nn.Module,
                 unit_matmul: Callable[[PackedUnit], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.layer = layer
        self.with_bias = not getattr(layer, "reduce", False)
        self.units = [(order, unit_matmul(PackedUnit(_unit_columns(layer, order), layer.weight, parts)))
                      for order, parts in layer.int_units]

    def held_tensors(self) -> list[torch.Tensor]:
        """The views its units' matmuls keep of the layer's weight (sleep_mode moves them)."""
        return [t for _, mm in self.units if hasattr(mm, "held_tensors") for t in mm.held_tensors()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [mm(x if order is None else x.index_select(-1, getattr(self.layer, order))) for order, mm in self.units]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        bias = self.layer.bias if self.with_bias else None
        return out if bias is None else out + bias


def _unit_columns(layer: nn.Module, order: str | None) -> int:
    """The columns a unit's packed rows hold: the layer's, or its input order's (act-order
    groups padded to whole blocks may take more)."""
    return layer.in_features if order is None else getattr(layer, order).numel()


def quantized_matmul(layer: nn.Module, gguf_ops: Any, x16_passes: int, fp8_ops: Any) -> Any:
    """The CPU matmul of a finalized quantized layer (on CUDA: cuda_matmul.cuda_quantized_matmul)."""
    if isinstance(layer.quant_method.scheme, FP8Scheme):
        return FP8Matmul(layer, fp8_ops)
    return IntGroupMatmul(layer, lambda unit: GGUFMatmul(unit, gguf_ops, x16_passes))
