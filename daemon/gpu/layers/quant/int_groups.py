"""AWQ and GPTQ weights: integer codes in groups of input columns, each group with a
scale and a zero point, w = scale * (code - zero). How each packs them:

| | codes | zero points | scales | column groups |
| --- | --- | --- | --- | --- |
| AWQ (GEMM) | `qweight` int32 [in, out / 8]: eight 4-bit codes of one row, output columns in the order 0 2 4 6 1 3 5 7 from the low bits | `qzeros` int32 [in / group, out / 8], same order | `scales` fp16 [in / group, out] | column // group |
| GPTQ | `qweight` int32 [in * bits / 32, out]: 32 / bits codes of one output column, input rows in order from the low bits | `qzeros` int32 [in / group, out * bits / 32], output columns in order; v1 checkpoints store zero - 1 | `scales` [in / group, out] | `g_idx` [in] (act-order: any order) |

`IntGroups` holds one weight unpacked ([out, in] codes, a zero and scale per group and
row) and becomes the packed rows the CPU kernels read (`gguf_rows`): llama.cpp's block
formats of 32 columns with an fp16 scale, into which these weights go exactly —

* zero points all 8 (GPTQ's symmetric 4-bit): Q4_0, d * (q - 8);
* any other 4-bit zero points: Q5_0, d * (q5 - 16) with q5 = q - zero + 16 (1..31, or
  0..30 with v1's zero points of 1..16), one bit more than the file to hold the shift;
* zero points all 128 (symmetric 8-bit): Q8_0, d * int8(q - 128);

d the group's scale as fp16 (the file's own, so exact). Each block of 32 columns must
lie in one group: act-order columns are sorted by group first (`sorted_by_group`, the
layer permutes x the same way; a group's columns that are not whole blocks — a rank's
share under tensor parallelism — padded with zero weights). Other 8-bit zero points
would need 9-bit codes and are refused. Pure torch: unpacking and transcoding run once,
at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output column 8 j + AWQ_ORDER[i]
BLOCK = 32  # columns per packed block


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of int32 words [..., n] as uint8 [..., n * 32 / bits], each word's from
    its lowest bits up."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2).to(torch.uint8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [rows, out / 8] -> codes [rows, out] in output column order."""
    codes = unpack_codes(packed, 4)
    inverse = torch.tensor(AWQ_ORDER).argsort()  # 0 4 1 5 2 6 3 7: where column c sits in its word
    return codes.unflatten(-1, (-1, 8))[..., inverse].flatten(-2)


