"""llmd's C++ CPU kernels (cpu_kernels.cpp), built when first asked for and cached on disk.

Today one kernel: decode attention over the paged KV cache read in place. The torch
path (attention.py, TorchAttention._decode) gathers every decode row's blocks into a
padded buffer each layer and step, then runs two batched GEMMs; the kernel reads each
cached row once. Measured 3-5x faster per layer call on CPU in float32, ~2x in bfloat16
(docs/benchmarks.md, "CPU model step"). The loader hands it to every TorchAttention
layer of a model on CPU (`attach_cpu_kernels`).

Built with torch.utils.cpp_extension for this CPU's vector ISA (AVX-512, AVX2, or
generic), into `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions/`), one build
per ISA; a later start with the same source, flags and torch loads the cached library
(~0.3 s) instead of compiling it (~10-20 s on two cores). It needs a C++ compiler and
ninja; without them, or if the build fails, attention keeps its torch path and the
reason is logged once. LLMD_CPU_KERNELS=0 keeps the torch path on purpose (the A/B
switch; read when a model loads).

The kernels register as torch operators (`torch.ops.llmd_cpu.*`): tensors in and out,
no Python binding layer.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from llmd.gpu.attention import TorchAttention

logger = logging.getLogger("llmd.cpu_kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CPU_KERNELS_ENV = "LLMD_CPU_KERNELS"
# Compiler flags of each vector ISA (as inductor builds its CPU kernels for them).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


def vector_isa() -> str:
    """The vector ISA the kernels are built for: torch's own choice for this CPU,
    "DEFAULT" (portable C++) where we have no flags for it."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else "DEFAULT"


@functools.cache
def _load() -> Callable[..., torch.Tensor] | None:
    from torch.utils.cpp_extension import load

    isa = vector_isa()
    logger.info("loading llmd's CPU kernels for %s (compiled on the first start only)", isa)
    try:
        load(name=f"llmd_cpu_kernels_{isa.lower()}", sources=[str(SOURCE)],
             extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS.get(isa, [])], extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch path stays
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        logger.warning("CPU kernels unavailable (%s: %s); attention runs its torch path",
                       type(exc).__name__, last_line)
        return None
    return torch.ops.llmd_cpu.paged_decode


def paged_decode_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.llmd_cpu.paged_decode(q [B, H, D], kv_cache [2, KVH, blocks,
    block_size, D], block_table [B, max_blocks] int64, seq_lens [B] int64, scale,
    softcap (0: none), window (0: none)) -> [B, H, D]: decode attention over the
    paged cache read in place (cpu_kernels.cpp). Built on first call; None if it
    cannot be."""
    return _load()


def cpu_kernels_enabled() -> bool:
    """False when LLMD_CPU_KERNELS is "0" or "off" (module docstring)."""
    value = os.environ.get(CPU_KERNELS_ENV, "").strip().lower()
    if value not in ("", "1", "on", "0", "off"):
        raise ValueError(f"{CPU_KERNELS_ENV} must be one of 0, 1 (or off, on), got {value!r}")
    return value not in ("0", "off")


def attach_cpu_kernels(model: nn.Module) -> int:
    """Give every TorchAttention layer of a CPU model the paged decode kernel; returns
    how many layers got it (0 when none attend with torch, the kernels are switched off
    or cannot be built)."""
    layers = [m.attn for m in model.modules() if isinstance(getattr(m, "attn", None), TorchAttention)]
    if not layers or not cpu_kernels_enabled():
        return 0
    kernel = paged_decode_op()
    if kernel is None:
        return 0
    for attn in layers:
        attn.decode_kernel = kernel
    return len(layers)
