"""llmd's C++ CPU kernels (cpu_kernels.cpp), built by the set-up (`make`, or `python -m
llmd.gpu.layers.cpu.cpu_kernels` at install: README) or else when first asked for, and
cached on disk.

Five sets, one extension:
- decode attention over the paged KV cache read in place (cpu_kernels.cpp). The torch
  path (attention.py, TorchAttention._decode) gathers every decode row's blocks into a
  padded buffer each layer and step, then runs two batched GEMMs; the kernel reads each
  cached row once. Measured 3-5x faster per layer call on CPU in float32, ~2x in
  bfloat16 (docs/benchmarks.md, "CPU model step").
- the fused layer ops (cpu_fused_ops.cpp, wrapped by cpu_fused_ops.CpuFusedLayerOps):
  residual add + RMSNorm, q/k norm + rotary + K/V write, act(gate) * up;
- the product of a few rows with a GGUF block-quantized weight kept packed
  (cpu_quant.cpp, used by gguf_quant.GGUFMatmul), and on a CPU with AVX-512 VNNI or
  AVX2 (+FMA, F16C) the same over the weight repacked sixteen rows at a time with int8
  activations, as llama.cpp multiplies (cpu_quant_x16.cpp, every packed type; the AVX2
  product in cpu_quant_x16_avx2.cpp), in two int8 passes over x, or one with the engine
  setting cpu_int8_activations (gguf_quant.x16_passes). LLMD_GGUF_X16 (read when a model
  loads) sets the passes instead: 1 (llama.cpp's precision), 2 or 3 (float32's); 0 keeps
  the first kernel (the A/B switch). LLMD_GGUF_X16_ISA
  (read once, by the kernel) picks the x16 product's ISA, avx512_vnni or avx2 (the A/B
  switch of the two, and how a CI machine with AVX-512 tests the AVX2 one); unset, the
  best this CPU runs;
- the product of a few rows with an FP8 weight kept as its e4m3 bytes (cpu_fp8.cpp, used
  by quant/fp8.FP8Matmul; AWQ and GPTQ weights become GGUF blocks and use the set above);
- a decoder's layers for a one-token step of one request, chaining the operators above
  with no Python between them (cpu_decode_layers.cpp, built by cpu_decode_layers.py).
The loader hands both to a model on CPU whose layers attend with TorchAttention
(`attach_cpu_kernels`).

Built with torch.utils.cpp_extension for this CPU's vector ISA (AVX-512, AVX2, or
generic) through kernel_build: into `$TORCH_EXTENSIONS_DIR` (default
`~/.cache/torch_extensions/`), one folder per key — the sources' digest, the ISA's flags,
torch, the Python executable and prefix (the venv), the compiler — so two installs on
one machine keep their own builds; the build runs in a child process under an flock that
dies with its holder, within LLMD_KERNEL_BUILD_TIMEOUT seconds (default 300, a wait for
another process's build of the same folder included); a daemon stopped meanwhile kills
it and exits. A later start with the same key loads the built library (~20 ms) instead
of compiling it (~40 s on two cores). It needs a C++ compiler and ninja; without them,
if the build fails or the time limit passes, attention keeps its torch path and the
reason is logged once. LLMD_CPU_KERNELS=0 keeps the torch path on purpose (the A/B
switch; read when a model loads).

The kernels register as torch operators (`torch.ops.llmd_cpu.*`): tensors in and out,
no Python binding layer.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmd.gpu.layers.attention import TorchAttention
from llmd.gpu.layers.cpu.cpu_fused_ops import use_cpu_fused_ops
from llmd.gpu.layers.fused_ops import fused_ops_setting
from llmd.gpu.layers.gguf_quant import FORMATS, GGUFMatmul, use_x16, x16_passes, x16_row_reader
from llmd.gpu.layers.linear import ParallelLMHead
from llmd.gpu.layers.cpu.kernel_build import ExtensionBuild, KernelBuildCancelled, KernelBuildError, build_library

logger = logging.getLogger("llmd.cpu_kernels")

# The longest compiles first (ninja starts them in this order, as many as the cores and
# one more; measured on AVX2: the operators' files 23-32 s, the x16 product's 10-18 s).
SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_fused_ops.cpp", "cpu_kernels.cpp", "cpu_quant.cpp", "cpu_quant_x16.cpp",
                        "cpu_decode_layers.cpp", "cpu_quant_x16_avx2_p3.cpp", "cpu_fp8.cpp",
                        "cpu_quant_x16_avx2_p2.cpp", "cpu_quant_x16_avx2.cpp")]
HEADERS = [Path(__file__).with_name(name)  # part of the digest
           for name in ("cpu_vec.h", "cpu_e4m3.h", "cpu_kv_rows.h", "cpu_quant_formats.h", "cpu_quant_x16_layout.h",
                        "cpu_quant_x16_product.h", "cpu_quant_x16_records.h", "cpu_quant_x16_records_avx2.h",
                        "cpu_quant_x16_avx2_tiles.h", "cpu_quant_x16_vnni.h")]
CPU_KERNELS_ENV = "LLMD_CPU_KERNELS"
X16_ENV = "LLMD_GGUF_X16"
KERNEL_BUILD_TIMEOUT_ENV = "LLMD_KERNEL_BUILD_TIMEOUT"
DEFAULT_KERNEL_BUILD_TIMEOUT_S = 300.0
# Compiler flags of each vector ISA (as inductor builds its CPU kernels for them).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


def vector_isa() -> str:
    """The vector ISA the kernels are built for: torch's own choice for this CPU,
    "DEFAULT" (portable C++) where we have no flags for it."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else "DEFAULT"