@dataclass
class IntGroups:
    """A weight [out, in] as `codes` (uint8), and per row and group its `zeros` (int32)
    and `scales` (float32); `group_of[k]`: the group of input column k; `all_groups`: the
    zero points and scales of every group of the whole weight (act-order), not only those
    its columns use."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_of: torch.Tensor
    bits: int
    all_groups: bool = False

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: scale * (code - zero) of each column's group."""
        g = self.group_of
        return (self.codes.float() - self.zeros[:, g].float()) * self.scales[:, g]

    def check_shape(self, rows: int, cols: int, where: str) -> None:
        """ValueError naming `where` unless the codes are [rows, cols] and every row has
        one zero point and scale per group its columns use (act-order: every group's,
        read whole; a rank's columns may use fewer)."""
        if tuple(self.codes.shape) != (rows, cols):
            raise ValueError(f"{where}: qweight holds codes of shape {tuple(self.codes.shape)} [out, in], "
                             f"expected {(rows, cols)}")
        groups = int(self.group_of.max()) + 1 if cols else 0
        for name, t in (("qzeros", self.zeros), ("scales", self.scales)):
            if t.shape[0] != rows or t.shape[1] < groups or (t.shape[1] > groups and not self.all_groups):
                raise ValueError(f"{where}: {name} gives {tuple(t.shape)} [out, groups], expected {(rows, groups)} "
                                 "(is quantization_config.group_size the checkpoint's?)")

    def sorted_by_group(self) -> tuple[IntGroups, torch.Tensor | None]:
        """The same weight with its columns sorted by group (stable), and the order of
        x's columns it multiplies (None: already sorted), so that x[:, order] @ sorted^T =
        x @ self^T. A group whose columns are not whole BLOCKs (a rank's share of act-order
        columns under tensor parallelism: any number of each group's) is padded to them
        with columns of weight 0 — codes its row's zero point, 0 in every packed type —
        that take x's column of the group's first (any column: times 0)."""
        order = group_order(self.group_of)
        groups = self.group_of[order]
        counts = torch.bincount(groups).tolist() if order.numel() else []
        if all(c % BLOCK == 0 for c in counts):
            if torch.equal(order, torch.arange(order.numel(), device=order.device)):
                return self, None
            return IntGroups(self.codes[:, order], self.zeros, self.scales, groups, self.bits, self.all_groups), order
        runs, padding, start = [], [], 0
        for c in counts:
            if c:
                pad = -c % BLOCK
                runs += [order[start:start + c], order[start:start + 1].expand(pad)]
                padding += [torch.zeros(c, dtype=torch.bool), torch.ones(pad, dtype=torch.bool)]
                start += c
        padded_order = torch.cat(runs)
        pad = torch.cat(padding).to(order.device)
        padded_groups = self.group_of[padded_order]
        codes = self.codes[:, padded_order]
        codes[:, pad] = self.zeros[:, padded_groups[pad]].to(codes.dtype)
        return IntGroups(codes, self.zeros, self.scales, padded_groups, self.bits, self.all_groups), padded_order

    def sorted_in(self, side: str, order: torch.Tensor, share: tuple[int, int],
                  where: str) -> tuple[IntGroups, torch.Tensor | None]:
        """sorted_by_group's result for a projection of a gated MLP (or expert) whose
        intermediate dimension is put in `order` (intermediate_order): gate's / up's
        ("rows") this share's rows order[share], then sorted by group over their own input
        columns; down's ("columns") sorted into `order` itself (checked: ValueError naming
        `where`), the share's columns of it, which take x as it comes (no order)."""
        a, b = share
        if side == "rows":
            return self.rows(order[a:b]).sorted_by_group()
        whole, own = self.sorted_by_group()
        if own is None or not torch.equal(own, order):
            raise ValueError(f"{where}: its columns do not sort into the order its gate and up rows were given")
        return whole.columns(a, b), None

    def rows(self, index: torch.Tensor) -> IntGroups:
        """Its rows `index` (output rows in any order), every column."""
        return IntGroups(self.codes[index], self.zeros[index], self.scales[index], self.group_of, self.bits,
                         self.all_groups)

    def columns(self, start: int, end: int) -> IntGroups:
        """Its columns [start, end), every group's zero points and scales kept."""
        return IntGroups(self.codes[:, start:end], self.zeros, self.scales, self.group_of[start:end], self.bits,
                         self.all_groups)

    def gguf_rows(self, where: str, q5: bool = False) -> tuple[str, torch.Tensor]:
        """(GGUF type, packed rows uint8 [out, blocks * bytes]) holding this weight
        exactly (module doc); columns must already be sorted by group. `q5`: 4-bit codes
        as Q5_0 even where every zero point is 8 (a type chosen before the zero points
        were read). ValueError naming `where` (the checkpoint module) if it cannot be."""
        out, cols = self.codes.shape
        if cols % BLOCK:
            raise ValueError(f"{where}: {cols} input columns are not a whole number of {BLOCK}-column blocks")
        first = self.group_of.view(-1, BLOCK)
        if not torch.equal(first, first[:, :1].expand_as(first)):
            raise ValueError(f"{where}: a block of {BLOCK} input columns spans two groups (g_idx groups must "
                             f"be whole multiples of {BLOCK} columns)")
        zeros = self.zeros[:, first[:, 0]]  # [out, blocks]
        d = self.scales[:, first[:, 0]].to(torch.float16)
        if not torch.equal(d.float(), self.scales[:, first[:, 0]]):
            raise ValueError(f"{where}: scales are not all fp16 values (the packed blocks keep fp16 scales)")
        q = self.codes.view(out, -1, BLOCK)
        if self.bits == 8:
            if not bool((zeros == 128).all()):
                raise ValueError(f"{where}: 8-bit zero points other than 128 need 9-bit codes: not implemented "
                                 "packed (dequantize=True loads it dense)")
            return "Q8_0", _blocks(d, (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8))
        if not q5 and bool((zeros == 8).all()):
            return "Q4_0", _blocks(d, _nibbles(q))
        shifted = q.to(torch.int32) - zeros.unsqueeze(-1) + 16  # 0..31
        if bool(((shifted < 0) | (shifted > 31)).any()):
            raise ValueError(f"{where}: zero points outside 0..16")
        fifth = ((shifted >> 4) & 1).to(torch.int64) << torch.arange(BLOCK, device=q.device)
        qh = fifth.sum(-1, keepdim=True) >> torch.arange(0, 32, 8, device=q.device)  # u32, little-endian bytes
        return "Q5_0", _blocks(d, (qh & 0xFF).to(torch.uint8), _nibbles((shifted & 0xF).to(torch.uint8)))


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] 4-bit codes -> 16 bytes, ggml's order: byte i holds code i (low) and i + 16 (high)."""
    return q[..., :16] | (q[..., 16:] << 4)


