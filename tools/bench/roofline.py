"""CUDA only: the memory-bandwidth roofline of an offline run. A decode step reads every
weight once plus the KV cache of every running sequence; the run's floor is those bytes
over the device's bandwidth (measured here with a large device-to-device copy), and the
bandwidth it achieved is the same bytes over the time it took. On CPU there is none:
`roofline()` returns None and imports nothing.

Counted bytes: all weights but an untied input embedding (its rows are gathered, not
streamed), each step; and for every generated token after the first, the KV of its
context (prompt + tokens so far). Prefill traffic is not counted, so the floor is low.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import msgspec

from llmd.config import read_model_info

COPY_BYTES = 256 << 20  # far above any L2 cache, small beside the KV pool's headroom
COPY_REPEATS = 20


class Roofline(msgspec.Struct, kw_only=True):
    device_bandwidth_gbs: float  # measured copy bandwidth (read + write), GB/s
    bytes_per_step: float  # weights + mean KV read, per device
    roofline_s: float  # the run's floor: all bytes over the device bandwidth
    achieved_gbs: float  # all bytes over the measured time
    fraction_of_peak: float

    def text(self) -> str:
        return (f"roofline (memory bound) {self.roofline_s:.4f} s at {self.device_bandwidth_gbs:.0f} GB/s "
                f"({self.bytes_per_step / 1e6:.1f} MB per step); bandwidth achieved "
                f"{self.achieved_gbs:.0f} GB/s = {self.fraction_of_peak:.1%} of the measured copy")


def decode_kv_tokens(requests: Iterable[tuple[int, int]]) -> int:
    """Context tokens read by the decode steps of (prompt_len, output_len) requests: the
    step making token j (2..o) attends to p + j - 1 tokens."""
    return sum((o - 1) * p + (o - 1) * o // 2 for p, o in requests if o > 1)


def weight_elements(model_dir: str | Path) -> int:
    """Elements of the weights a decode step streams, from the safetensors headers."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    if any(k.endswith("lm_head.weight") for k in shapes):
        shapes = {k: v for k, v in shapes.items() if "embed_tokens" not in k}
    return sum(math.prod(shape) for shape in shapes.values())


def device_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (each byte read and written)."""
    import torch

    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPY_REPEATS):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    return 2 * COPY_BYTES * COPY_REPEATS / seconds


def roofline(engine, steps: int, kv_tokens: int, seconds: float) -> Roofline | None:
    """The roofline of a run of `steps` engine steps that read `kv_tokens` context tokens
    in `seconds`; None unless the engine runs on CUDA."""
    if engine.device.type != "cuda" or steps == 0 or seconds <= 0:
        return None
    itemsize = engine.dtype.itemsize
    info = read_model_info(engine.model_dir)
    tp = engine.config.tensor_parallel_size
    kv_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * itemsize
    total = (weight_elements(engine.model_dir) * itemsize * steps + kv_per_token * kv_tokens) / tp
    bandwidth = device_bandwidth(engine.device)
    achieved = total / seconds
    return Roofline(device_bandwidth_gbs=bandwidth / 1e9, bytes_per_step=total / steps,
                    roofline_s=total / bandwidth, achieved_gbs=achieved / 1e9,
                    fraction_of_peak=achieved / bandwidth)