def source_digest() -> str:
    """8 hex digits of the kernels' sources (their full digest is part of the build's key)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def kernels_build() -> ExtensionBuild:
    """The kernels' build for this CPU: its folder is `kernels_build().directory()`."""
    isa = vector_isa()
    return ExtensionBuild(name=f"llmd_cpu_kernels_{isa.lower()}_{source_digest()}", sources=tuple(SOURCES),
                          headers=tuple(HEADERS), cflags=("-O3", "-fopenmp", *ISA_FLAGS.get(isa, [])),
                          ldflags=("-fopenmp",))


def kernel_build_timeout() -> float:
    """Seconds the kernels may take to be ready (LLMD_KERNEL_BUILD_TIMEOUT, default 300)."""
    value = os.environ.get(KERNEL_BUILD_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_KERNEL_BUILD_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{KERNEL_BUILD_TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


@functools.cache
def _load() -> bool:
    timeout = kernel_build_timeout()
    logger.info("loading llmd's CPU kernels for %s (compiled once per version of their sources)", vector_isa())
    try:
        library = build_library(kernels_build(), timeout)
        torch.ops.load_library(str(library))
    except KernelBuildCancelled:
        raise  # the process exits: the load stops here
    except KernelBuildError as exc:
        logger.warning("CPU kernels unavailable: %s; the layers run their torch path", exc)
        return False
    except Exception as exc:  # no compiler, no ninja, an unwritable cache: the torch path stays
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        logger.warning("CPU kernels unavailable (%s: %s); the layers run their torch path",
                       type(exc).__name__, last_line)
        return False
    return True


def paged_decode_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.llmd_cpu.paged_decode(q [B, H, D], kv_cache [2, KVH, blocks,
    block_size, D], block_table [B, max_blocks] int64, seq_lens [B] int64, scale,
    softcap (0: none), window (0: none), k_scale=1, v_scale=1) -> [B, H, D]: decode
    attention over the paged cache read in place (cpu_kernels.cpp), a quantized one
    (uint8 e4m3 bytes or int8, kv_quant) dequantized with the scales as it is read.
    Built on first call; None if it cannot be."""
    return torch.ops.llmd_cpu.paged_decode if _load() else None


@dataclass(frozen=True)
class GGUFOps:
    """The C++ operators of packed GGUF weights (cpu_quant.cpp): `mm(x, w, code, cols)`
    and `dequantize(w, code, cols)`; of weights in the x16 layout (cpu_quant_x16.cpp):
    `repack_x16(w, code, cols)` (`repack_x16_` in place), `unpack_x16(w, rows, code, cols)`,
    `dequantize_x16(w, code, cols)` and, when `x16` (the CPU has AVX-512 VNNI or AVX2
    with FMA and F16C, and LLMD_GGUF_X16 is not 0), `mm_x16(x, w, code, cols, passes,
    isa="")` (isa: one of `x16_isas`, the ISAs this CPU runs it with, best first; "" the
    one LLMD_GGUF_X16_ISA names, else the best; `x16_isa` is that one), and
    `mm_x16_into(x, w, code, cols, passes, isa, out)` into a float32 buffer; `x16_passes`:
    LLMD_GGUF_X16's passes, if it set them."""

    mm: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]
    repack_x16: Callable[..., torch.Tensor]
    repack_x16_: Callable[..., torch.Tensor]
    unpack_x16: Callable[..., torch.Tensor]
    mm_x16: Callable[..., torch.Tensor]
    dequantize_x16: Callable[..., torch.Tensor]
    x16: bool
    x16_passes: int | None = None
    x16_isas: tuple[str, ...] = ()
    x16_isa: str = ""
    mm_x16_into: Callable[..., torch.Tensor] | None = None  # (x, w, code, cols, passes, isa, out) -> out
    # (x, w, code, cols, passes, isa, logits, norms, limit) -> groups, and (w, code, cols) ->
    # each row's L2 norm: greedy_head.GreedyHead
    argmax_refine_: Callable[..., int] | None = None
    row_norms: Callable[..., torch.Tensor] | None = None


def gguf_ops() -> GGUFOps | None:
    """torch.ops.llmd_cpu.gguf_mm(x [M, K], w uint8 [N, K / block * block bytes], quant
    (gguf_formats.FORMATS' code), K) -> [M, N], x times a packed GGUF weight, and
    gguf_dequantize(w, quant, K) -> float32 [N, K] (cpu_quant.cpp). None when the
    kernels are switched off (LLMD_CPU_KERNELS=0) or cannot be built."""
    if not cpu_kernels_enabled() or not _load():
        return None
    ops = torch.ops.llmd_cpu
    value = os.environ.get(X16_ENV, "").strip()
    if value not in ("", "0", "1", "2", "3"):
        raise ValueError(f"{X16_ENV} must be 0, 1, 2 or 3, got {value!r}")
    isas = tuple(ops.gguf_x16_isas())
    x16 = value != "0" and bool(ops.gguf_x16_supported())  # (refuses an LLMD_GGUF_X16_ISA this CPU lacks)
    isa = (os.environ.get("LLMD_GGUF_X16_ISA") or isas[0]) if x16 else ""  # what mm_x16's isa="" runs with
    return GGUFOps(ops.gguf_mm, ops.gguf_dequantize, ops.gguf_repack_x16, ops.gguf_repack_x16_, ops.gguf_unpack_x16,
                   ops.gguf_mm_x16, ops.gguf_dequantize_x16, x16=x16, x16_passes=int(value) if value else None,
                   x16_isas=isas, x16_isa=isa, mm_x16_into=ops.gguf_mm_x16_into if x16 else None,
                   argmax_refine_=ops.gguf_x16_argmax_refine_ if x16 else None,
                   row_norms=ops.gguf_x16_row_norms if x16 else None)


@dataclass(frozen=True)
class FP8Ops:
    """The C++ operators of FP8 weights kept as e4m3 bytes (cpu_fp8.cpp): `mm(x, w,
    scales)` and `dequantize(w, scales)` (quant/fp8.py)."""

    mm: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]


