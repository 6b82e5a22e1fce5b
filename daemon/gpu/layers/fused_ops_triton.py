"""A decoder layer's small ops as one Triton kernel each (the contract of each is its
torch reference in llmd.gpu.layers.fused_ops, which says when a model uses them). Made for
CUDA; on CPU they run only in Triton's interpreter (TRITON_INTERPRET=1 set before triton
is imported), which is how the tests check them.

- `rms_norm`: RMSNorm of each row, optionally after adding the residual (which it also
  writes out), in Llama's convention (normalise in fp32, round to the activation dtype,
  then times the weight) or Gemma's (times 1 + w in fp32, then round).
- `act_and_mul`: act(gate) * up of a fused [gate | up] projection (silu, gelu with tanh,
  exact gelu).
- `qkv_rope_cache`: from the fused q/k/v projection, per head: the optional q/k RMSNorm,
  the neox rotary embedding of the first rotary_dim dimensions, q written out as
  [T, H, D] and the rotated K with V written straight into the paged cache at the step's
  slot mapping (a negative slot is a padding row and writes nothing); into a quantized
  cache (kv_cache_dtype fp8/int8) through the layer's reciprocal scales, as
  kv_quant.quantize writes them (kv_quant_triton.kv_encode).

Every kernel computes in fp32 and rounds to the activation dtype wherever the reference
rounds (after each torch op in bf16/fp16), so in bf16 it differs from the reference only
where the fp32 values it rounds differ in their last bits (a different summation order,
rsqrt, exp). Launched with enable_fp_fusion=False: torch rounds a product before adding
it, which a fused multiply-add would not. Shapes alone decide the grids and nothing is read back to the host, so each
launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.gpu.layers.kv_quant import UNIT_SCALES, KVScales, cache_format, narrower_float
from llmd.gpu.layers.kv_quant_triton import bf16_rounded, kv_encode, kv_mode
from llmd.gpu.layers.triton_attention import stable_tanh

# Whether the kernels run in Triton's interpreter (decided when triton was imported).
# The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest even), so
# there the kernels round to bf16 on the bits themselves (EMULATE_BF16).
INTERPRETED = bool(triton.knobs.runtime.interpret)
_TL_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
ACTIVATION_KERNELS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# Constants a kernel reads must be constexpr.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_GELU_KAPPA = tl.constexpr(0.044715)
ACT_BLOCK = 1024  # intermediate columns per act_and_mul program


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest even) and kept in fp32: the rounding a torch op
    in DTYPE applies to its fp32 result."""
    if EMULATE_BF16:
        y = bf16_rounded(x)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _normalized(x, w, inv_rms, GEMMA: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """x * inv_rms times the weight, rounded as norms.RMSNorm (round, then times w, round
    again) or, with GEMMA, as GemmaRMSNorm (times 1 + w in fp32, one rounding)."""
    if GEMMA:
        y = _rounded(x * inv_rms * (1.0 + w), DTYPE, EMULATE_BF16)
    else:
        y = _rounded(w * _rounded(x * inv_rms, DTYPE, EMULATE_BF16), DTYPE, EMULATE_BF16)
    return y


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
              ADD: tl.constexpr, GEMMA: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr,
              BLOCK: tl.constexpr):
    """One program per row: (with ADD) residual = x + residual, written out; then the
    normalised row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x + r, DTYPE, EMULATE_BF16)
        tl.store(res_out_ptr + row * stride_ro + offs, x.to(DTYPE), mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    y = _normalized(x, w, inv_rms, GEMMA, DTYPE, EMULATE_BF16)
    tl.store(out_ptr + row * stride_o + offs, y.to(DTYPE), mask=mask)


@triton.jit
def _act_and_mul(x_ptr, out_ptr, stride_x, stride_o, n, ACT: tl.constexpr, DTYPE: tl.constexpr,
                 EMULATE_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (row, column block): out[row, c] = act(x[row, c]) * x[row, n + c], the
    activation rounded to DTYPE before the product as in torch."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == "gelu_tanh":
        # torch's formula, so that the cancellation in 1 + tanh(u) near u = -inf is torch's too.
        inner = _SQRT_2_OVER_PI * (gate + _GELU_KAPPA * gate * gate * gate)
        act = 0.5 * gate * (1.0 + stable_tanh(inner))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * _SQRT_HALF))
    act = _rounded(act, DTYPE, EMULATE_BF16)
    tl.store(out_ptr + row * stride_o + offs, _rounded(act * up, DTYPE, EMULATE_BF16).to(DTYPE), mask=mask)


@triton.jit
def _rotated_head(src, w_ptr, cos_row, sin_row, eps, D: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr,
                  GEMMA: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head's D values at src, (with NORM) RMS-normalised with weight w_ptr, then its
    first ROT dimensions rotated neox-style: x * cos + rotate_half(x) * sin, each product
    and the sum rounded to DTYPE as rotary.apply_rotary rounds them. rotate_half's
    partner of dimension d is d + ROT/2 (negated) below ROT/2, d - ROT/2 above: loaded a
    second time rather than moved between lanes."""
    half = ROT // 2
    offs = tl.arange(0, BLOCK_D)
    in_head = offs < D
    rotated = offs < ROT
    partner = tl.where(offs < half, offs + half, offs - half)
    x = tl.load(src + offs, mask=in_head, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=in_head, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        x = _normalized(x, w, inv_rms, GEMMA, DTYPE, EMULATE_BF16)
        x_partner = _normalized(x_partner, w_partner, inv_rms, GEMMA, DTYPE, EMULATE_BF16)
    x_partner = tl.where(offs < half, -x_partner, x_partner)
    cos = tl.load(cos_row + offs, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + offs, mask=rotated, other=0.0).to(tl.float32)
    y = _rounded(_rounded(x * cos, DTYPE, EMULATE_BF16) + _rounded(x_partner * sin, DTYPE, EMULATE_BF16),
                 DTYPE, EMULATE_BF16)
    return tl.where(rotated, y, x)


@triton.jit
def _qkv_rope_cache(qkv_ptr, q_ptr, k_cache, v_cache, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, stride_t,
                    stride_qt, stride_qh, stride_cos, stride_sin, stride_ch, stride_cs, eps, k_inv, v_inv,
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr,
                    GEMMA: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
                    KV_MODE: tl.constexpr, CACHE_EMULATE_BF16: tl.constexpr):
    """Grid (token, head of H query then KVH kv heads). Row t of qkv is [q heads | k heads
    | v heads], D each. A query head goes to q_ptr; a kv head's rotated K and its V go to
    cache slot slot_ptr[t] (nothing for a negative slot)."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = qkv_ptr + t * stride_t
    cos_row = cos_ptr + t * stride_cos
    sin_row = sin_ptr + t * stride_sin
    offs = tl.arange(0, BLOCK_D)
    in_head = offs < D
    if head < H:
        q = _rotated_head(row + head * D, q_w_ptr, cos_row, sin_row, eps, D, ROT, NORM, GEMMA, DTYPE,
                          EMULATE_BF16, BLOCK_D)
        tl.store(q_ptr + t * stride_qt + head * stride_qh + offs, q.to(DTYPE), mask=in_head)
    else:
        kv_head = head - H
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            k = _rotated_head(row + (H + kv_head) * D, k_w_ptr, cos_row, sin_row, eps, D, ROT, NORM, GEMMA, DTYPE,
                              EMULATE_BF16, BLOCK_D)
            v = tl.load(row + (H + KVH + kv_head) * D + offs, mask=in_head)
            dst = kv_head.to(tl.int64) * stride_ch + slot * stride_cs + offs
            if KV_MODE == 0:  # rounded to DTYPE as the reference's k, then to the cache's float (if another)
                k = k.to(DTYPE)
                if CACHE_EMULATE_BF16:  # a bfloat16 cache of float32 K/V, in the interpreter
                    k = bf16_rounded(k.to(tl.float32))
                    v = bf16_rounded(v.to(tl.float32))
                tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=in_head)
                tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=in_head)
            else:  # k is already rounded to DTYPE, as the reference quantizes it
                tl.store(k_cache + dst, kv_encode(k, k_inv, KV_MODE), mask=in_head)
                tl.store(v_cache + dst, kv_encode(v.to(tl.float32), v_inv, KV_MODE), mask=in_head)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with the last dimension at stride 1 (a view when it can be)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _kernel_dtype(x: torch.Tensor) -> tuple[tl.dtype, bool]:
    """(DTYPE, EMULATE_BF16) of the kernels for activations of x's dtype."""
    if x.dtype not in _TL_TYPES:
        raise ValueError(f"fused ops run in float32, bfloat16 or float16, not {x.dtype}")
    return _TL_TYPES[x.dtype], INTERPRETED and x.dtype == torch.bfloat16


def _num_warps(elements: int) -> int:
    return 1 if elements <= 256 else 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over x's last dimension (weight in x's dtype); with `residual`, of
    x + residual, returning (normed, x + residual) as RMSNorm.forward_add."""
    if weight.dtype != x.dtype:
        raise ValueError(f"fused rms_norm takes the weight in the activations' dtype ({x.dtype}), not {weight.dtype}")
    shape, n = x.shape, x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_in = res_out = out  # not read without ADD
    if residual is not None:
        res_in = _rows(residual)
        res_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        dtype, emulate = _kernel_dtype(x)
        block = triton.next_power_of_2(n)
        _rms_norm[(rows.shape[0],)](
            rows, res_in, weight, out, res_out, rows.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0), n,
            eps, ADD=residual is not None, GEMMA=gemma, DTYPE=dtype, EMULATE_BF16=emulate, BLOCK=block,
            num_warps=_num_warps(block), enable_fp_fusion=False)
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a fused [gate | up] projection ([..., 2 * n] -> [..., n]);
    `activation` is a norms.ACTIVATIONS name."""
    kernel_act = ACTIVATION_KERNELS.get(activation)
    if kernel_act is None:
        raise ValueError(f"no fused kernel for activation {activation!r} (fused: {', '.join(ACTIVATION_KERNELS)})")
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        dtype, emulate = _kernel_dtype(gate_up)
        block = min(ACT_BLOCK, triton.next_power_of_2(n))
        _act_and_mul[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, ACT=kernel_act, DTYPE=dtype, EMULATE_BF16=emulate,
            BLOCK=block, num_warps=_num_warps(block), enable_fp_fusion=False)
    return out.view(*gate_up.shape[:-1], n)