def _blocks(d: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
    """Rows of blocks: each block's fp16 d, then its fields' bytes."""
    out = d.shape[0]
    return torch.cat([d.contiguous().view(torch.uint8).view(out, -1, 2), *fields], dim=-1).reshape(out, -1)


def _group_of(cols: int, group: int, col_offset: int, device: torch.device) -> torch.Tensor:
    """Groups of `cols` columns starting at column `col_offset` of the whole weight,
    numbered from the first group they touch."""
    k = torch.arange(col_offset, col_offset + cols, device=device)
    return k // group - col_offset // group


def awq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
               col_offset: int = 0) -> IntGroups:
    """An AWQ weight's slice (`col_offset`: its first input column in the whole weight,
    where the groups start)."""
    codes = _awq_columns(qweight).t().contiguous()
    zeros = _awq_columns(qzeros).t().to(torch.int32)
    return IntGroups(codes, zeros, scales.t().float().contiguous(),
                     _group_of(codes.shape[1], group, col_offset, codes.device), 4)


def group_order(group_of: torch.Tensor) -> torch.Tensor:
    """Columns sorted by their group, stably: the order IntGroups.sorted_by_group gives
    its columns (before any padding)."""
    return torch.argsort(group_of, stable=True)


def intermediate_order(g_idx: torch.Tensor) -> torch.Tensor | None:
    """The order a GPTQ act-order down projection's columns sort into by group (its
    g_idx), where every group is whole BLOCKs of columns and the order is not theirs
    already (None otherwise): what its gated MLP's or expert's intermediate dimension is
    put in (models/expert_sources.py)."""
    group_of = g_idx.to(torch.int64)
    if group_of.numel() == 0 or bool((torch.bincount(group_of) % BLOCK).any()):
        return None
    order = group_order(group_of)
    return None if torch.equal(order, torch.arange(order.numel())) else order


def gptq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group: int, zeros_minus_one: bool, col_offset: int = 0, all_groups: bool = False
                ) -> IntGroups:
    """A GPTQ weight's slice; `g_idx` None: column // group (a checkpoint without act-order
    may leave it out). `all_groups`: qzeros and scales hold every group of the whole
    weight (act-order: `col_offset` 0, g_idx numbers them)."""
    codes = unpack_codes(qweight.t(), bits).contiguous()
    zeros = unpack_codes(qzeros, bits).t().to(torch.int32) + int(zeros_minus_one)
    if g_idx is None:
        group_of = _group_of(codes.shape[1], group, col_offset, codes.device)
    else:  # numbered over the whole weight: from the first group of this slice's (tensor parallelism)
        group_of = g_idx.to(torch.int64) - col_offset // group
        if bool(((group_of < 0) | (group_of >= zeros.shape[1])).any()):
            raise ValueError(f"g_idx names groups outside 0..{zeros.shape[1] - 1}")
    return IntGroups(codes, zeros.contiguous(), scales.t().float().contiguous(), group_of, bits, all_groups)

