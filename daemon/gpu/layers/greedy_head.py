"""A packed LM head's logits for rows that need only their argmax (greedy requests with
nothing that changes their logits: sample/metadata.argmax_only), at about half the int8
dot products of the full product.

At a batch's rows the x16 product is compute-bound, and its two passes over x are twice
one pass's int8 dot products (gguf_quant.x16_passes). A greedy row's token is the argmax
of its logits, so those rows go through one pass; then, per row, a bound on how far each
logit can lie from its two-pass value (Cauchy-Schwarz: its weight row's L2 norm times
||x_two - x_one||, plus the float32 roundings; cpu/cpu_quant_x16.cpp's
gguf_x16_argmax_refine_) rules out every logit that cannot be the argmax, and the
16-row groups holding the rest are multiplied again at two passes — the same bits the full
product gives them. The row's argmax is then the two-pass product's, proven, ties
included (a ruled-out logit lies strictly below the refined maximum). On Gemma 3 270M's
262,144-row head a row refines 1-13 groups of 16,384 (docs/benchmarks.md).

The logits of a greedy row are then not all its two-pass logits: only callers that take
their argmax alone may ask for it (`argmax_rows`); everything else gets the full product.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Greedy rows from which one pass and the refinement beat two passes: below, the product
# streams the weight from memory at either pass count (Zen 4, 2 threads, the head alone:
# Gemma 3 270M 0.97-0.98x at 1-2 rows, 1.11x at 4, 1.62x at 32; the 1B's Q6_K head 1.31x at
# 4, 1.85x at 32; docs/benchmarks.md).
GREEDY_MIN_ROWS = 4


class GreedyHead:
    """The greedy rows' logits of an LM head whose one x16 part (`weight`, type `code`,
    `cols` columns) is multiplied in `passes` passes over x; the other rows' at `passes`.
    `reused`: the head's output buffer (gguf_quant.ReusedOutput); `max_rows`: rows up to
    which the head's product is the x16 kernel at each pass count."""

    def __init__(self, ops: Any, weight: torch.Tensor, code: int, cols: int, passes: int, reused: Any,
                 max_rows: dict[int, int]) -> None:
        self.ops, self.weight, self.code, self.cols, self.passes = ops, weight, code, cols, passes
        self.reused = reused
        self.max_rows = min(max_rows[1], max_rows[passes])
        # [N] float32: the weight rows' L2 norms (Gemma 3's 262,144 x 640: ~0.1 s at load)
        self.norms = ops.row_norms(weight, code, cols)
        self.refined_groups = 0  # groups multiplied again, in all (what the benchmarks report)
        # [R] int64: every row's argmax, where the last call's rows were all greedy (the
        # refinement knows them: the sampler need not read the logits again); else None
        self.argmax: torch.Tensor | None = None

    def logits(self, x: torch.Tensor, argmax_rows: Sequence[int], vocab_limit: int,
               softcap: float | None = None) -> torch.Tensor | None:
        """Logits of x's rows [R, cols], those in `argmax_rows` good for their argmax over
        [0, vocab_limit) alone; None where this path does not apply, and the caller's full
        product does: too few greedy rows, more rows than the x16 kernel takes, or x not
        float32 (a bfloat16 model's full product rounds its logits to bfloat16, whose ties
        pick the lowest id: the float32 logits here could pick another). `softcap`: the
        caller caps the logits after (softcap * tanh(z / softcap), Gemma 2), which can
        round two of them to one value: the refinement keeps every group that could then
        tie the best, and `argmax` is not set (the capped logits' argmax is the caller's)."""
        rows, n = x.shape[0], self.weight.shape[0]
        self.argmax = None
        if len(argmax_rows) < GREEDY_MIN_ROWS or rows > self.max_rows or not 0 < vocab_limit <= n \
                or x.dtype != torch.float32:
            return None
        x = x.contiguous()
        ops, w, code, cols = self.ops, self.weight, self.code, self.cols
        cap = float(softcap or 0.0)
        norms = self.norms
        out = self.reused.get(rows, n)
        if len(argmax_rows) == rows:
            ops.mm_x16_into(x, w, code, cols, 1, "", out)
            self.argmax = torch.empty(rows, dtype=torch.int64)
            self.refined_groups += ops.argmax_refine_(x, w, code, cols, self.passes, "", out, norms, vocab_limit,
                                                      self.argmax, cap)
            if softcap:
                self.argmax = None
            return out
        greedy = torch.tensor(argmax_rows, dtype=torch.int64)
        other = torch.ones(rows, dtype=torch.bool)
        other[greedy] = False
        full = other.nonzero().squeeze(1)
        xg = x.index_select(0, greedy)
        first = ops.mm_x16(xg, w, code, cols, 1)
        self.refined_groups += ops.argmax_refine_(xg, w, code, cols, self.passes, "", first, norms, vocab_limit,
                                                  torch.empty(len(argmax_rows), dtype=torch.int64), cap)
        out.index_copy_(0, greedy, first)
        out.index_copy_(0, full, ops.mm_x16(x.index_select(0, full), w, code, cols, self.passes))
        return out


def greedy_head_of(model: torch.nn.Module) -> GreedyHead | None:
    """The model's LM head's greedy path, if it has one (a packed head on the x16 kernel)."""
    return getattr(getattr(getattr(model, "lm_head", None), "kernel", None), "greedy", None)
