"""FP8 W8A8: an FP8 weight (quant/fp8.py's FP8Rows with one scale per row: per-tensor
or per-channel checkpoints) times activations quantized to e4m3 per token as they come
(dynamic scales: each row of x over its own absolute maximum, 448 the largest e4m3),
on the FP8 tensor cores through torch._scaled_mm with row-wise scales (x's per row, the
weight's per output channel) and the output in bf16.

Where it runs (`w8a8_applies`): a CUDA device of compute capability 9.0 or more (Hopper:
row-wise scaled FP8 GEMMs), bf16 activations, K and N multiples of 16 (_scaled_mm's
alignment), one scale per weight row, and LLMD_FP8_W8A8 not "0". Anywhere else an FP8
weight runs W8A16 (activations unquantized) through the Triton kernel
(triton_quant_mm). A checkpoint's static `input_scale` is not used: a per-token scale
fits each row at least as well. `w8a8_reference` is the same arithmetic in float32, for
tests and for checking a device's result.
"""
from __future__ import annotations

import os

import torch

E4M3_MAX = 448.0
W8A8_ENV = "LLMD_FP8_W8A8"  # "0": FP8 weights run W8A16 everywhere (the Triton kernel)
_ALIGN = 16


def w8a8_enabled() -> bool:
    value = os.environ.get(W8A8_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{W8A8_ENV} must be 0 or 1, got {value!r}")
    return value != "0"


def w8a8_applies(device: torch.device, dtype: torch.dtype, weight_bytes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether a weight [N, K] with `scales` [N, groups] multiplies `dtype` activations
    W8A8 on `device` (module doc)."""
    n, k = weight_bytes.shape
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and dtype == torch.bfloat16 and scales.shape[1] == 1 and n % _ALIGN == 0 and k % _ALIGN == 0
            and w8a8_enabled())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as e4m3 [M, K], its float32 scales [M, 1]): each row divided by its absolute
    maximum over 448 (an all-zero row by a tiny scale: its codes stay 0)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def w8a8_matmul(x: torch.Tensor, weight_bytes: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the e4m3 weight [N, K] (uint8 bytes) with scales [N, 1], on the FP8
    tensor cores: [M, N] in x's dtype."""
    codes, x_scale = quantize_rows(x)
    weight = weight_bytes.view(torch.float8_e4m3fn)
    return torch._scaled_mm(codes, weight.t(), scale_a=x_scale, scale_b=row_scales.reshape(1, -1),
                            out_dtype=x.dtype)


def w8a8_reference(x: torch.Tensor, weight_bytes: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """What w8a8_matmul computes, in float32 (torch's own float8 conversions)."""
    codes, x_scale = quantize_rows(x)
    weight = weight_bytes.view(torch.float8_e4m3fn).float()
    return ((codes.float() @ weight.t()) * x_scale * row_scales.reshape(1, -1).float()).to(x.dtype)
