"""Sleep mode on the worker side: what a sleeping model runner gives back, and how its
weights come back. The runner (model_runner.ModelRunner.sleep / wake_up) frees its KV
cache and decode graphs at every level; at level 1 on CUDA it moves its weights to
pinned host memory with `HostWeights` (on CPU they are in host memory already and stay
where they are); at level 2 it drops them and loads them again from the model's files
at wake. `free_released_memory` then hands what was freed back to the system: the CUDA
caching allocator's blocks to the driver, glibc's freed heap to the kernel.

HostWeights moves tensors in place (`Tensor.set_`), so every holder of one (a layer, the
sampler's LM head, a tied embedding) sees it moved and restored; each storage is copied
once, so tied weights stay tied and views of one buffer stay views of it."""
from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from llmd.heap import trim_heap


@dataclass
class _Storage:
    """One device storage's bytes on the host, and the tensors that viewed it."""

    host: torch.Tensor  # uint8, the storage's bytes
    views: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


def module_tensors(roots: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every tensor the modules hold: parameters, buffers, plain tensor attributes, and
    the views an attribute's kernel keeps of them (`held_tensors()`: the CUDA packed
    kernels' planes, quant/cuda_matmul), each tensor once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for root in roots:
        for module in root.modules():
            attrs = vars(module).values()
            held = (*module._parameters.values(), *module._buffers.values(),
                    *(v for v in attrs if isinstance(v, torch.Tensor)),
                    *(t for v in attrs if hasattr(v, "held_tensors") for t in v.held_tensors()))
            for t in held:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


class HostWeights:
    """The tensors of `modules` copied to host memory (pinned when `pin`: they go back
    to a CUDA device with an asynchronous copy) and emptied where they were, so their
    device memory is free once nothing else holds it. `restore(device)` puts them back."""

    def __init__(self, modules: Iterable[torch.nn.Module], pin: bool) -> None:
        storages: dict[int, _Storage] = {}
        tensors = [t for t in module_tensors(modules) if t.untyped_storage().nbytes() > 0]
        with torch.no_grad():
            for t in tensors:
                storage = t.untyped_storage()
                entry = storages.get(storage.data_ptr())
                if entry is None:
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                    host.untyped_storage().copy_(storage)
                    entry = storages[storage.data_ptr()] = _Storage(host)
                entry.views.append((t, t.storage_offset(), tuple(t.shape), tuple(t.stride())))
            for t in tensors:
                t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        self._storages = list(storages.values())
        self.nbytes = sum(s.host.numel() for s in self._storages)

    def restore(self, device: torch.device) -> None:
        """Every tensor back on `device`, viewing its storage as before; the host copies go."""
        with torch.no_grad():
            for entry in self._storages:
                data = torch.empty(entry.host.numel(), dtype=torch.uint8, device=device)
                data.copy_(entry.host, non_blocking=True)
                for t, offset, size, stride in entry.views:
                    t.set_(data.untyped_storage(), offset, size, stride)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the pinned copies may go only once they were read
        self._storages = []
        self.nbytes = 0
        # Freed pinned blocks stay in torch's caching host allocator (host RAM held for
        # ever) unless emptied; CUDA builds have the call, CPU-only ones need none.
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if device.type == "cuda" and host_empty_cache is not None:
            host_empty_cache()


def free_released_memory(device: torch.device) -> None:
    """Collect what the runner let go, then give it back to the system: on CUDA the
    caching allocator's free blocks and cuBLAS's workspaces (32 MiB on a Hopper GPU,
    made again by the next GEMM); on the host glibc's freed heap (kept in its arenas
    otherwise, so the resident size would not come down)."""
    gc.collect()
    if device.type == "cuda":
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
    trim_heap()


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's workspaces (torch keeps them once a GEMM ran; the next one makes
    them again), where this torch build has the private call."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