def qkv_rope_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
                   scales: KVScales = UNIT_SCALES) -> torch.Tensor:
    """q [T, H, D] of a fused qkv projection ([T, (H + 2 * KVH) * D]), normed (with
    `qk_norm` = (q weight, k weight, eps, gemma)) and rotated by cos/sin ([T, 1, rotary
    dim] or [T, rotary dim], rotary.cos_sin's tables); the step's rotated K and its V are
    written into kv_cache ([2, KVH, blocks, block_size, D], contiguous) at slot_mapping,
    quantized with `scales` when the cache is (kv_quant), rounded to it when it holds
    float16 / bfloat16 under float32 activations."""
    fmt = cache_format(kv_cache)
    narrower = narrower_float(kv_cache.dtype, qkv.dtype)
    if not kv_cache.is_contiguous() or (kv_cache.dtype != qkv.dtype and fmt is None and not narrower):
        raise ValueError(f"the fused K/V write needs a contiguous KV cache in the activations' dtype ({qkv.dtype}), "
                         "a quantized one, or float16 / bfloat16 under float32 activations")
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
    q_w, k_w, eps, gemma = qk_norm if qk_norm is not None else (qkv, qkv, 0.0, False)
    dtype, emulate = _kernel_dtype(qkv)
    block_d = triton.next_power_of_2(head_dim)
    _qkv_rope_cache[(t, num_heads + num_kv_heads)](
        qkv, q, kv_cache[0], kv_cache[1], cos, sin, q_w, k_w, slot_mapping, qkv.stride(0), q.stride(0), q.stride(1),
        cos.stride(0), sin.stride(0), kv_cache.stride(1), kv_cache.stride(3), eps, scales.k_inv, scales.v_inv,
        H=num_heads, KVH=num_kv_heads, D=head_dim, ROT=cos.shape[1], NORM=qk_norm is not None, GEMMA=gemma,
        DTYPE=dtype, EMULATE_BF16=emulate, BLOCK_D=block_d, KV_MODE=kv_mode(fmt),
        CACHE_EMULATE_BF16=INTERPRETED and narrower and kv_cache.dtype == torch.bfloat16,
        num_warps=_num_warps(block_d), enable_fp_fusion=False)
    return q