def fp8_ops() -> FP8Ops | None:
    """torch.ops.llmd_cpu.fp8_mm(x [M, K], w uint8 [N, K], scales float32 [N, G]) -> [M, N]
    and fp8_dequantize(w, scales) -> float32 [N, K]; None when the kernels are switched
    off (LLMD_CPU_KERNELS=0) or cannot be built."""
    if not cpu_kernels_enabled() or not _load():
        return None
    return FP8Ops(torch.ops.llmd_cpu.fp8_mm, torch.ops.llmd_cpu.fp8_dequantize)


def cpu_kernels_enabled() -> bool:
    """False when LLMD_CPU_KERNELS is "0" or "off" (module docstring)."""
    value = os.environ.get(CPU_KERNELS_ENV, "").strip().lower()
    if value not in ("", "1", "on", "0", "off"):
        raise ValueError(f"{CPU_KERNELS_ENV} must be one of 0, 1 (or off, on), got {value!r}")
    return value not in ("0", "off")


def attach_cpu_kernels(model: nn.Module) -> int:
    """Give every TorchAttention layer of a CPU model the paged decode kernel, and its
    modules the fused layer ops (unless LLMD_FUSED_OPS=0); returns how many layers got
    the kernel (0 when none attend with torch, the kernels are switched off or cannot
    be built)."""
    layers = [m.attn for m in model.modules() if isinstance(getattr(m, "attn", None), TorchAttention)]
    if not layers or not cpu_kernels_enabled():
        return 0
    kernel = paged_decode_op()
    if kernel is None:
        return 0
    for attn in layers:
        attn.decode_kernel = kernel
    if fused_ops_setting() != "off":
        use_cpu_fused_ops(model)
    return len(layers)


