"""Linear layers on CPU through oneDNN with weights packed once at load.

`F.linear` on CPU calls MKL's sgemm for float32, which on this project's AMD machine
runs well below the AVX-512 peak, and re-reads each weight in its plain [out, in] layout
every call. oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, what inductor's
CPU backend emits for a frozen linear) takes the weight reordered once into its blocked
layout: measured 1.4-1.9x faster per GEMM at 1-32 rows and 1.3-1.6x at 2,048 (float32),
1.1-2.2x in bfloat16 (docs/benchmarks.md, "CPU model step"). It accumulates in float32
as MKL does; a row's result does not depend on how many rows share the call.

`pack_linears` gives every linear of a model a packed matmul: the model's own layers
(layers/linear.py: LinearBase and the LM head) take it as their `kernel`, so a
row-parallel layer still reduces and adds its bias after; a plain `nn.Linear` gets a
packed forward. The model's own layers then give up the checkpoint layout: their
`weight` becomes an empty tensor of its dtype (`released_shape` keeps the shape), so a
model holds its linear weights once, in oneDNN's layout, where it held them twice (a 1B
model in float32: 9.7 GB for 4.7). A weight whose storage another parameter shares
stays (a tied LM head's is the embedding's table, which lookups read), and so does a
plain `nn.Linear`'s (other code may read it). A weight changed after packing is packed
again at the next call: a new parameter set on the module, or an in-place write that
bumps its version (under `torch.no_grad()`); a write through `.data` is not seen.
`unpack_linears` restores MKL's path and the checkpoint layout (benchmarks compare the
two in one process).

A layer with few outputs (a MoE router: one per expert; the shared-expert gate's one)
says `plain_matmul` and keeps F.linear: oneDNN's call costs ~14 us whatever the size, so
at one row a [32, 1024] router took 15.5 us through it and 4.0 through F.linear, and
[128, 1024] 21.0 against 10.5 (2 Zen 4 cores; equal at 16 rows, oneDNN ahead from ~128:
docs/benchmarks.md, "MoE GGUF").
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from llmd.gpu.layers.linear import LinearBase, ParallelLMHead


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs packed linears of `dtype` on this CPU (bfloat16 needs
    AVX512-BF16 or AMX; float16 is left to MKL)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class PackedLinearForward:
    """A linear's forward over its weight in oneDNN's packed layout; the bias is the
    module's own parameter (`with_bias=False`: none, a reducing layer adds it after).
    Re-packs when the module's weight changed (module doc)."""

    def __init__(self, linear: nn.Module, with_bias: bool = True) -> None:
        self.module = weakref.ref(linear)  # the module holds this forward: no cycle
        self.out_features = linear.weight.shape[0]
        self.with_bias = with_bias
        self.released_shape: torch.Size | None = None  # the weight's, once its plain layout was given up
        self._pack(linear)

    def _pack(self, linear: nn.Linear) -> None:
        self.source = linear.weight
        self.version = _version(linear.weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.released_shape = None

    def release_plain(self, linear: nn.Module) -> None:
        """Hold the weight in the packed layout alone: the module's `weight` becomes an
        empty tensor of its dtype and device (module doc)."""
        weight = linear.weight
        linear.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        self.source, self.version = linear.weight, _version(linear.weight)
        self.released_shape = weight.shape

    def plain(self) -> torch.Tensor:
        """The released weight in the checkpoint layout, made again from the packed one."""
        return self.packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.module()
        if linear.weight is not self.source or _version(linear.weight) != self.version:
            self._pack(linear)
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        bias = linear.bias if self.with_bias else None
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def _version(weight: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (None for an inference tensor, which has none)."""
    return None if weight.is_inference() else weight._version


def _kernel_slot(module: nn.Module) -> bool:
    """Whether `module` is one of the model's linears, which take a matmul `kernel`."""
    return isinstance(module, (LinearBase, ParallelLMHead))


def pack_linears(model: nn.Module) -> int:
    """Give every linear of `model` (on CPU, of a dtype oneDNN packs) a packed matmul and
    release the plain layout of the model's own layers' weights that no other parameter
    shares (module doc); returns how many were packed. Subclasses of nn.Linear (with
    their own forward) keep theirs."""
    shared = _shared_storages(model)
    count = 0
    for module in model.modules():
        slot = _kernel_slot(module)
        if not (slot or type(module) is nn.Linear) or module.weight.device.type != "cpu":
            continue
        if getattr(module, "plain_matmul", False):  # a router's few outputs (module doc)
            continue
        if not packing_supported(module.weight.dtype):
            continue
        if slot:
            module.kernel = PackedLinearForward(module, with_bias=not getattr(module, "reduce", False))
            if module.weight.untyped_storage().data_ptr() not in shared:
                module.kernel.release_plain(module)
        else:
            module.forward = PackedLinearForward(module)
        count += 1
    return count


def checkpoint_weight(module: nn.Module) -> torch.Tensor:
    """A linear's weight in the checkpoint layout, also where pack_linears released it
    (then made again from oneDNN's copy: for inspection, not a step's work)."""
    kernel = getattr(module, "kernel", None)
    if isinstance(kernel, PackedLinearForward) and kernel.released_shape is not None:
        return kernel.plain()
    return module.weight


def _shared_storages(model: nn.Module) -> set[int]:
    """The storages more than one of the model's parameters views (tied weights)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        key = p.untyped_storage().data_ptr()
        (shared if key in seen else seen).add(key)
    return shared


def unpack_linears(model: nn.Module) -> None:
    """Back to F.linear for every packed linear of `model`, each weight in its checkpoint
    layout again."""
    for module in model.modules():
        if _kernel_slot(module):
            if isinstance(module.kernel, PackedLinearForward) and module.kernel.released_shape is not None:
                module.weight = nn.Parameter(module.kernel.plain(), requires_grad=False)
            module.kernel = None
        elif isinstance(module.__dict__.get("forward"), PackedLinearForward):
            del module.forward

