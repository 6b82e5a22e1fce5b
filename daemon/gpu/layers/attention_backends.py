"""Choosing the attention backend at start-up.

"torch" is the PyTorch reference (attention.TorchAttention, any device); "triton" the
Triton paged kernels (triton_attention.TritonAttention, CUDA; on CPU only under
Triton's interpreter); "flash_attn" flash-attn's varlen kernel over the paged cache
(flash_attention.FlashAttention; CUDA, fp16/bf16, blocks of a multiple of 256 tokens,
a KV cache in the model's dtype, the optional `gpu` extra installed). "auto" on CUDA is
flash_attn when it is installed and fits the settings, else triton when triton imports,
else torch; off CUDA, torch. The torch and triton backends read every kv_cache_dtype.

The triton and flash-attn modules are imported only here, and only when their backend
is asked for or "auto" runs on CUDA, so elsewhere neither is ever loaded.
"""
from __future__ import annotations

import inspect
import logging

import torch

from llmd.gpu.layers.attention import AttentionLayer, MetadataBuilder, TorchAttention

logger = logging.getLogger("llmd.attention")

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


def resolve_attention_backend(name: str, device: torch.device, block_size: int = 16,
                              dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto") -> str:
    """The backend ("torch", "triton" or "flash_attn") that setting `name` means on
    `device` for a cache of `block_size`-token blocks for a model in `dtype`, its
    elements in `kv_cache_dtype` (kv_quant). A backend that cannot
    run there fails now, with the reason, instead of in the first step (flash_attn's
    head-size limit is checked when the model's layers are built, still at start-up)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"
    if name == "auto":
        flash = _flash_problem(device, block_size, dtype, kv_cache_dtype)
        if flash is None:
            return "flash_attn"
        if not flash.startswith("needs"):  # installed, but not for these settings
            logger.info("attention_backend 'auto': not flash_attn, which %s", flash)
        return "triton" if _triton_problem(device) is None else "torch"
    problem = (_triton_problem(device) if name == "triton"
               else _flash_problem(device, block_size, dtype, kv_cache_dtype))
    if problem:
        raise ValueError(f"attention_backend {name!r} {problem}; use 'torch' or 'auto'")
    return name


def _triton_problem(device: torch.device) -> str | None:
    try:
        from llmd.gpu.layers import triton_attention
    except ImportError as exc:
        return f"needs triton, which does not import here ({exc})"
    if device.type != "cuda" and not triton_attention.INTERPRETED:
        return (f"runs on CUDA devices; on {device.type} its kernels run only in Triton's "
                f"interpreter (TRITON_INTERPRET=1 in the environment before triton is first imported)")
    return None


def _flash_problem(device: torch.device, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str | None:
    from llmd.gpu.layers.flash_attention import FLASH_PAGE_MULTIPLE, flash_varlen

    try:
        varlen = flash_varlen()
    except ImportError as exc:
        return f"needs flash-attn (pip install 'llmd[gpu]'), which does not import here ({exc})"
    if "block_table" not in inspect.signature(varlen).parameters:
        return "needs flash-attn >= 2.6 (flash_attn_varlen_func with block_table)"
    if device.type != "cuda":
        return f"runs on CUDA devices, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"runs in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if kv_cache_dtype != "auto":  # flash-attn 2's paged kernel takes K/V in q's dtype only
        return f"reads no quantized KV cache (kv_cache_dtype {kv_cache_dtype!r}; 'auto' keeps the model's dtype)"
    if block_size % FLASH_PAGE_MULTIPLE:
        return (f"reads the KV cache in pages of a multiple of {FLASH_PAGE_MULTIPLE} tokens; "
                f"block_size is {block_size} (set block_size = {FLASH_PAGE_MULTIPLE})")
    return None


def make_attention(backend: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   sliding_window: int | None = None, softcap: float | None = None):
    """One layer's attention for a backend resolve_attention_backend returned, over
    the layer's sliding window (None: full attention), its scores soft-capped at
    `softcap` (None: not capped). Every backend implements both."""
    if backend == "triton":
        from llmd.gpu.layers.triton_attention import TritonAttention

        return TritonAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
    if backend == "flash_attn":
        from llmd.gpu.layers.flash_attention import FlashAttention

        return FlashAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
    if backend == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
    raise ValueError(f"unknown attention backend {backend!r} (resolve the setting first)")


def metadata_builder(model: torch.nn.Module, block_size: int, device: torch.device) -> MetadataBuilder:
    """The MetadataBuilder of `model`'s attention backend (its layers are all of one,
    as make_attention built them), for steps over a cache of `block_size`-token blocks
    on `device`. Made after the model is loaded: on CPU the loader's decode kernel
    changes what the torch backend needs."""
    layers = [m.attn for m in model.modules() if isinstance(getattr(m, "attn", None), AttentionLayer)]
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1:
        raise ValueError(f"a model attends with one backend, not {sorted(k.__name__ for k in kinds)}")
    return kinds.pop().metadata_builder(layers, block_size, device)
