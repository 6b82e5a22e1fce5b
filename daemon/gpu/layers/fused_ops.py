"""Which implementation a decoder layer's small ops run on: PyTorch as the layers always
computed them, or one Triton kernel per fused op (fused_ops_triton).

At batch 1 a decode step is mostly small elementwise and reduction kernels between the
GEMMs (norms, residual adds, rotary, the activation, the K/V write: ~45 launches a layer
unfused). Fused, a layer runs four: residual add + RMSNorm (twice), q/k norm + rotary +
K/V cache write, act(gate) * up.

`LayerOps` is the unfused set and the reference of each kernel: its methods call the
norms, activation, rotary and cache write of the layers unchanged, so the torch path
computes exactly what it did before fusion existed. `FusedLayerOps` runs the kernels
and tells the attention backend that the cache already holds the step's K/V
(`kv_written=True`: TritonAttention and FlashAttention skip their own write).

A model takes its ops from `layer_ops(attention_backend, device)` when it is built (a
model placed off CUDA never gets the compiled kernels, which take CUDA tensors only). The
environment variable LLMD_FUSED_OPS, read then, decides:
- unset, "auto": fused when the layers attend with a kernel backend ("triton" or
  "flash_attn") on CUDA: triton imports and does not run in its interpreter;
- "0" (or "off"): never fused: the A/B switch for measuring fusion on a GPU;
- "1" (or "on"): fused with any kernel backend, also on CPU under Triton's interpreter
  (TRITON_INTERPRET=1), which is how the tests run the fused path.
layer_ops gives the "torch" attention backend the unfused ops; on CPU the loader then
hands the layers cpu_fused_ops' C++ versions of the same ops (attach_cpu_kernels; the
same LLMD_FUSED_OPS=0 keeps them unfused).
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

from llmd.gpu.layers.attention import AttentionMetadata, write_kv
from llmd.gpu.layers.kv_quant import UNIT_SCALES, KVScales
from llmd.gpu.layers.norms import ACTIVATIONS, RMSNorm, act_and_mul
from llmd.gpu.layers.rotary import apply_rotary

FUSED_OPS_ENV = "LLMD_FUSED_OPS"
_SETTINGS = {"": "auto", "auto": "auto", "0": "off", "off": "off", "1": "on", "on": "on"}
KERNEL_BACKENDS = ("triton", "flash_attn")


def fused_ops_setting() -> str:
    """"auto", "off" or "on", from LLMD_FUSED_OPS (module docstring)."""
    value = os.environ.get(FUSED_OPS_ENV, "").strip().lower()
    if value not in _SETTINGS:
        raise ValueError(f"{FUSED_OPS_ENV} must be one of 0, 1, auto (or off, on), got {value!r}")
    return _SETTINGS[value]


def rotated_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                q_norm: RMSNorm | None, k_norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H, D], k, v [T, KVH, D]) from a fused q/k/v projection's output: split into
    heads, q and k normed per head (when the layer has q/k norms) and rotated."""
    t = qkv.shape[0]
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    q = q.view(t, num_heads, head_dim)
    k = k.view(t, num_kv_heads, head_dim)
    v = v.view(t, num_kv_heads, head_dim)
    if q_norm is not None:
        q = q_norm(q)
        k = k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def attention_inputs_reference(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                               q_norm: RMSNorm | None, k_norm: RMSNorm | None, cos: torch.Tensor,
                               sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               scales: KVScales = UNIT_SCALES) -> torch.Tensor:
    """What fused_ops_triton.qkv_rope_cache computes, unfused: rotated_qkv, then the
    K/V scatter every attention backend does (attention.write_kv, quantizing with
    `scales` into a quantized cache); returns q."""
    q, k, v = rotated_qkv(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, cos, sin)
    write_kv(kv_cache, k, v, slot_mapping, scales)
    return q


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [tokens, top_k], expert ids int64 [tokens, top_k]): softmax over
    all experts in float32, the top_k largest, optionally rescaled to sum to 1 (Mixtral
    always, Qwen-MoE when `norm_topk_prob`), as transformers' routers compute them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class LayerOps:
    """The unfused ops (PyTorch, any device): each method is its fused kernel's reference.
    `attend` takes the layer's DecoderAttention (its head sizes, q/k norms and backend
    `attn`) and the q/k/v projection's output, and returns the attention output [T, H, D]."""

    fused = False

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return norm.forward_add(x, residual)

    def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up of a fused [gate | up] projection; `activation` an ACTIVATIONS name."""
        return act_and_mul(gate_up, ACTIVATIONS[activation])

    def route(self, gate: Any, x: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE layer's routing of x [T, N] by its router `gate`: select_experts of its
        logits (weights float32, expert ids int64, [T, top_k])."""
        return select_experts(gate(x), top_k, renormalize)

    def attend(self, attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = rotated_qkv(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.q_norm, attn.k_norm,
                              cos, sin)
        return attn.attn(q, k, v, kv_cache, md)


class FusedLayerOps(LayerOps):
    """The same ops as one Triton kernel each (fused_ops_triton); the attention backend
    must take `kv_written` (the kernel backends do)."""

    fused = True

    def __init__(self) -> None:
        from llmd.gpu.layers import fused_ops_triton

        self.kernels = fused_ops_triton

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.gemma_scale)

    def add_rms_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.gemma_scale, residual)

    def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return self.kernels.act_and_mul(gate_up, activation)

    def attend(self, attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        norms = attn.q_norm, attn.k_norm
        qk_norm = None if norms[0] is None else (norms[0].weight, norms[1].weight, norms[0].eps,
                                                  norms[0].gemma_scale)
        q = self.kernels.qkv_rope_cache(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim, cos, sin, kv_cache,
                                        md.slot_mapping, qk_norm, attn.attn.kv_scales)
        return attn.attn(q, None, None, kv_cache, md, kv_written=True)


UNFUSED = LayerOps()


@functools.cache
def _fused_ops() -> FusedLayerOps:
    return FusedLayerOps()


def layer_ops(attention_backend: str, device: torch.device | None = None) -> LayerOps:
    """The ops of a model whose layers attend with `attention_backend` (a name
    resolve_attention_backend returned) on `device` (None: wherever CUDA is present),
    under LLMD_FUSED_OPS (module docstring)."""
    setting = fused_ops_setting()
    if attention_backend not in KERNEL_BACKENDS or setting == "off":
        return UNFUSED
    try:
        from llmd.gpu.layers import fused_ops_triton
    except ImportError:
        return UNFUSED
    if device is not None and device.type != "cuda" and not fused_ops_triton.INTERPRETED:
        return UNFUSED  # e.g. a test's flash-attn stand-in on the CPU of a machine with a GPU
    if setting == "auto" and (fused_ops_triton.INTERPRETED or not torch.cuda.is_available()):
        # A kernel backend on a CPU-only machine is a test's fake (flash-attn stubs) or the
        # interpreter: the compiled kernels have no device to run on.
        return UNFUSED
    return _fused_ops()
