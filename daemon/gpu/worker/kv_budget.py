"""KV cache sizing on CUDA: how many KV blocks fit beside the weights, the activations
of the largest step, and what other processes hold. Pure arithmetic on numbers a
profile run measured (ModelRunner.profile_kv_budget), so it is tested without torch
or a GPU; the messages name the numbers, because a refusal here is a user's first
clue about which setting to change."""
from __future__ import annotations

import msgspec

GiB = 1 << 30
MiB = 1 << 20


class MemoryBreakdown(msgspec.Struct, frozen=True, kw_only=True):
    """Where one device's memory goes, in bytes. Sent from worker to parent as msgpack."""

    total: int  # the device's memory
    allowed: int  # total * gpu_memory_utilization
    other_processes: int  # in use before the weights loaded (other processes, this CUDA context)
    weights: int
    activations: int  # peak of the profiled forward + LM head + sampler
    non_torch: int  # grown outside torch's allocator while loading/profiling (NCCL, cuBLAS)
    reserved: int  # set aside for later (CUDA-graph pool)
    kv_budget: int
    bytes_per_block: int
    num_blocks: int

    def describe(self) -> str:
        """One line for the log."""
        return (f"{fmt_bytes(self.total)} total, {fmt_bytes(self.allowed)} allowed; other processes "
                f"{fmt_bytes(self.other_processes)}, weights {fmt_bytes(self.weights)}, activations "
                f"{fmt_bytes(self.activations)}, non-torch {fmt_bytes(self.non_torch)}, reserved "
                f"{fmt_bytes(self.reserved)}; KV cache {fmt_bytes(self.kv_budget)} = {self.num_blocks} "
                f"blocks of {fmt_bytes(self.bytes_per_block)}")


def fmt_bytes(n: int) -> str:
    """GiB with one decimal from 1 GiB up, else MiB with one decimal."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.1f} MiB"


def kv_cache_budget(*, total_bytes: int, free_bytes_before_load: int, weights_bytes: int,
                    peak_activation_bytes: int, non_torch_bytes: int, gpu_memory_utilization: float,
                    bytes_per_block: int, extra_reserved_bytes: int = 0) -> MemoryBreakdown:
    """The KV cache gets what gpu_memory_utilization allows of the device, less what was
    in use before the model loaded, the weights, the profiled peak activations, memory
    outside torch's allocator, and `extra_reserved_bytes`. Raises ValueError (naming the
    numbers) when that is less than one block."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    for name, value in (("total_bytes", total_bytes), ("free_bytes_before_load", free_bytes_before_load),
                        ("weights_bytes", weights_bytes), ("peak_activation_bytes", peak_activation_bytes),
                        ("non_torch_bytes", non_torch_bytes), ("extra_reserved_bytes", extra_reserved_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    util = gpu_memory_utilization
    allowed = int(total_bytes * util)
    other = max(0, total_bytes - free_bytes_before_load)
    if other >= allowed:
        raise ValueError(f"gpu_memory_utilization {util:g} allows {fmt_bytes(allowed)} but other processes "
                         f"already use {fmt_bytes(other)}: raise gpu_memory_utilization or free the device")
    kv_budget = allowed - other - weights_bytes - peak_activation_bytes - non_torch_bytes - extra_reserved_bytes
    if kv_budget < bytes_per_block:
        used = f"weights ({fmt_bytes(weights_bytes)}) + activations ({fmt_bytes(peak_activation_bytes)})"
        if non_torch_bytes:
            used += f" + non-torch memory ({fmt_bytes(non_torch_bytes)})"
        if extra_reserved_bytes:
            used += f" + reserved ({fmt_bytes(extra_reserved_bytes)})"
        raise ValueError(f"{used} leave no room for the KV cache (one block needs {fmt_bytes(bytes_per_block)}): "
                         f"gpu_memory_utilization {util:g} allows {fmt_bytes(allowed)} and other processes "
                         f"use {fmt_bytes(other)}; raise gpu_memory_utilization, lower max_num_batched_tokens "
                         "or max_num_seqs, or use more tensor parallelism")
    return MemoryBreakdown(total=total_bytes, allowed=allowed, other_processes=other, weights=weights_bytes,
                           activations=peak_activation_bytes, non_torch=non_torch_bytes,
                           reserved=extra_reserved_bytes, kv_budget=kv_budget, bytes_per_block=bytes_per_block,
                           num_blocks=kv_budget // bytes_per_block)
