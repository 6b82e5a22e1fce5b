"""The split-K partial sums of a packed-weight matmul (triton_quant_mm, triton_quant_moe)
added into the output in one launch: the float32 partials [splits, M, N] summed over the
splits in order (deterministic, as before) and written in the output's dtype, where
`out.copy_(partials.sum(0))` took two kernels (a sum into a float32 temporary, then the
cast into `out`). A decode step runs one split-K matmul per packed projection (an 8B
model: ~130 a token), and inside a CUDA graph each kernel boundary costs the GPU a
microsecond or two of its own; one kernel a projection fewer is that much of a step.
`out` may be a column slice of a wider tensor (the experts' gate/up halves)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns a program adds


@triton.jit
def _sum_splits_kernel(P, OUT, splits, n, stride_ps, stride_pm, stride_om, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(P + s * stride_ps + m * stride_pm + cols, mask=mask, other=0.0)
    tl.store(OUT + m * stride_om + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] (unit column stride) = partials [splits, M, N] (float32, contiguous)
    summed over the splits, split 0 first."""
    splits, rows, n = partials.shape
    if tuple(out.shape) != (rows, n) or out.stride(1) != 1 or not partials.is_contiguous():
        raise ValueError(f"partials {tuple(partials.shape)} do not sum into out {tuple(out.shape)} "
                         f"(strides {out.stride()})")
    if rows == 0 or n == 0:
        return
    _sum_splits_kernel[(rows, triton.cdiv(n, BLOCK))](partials, out, splits, n, partials.stride(0),
                                                      partials.stride(1), out.stride(0), BLOCK=BLOCK)