def attach_gguf_kernels(model: torch.nn.Module, dtype: torch.dtype, int8_activations: bool = False) -> int:
    """Give every packed layer of a CPU model its matmul (GGUFMatmul, with the C++
    kernels when they can be built; a MoE layer's packed experts one per projection of
    each expert) and every packed table the dtype its rows are dequantized to; returns
    how many layers are packed. On a CPU with AVX-512 VNNI or
    AVX2 the weights the x16 kernel reads are repacked in place first (gguf_quant.use_x16: a
    table tied to the LM head is read through the same layout), and multiplied in
    x16_passes(int8_activations) passes over x; the LM head's logits into a buffer it
    reuses (gguf_quant.REUSED_OUTPUT_BYTES)."""
    ops, passes = _gguf_ops_and_passes(int8_activations)
    count = 0
    for module in model.modules():
        if getattr(module, "quant", None) is None:
            continue
        count += 1
        if hasattr(module, "use_kernels"):  # a MoE layer's packed experts (mlp.ExpertWeights)
            module.use_kernels(ops, passes)
        elif hasattr(module, "kernel"):
            module.kernel = GGUFMatmul(module, ops, passes, reuse_output=isinstance(module, ParallelLMHead))
        else:
            module.compute_dtype = dtype
            (table,) = module.packed_parts
            if passes and use_x16(module.weight, table, module.in_features, ops):
                module.read_rows = x16_row_reader(module, ops)
            if ops is not None:  # a lookup's rows decoded in C++ (the torch reference is ~10 operators)
                code, cols = FORMATS[table.quant].code, module.in_features
                module.dequantize_rows = lambda rows, code=code, cols=cols: ops.dequantize(rows, code, cols)
    return count


def _gguf_ops_and_passes(int8_activations: bool) -> tuple[GGUFOps | None, int]:
    """The packed kernels and the x16 passes over x their products take (0: no x16)."""
    ops = gguf_ops()
    return ops, x16_passes(ops, int8_activations) if ops is not None and ops.x16 else 0


def attach_expert_kernels(model: torch.nn.Module, int8_activations: bool = False) -> int:
    """Give the packed experts of a CPU model whose other layers are not a GGUF's (an AWQ
    or GPTQ checkpoint's, held as GGUF blocks, or an FP8 one's: quant_plan.plan_quantized_experts)
    their products, as attach_gguf_kernels does; returns how many MoE layers have them."""
    experts = [m for m in model.modules() if hasattr(m, "use_kernels") and getattr(m, "quant", None)]
    if experts:
        ops, passes = _gguf_ops_and_passes(int8_activations)
        for module in experts:
            module.use_kernels(ops, passes, fp8_ops())
    return len(experts)


def main() -> int:
    """`python -m llmd.gpu.layers.cpu.cpu_kernels`: build the kernels now (make setup/test
    do, so no daemon start and no test waits on the compiler); 1 if they cannot be."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = _load()
    logger.info("llmd's CPU kernels: %s", "ready" if built else "unavailable (the torch paths run)")
    return 0 if built else 1


if __name__ == "__main__":
    raise SystemExit(main())
