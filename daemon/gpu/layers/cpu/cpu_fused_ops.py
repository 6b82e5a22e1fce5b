"""The fused layer ops on CPU: fused_ops' LayerOps run as one C++ operator each
(cpu_fused_ops.cpp, built with the other CPU kernels by cpu_kernels).

On CPU the unfused ops cost more in per-operator overhead than in arithmetic at decode
sizes: an RMSNorm is six torch operators, rotary six per q and k, the K/V write two, ~30
a layer at 5-15 us each. Fused, a layer runs four: residual add + RMSNorm (twice),
q/k norm + rotary + K/V write, act(gate) * up; a MoE layer's routing one more (its
router's logits, softmax, top-k and rescale). Figures in docs/benchmarks.md ("CPU
model step").

Each op computes its LayerOps reference, rounded where the reference rounds (in bfloat16
and float16 every intermediate the reference materialises); float32 sums run in another
order, so results agree to a few ulps. Shapes or dtypes the operators do not take (a
non-contiguous input, a norm weight of another dtype) go to the reference instead.

attach_cpu_kernels hands these to a CPU model's layers (their `ops`) when the kernels
load, unless LLMD_FUSED_OPS=0 (the A/B switch, as on GPU) or LLMD_CPU_KERNELS=0.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.attention import AttentionMetadata
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps
from llmd.gpu.layers.kv_quant import cache_format
from llmd.gpu.layers.norms import RMSNorm

# cpu_fused_ops.cpp's activation codes, by ACTIVATIONS name.
ACT_CODES = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2}


def _rows(x: torch.Tensor, norm: nn.Module) -> bool:
    """Whether x [..., N] can go to the C++ norms as rows: an RMSNorm (a test may swap in
    another module), x contiguous and of its weight's dtype."""
    return (isinstance(norm, RMSNorm) and x.is_contiguous() and x.dtype == norm.weight.dtype and x.dim() >= 1
            and x.shape[-1] == norm.weight.numel())


class CpuFusedLayerOps(LayerOps):
    """LayerOps as cpu_fused_ops.cpp's operators (module docstring)."""

    fused = True

    def __init__(self) -> None:
        self.kernels = torch.ops.llmd_cpu

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if not _rows(x, norm):
            return UNFUSED.rms_norm(norm, x)
        out = self.kernels.rms_norm(x.view(-1, x.shape[-1]), norm.weight, norm.eps, norm.gemma_scale)
        return out.view(x.shape)

    def add_rms_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum written into x: the callers pass a
        projection's fresh output."""
        if not (_rows(x, norm) and residual.is_contiguous() and residual.shape == x.shape
                and residual.dtype == x.dtype):
            return UNFUSED.add_rms_norm(norm, x, residual)
        rows = x.view(-1, x.shape[-1])
        out = self.kernels.add_rms_norm_(rows, residual.view(rows.shape), norm.weight, norm.eps, norm.gemma_scale)
        return out.view(x.shape), x

    def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        code = ACT_CODES.get(activation)
        if code is None or not gate_up.is_contiguous() or gate_up.dim() != 2:
            return UNFUSED.act_and_mul(gate_up, activation)
        return self.kernels.act_and_mul(gate_up, code)

    def route(self, gate: Any, x: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense router without a bias (llama.cpp keeps routers float; cpu_linear leaves
        them unpacked) in one operator; any other through the reference."""
        if not (gate.kernel is None and gate.quant is None and gate.bias is None and x.dim() == 2
                and x.is_contiguous() and x.dtype == gate.weight.dtype):
            return UNFUSED.route(gate, x, top_k, renormalize)
        return self.kernels.moe_route(x, gate.weight, top_k, renormalize)

    def attend(self, attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if not _fits_rope(attn, qkv, cos, kv_cache):
            return UNFUSED.attend(attn, qkv, cos, sin, kv_cache, md)
        q_norm = attn.q_norm  # q and k norms both or neither, as rotated_qkv reads them
        norms = (None, None, 1e-6, False) if q_norm is None else (q_norm.weight, attn.k_norm.weight, q_norm.eps,
                                                                   q_norm.gemma_scale)
        scales = attn.attn.kv_scales
        self.kernels.qk_rope_cache_(qkv, attn.num_heads, attn.num_kv_heads, cos, sin, kv_cache, md.slot_mapping,
                                    *norms, scales.k_inv, scales.v_inv)
        t, d = qkv.shape[0], attn.head_dim
        q, k, v = qkv.split([attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d], dim=-1)
        return attn.attn(q.view(t, attn.num_heads, d), k.view(t, attn.num_kv_heads, d),
                         v.view(t, attn.num_kv_heads, d), kv_cache, md, kv_written=True)


def _fits_rope(attn: Any, qkv: torch.Tensor, cos: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the fused q/k/rotary/cache operator takes this layer's step as it is (a
    quantized cache included: it writes the layer's scaled bytes)."""
    same = qkv.dtype == cos.dtype and (kv_cache.dtype == qkv.dtype or cache_format(kv_cache) is not None)
    if attn.q_norm is not None:
        norms = attn.q_norm, attn.k_norm
        same = same and all(isinstance(n, RMSNorm) and n.weight.dtype == qkv.dtype for n in norms)
    return (same and qkv.dim() == 2 and qkv.is_contiguous() and cos.is_contiguous()
            and kv_cache.is_contiguous() and kv_cache.shape[4] == attn.head_dim)


CPU_FUSED = CpuFusedLayerOps()


def use_cpu_fused_ops(model: nn.Module) -> int:
    """Give every module of `model` whose `ops` are the unfused set the C++ ones; returns
    how many modules changed. The caller checked the kernels are built."""
    changed = 0
    for module in model.modules():
        if getattr(module, "ops", None) is UNFUSED:
            module.ops = CPU_FUSED
            changed += 1
    return changed
