"""Choosing the attention backend at start-up.

"torch" is the PyTorch reference (attention.TorchAttention, any device); "triton" the
Triton paged kernels (triton_attention.TritonAttention, CUDA; on CPU only under
Triton's interpreter); "auto" is triton on CUDA when triton imports, else torch.
flash-attn is not offered: its paged KV cache wants pages of a multiple of 256 tokens
in a block-major layout, not our head-major cache of 16-token blocks.

The triton module is imported only here, and only when triton is asked for or "auto"
runs on CUDA, so elsewhere triton_attention is never loaded.
"""
from __future__ import annotations

import torch

from llmd.gpu.attention import TorchAttention

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ("torch" or "triton") that setting `name` means on `device`. A backend
    that cannot run there fails now, with the reason, instead of in the first step."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"
    problem = _triton_problem(device)
    if name == "auto":
        return "torch" if problem else "triton"
    if problem:
        raise ValueError(f"attention_backend 'triton' {problem}; use 'torch' or 'auto'")
    return "triton"


def _triton_problem(device: torch.device) -> str | None:
    try:
        from llmd.gpu import triton_attention
    except ImportError as exc:
        return f"needs triton, which does not import here ({exc})"
    if device.type != "cuda" and not triton_attention.INTERPRETED:
        return (f"runs on CUDA devices; on {device.type} its kernels run only in Triton's "
                f"interpreter (TRITON_INTERPRET=1 in the environment before triton is first imported)")
    return None


def make_attention(backend: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
    """One layer's attention for a backend resolve_attention_backend returned."""
    if backend == "triton":
        from llmd.gpu.triton_attention import TritonAttention

        return TritonAttention(num_heads, num_kv_heads, head_dim, scale)
    if backend == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"unknown attention backend {backend!r} (resolve the setting first)")
