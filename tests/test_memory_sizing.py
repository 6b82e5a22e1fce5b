"""KV cache sizing on CUDA. The arithmetic and its refusals are pure (no torch, no GPU)
and checked against hand-computed numbers; the profile itself and TP over NCCL need a
CUDA device and skip cleanly without one."""
from __future__ import annotations

import pytest

from llmd.gpu.memory import GiB, MiB, MemoryBreakdown, fmt_bytes, kv_cache_budget


def budget(**kw) -> MemoryBreakdown:
    args = dict(total_bytes=80 * GiB, free_bytes_before_load=79 * GiB, weights_bytes=16 * GiB,
                peak_activation_bytes=2 * GiB, non_torch_bytes=512 * MiB, gpu_memory_utilization=0.9,
                bytes_per_block=2 * MiB)
    args.update(kw)
    return kv_cache_budget(**args)


def test_breakdown_arithmetic():
    b = budget()
    # 0.9 * 80 GiB = 72 GiB allowed; 72 - 1 (others) - 16 - 2 - 0.5 = 52.5 GiB.
    assert b.total == 80 * GiB
    assert b.allowed == 72 * GiB
    assert b.other_processes == 1 * GiB
    assert (b.weights, b.activations, b.non_torch, b.reserved) == (16 * GiB, 2 * GiB, 512 * MiB, 0)
    assert b.kv_budget == 52 * GiB + 512 * MiB
    assert b.num_blocks == (52 * GiB + 512 * MiB) // (2 * MiB) == 26880
    assert b.bytes_per_block == 2 * MiB


def test_extra_reserved_and_rounding_down():
    b = budget(extra_reserved_bytes=3 * GiB, bytes_per_block=3 * MiB)
    assert b.reserved == 3 * GiB
    assert b.kv_budget == 49 * GiB + 512 * MiB
    assert b.num_blocks == (49 * GiB + 512 * MiB) // (3 * MiB) == 16896  # 16896.0 exactly
    b = budget(bytes_per_block=3 * MiB + 1)
    assert b.num_blocks == (52 * GiB + 512 * MiB) // (3 * MiB + 1)
    assert b.num_blocks * (3 * MiB + 1) <= b.kv_budget < (b.num_blocks + 1) * (3 * MiB + 1)


def test_allowed_is_truncated_to_whole_bytes():
    b = budget(total_bytes=1000 * MiB + 1, free_bytes_before_load=1000 * MiB + 1, weights_bytes=0,
               peak_activation_bytes=0, non_torch_bytes=0, gpu_memory_utilization=0.5, bytes_per_block=1)
    assert b.allowed == 500 * MiB  # int(524288000.5)
    assert b.other_processes == 0 and b.num_blocks == 500 * MiB


def test_other_processes_over_the_limit_is_refused():
    with pytest.raises(ValueError) as err:
        budget(total_bytes=78 * GiB, free_bytes_before_load=3 * GiB)
    # 0.9 * 78 GiB = 70.2 GiB; others use 75 GiB.
    assert str(err.value).startswith("gpu_memory_utilization 0.9 allows 70.2 GiB but other processes "
                                     "already use 75.0 GiB")


def test_weights_and_activations_leave_no_room():
    # 0.5 * 8 GiB = 4 GiB allowed, 0.5 GiB others, 2.1 GiB weights, 1.4 GiB activations:
    # 0 bytes left, less than one block.
    with pytest.raises(ValueError) as err:
        budget(total_bytes=8 * GiB, free_bytes_before_load=int(7.5 * GiB), weights_bytes=int(2.1 * GiB),
               peak_activation_bytes=int(1.4 * GiB), non_torch_bytes=0, gpu_memory_utilization=0.5)
    msg = str(err.value)
    assert msg.startswith("weights (2.1 GiB) + activations (1.4 GiB) leave no room for the KV cache "
                          "(one block needs 2.0 MiB)"), msg
    assert "gpu_memory_utilization 0.5 allows 4.0 GiB and other processes use 512.0 MiB" in msg


def test_non_torch_and_reserved_are_named_when_they_tip_it():
    with pytest.raises(ValueError) as err:
        budget(total_bytes=10 * GiB, free_bytes_before_load=10 * GiB, weights_bytes=5 * GiB,
               peak_activation_bytes=2 * GiB, non_torch_bytes=768 * MiB, extra_reserved_bytes=256 * MiB,
               gpu_memory_utilization=0.8)
    # 8 GiB allowed - 5 - 2 - 0.75 - 0.25 = 0: not one block.
    assert str(err.value).startswith("weights (5.0 GiB) + activations (2.0 GiB) + non-torch memory "
                                     "(768.0 MiB) + reserved (256.0 MiB) leave no room for the KV cache")


def test_exactly_one_block_fits():
    b = budget(total_bytes=10 * GiB, free_bytes_before_load=10 * GiB, weights_bytes=6 * GiB,
               peak_activation_bytes=2 * GiB - 2 * MiB, non_torch_bytes=0, gpu_memory_utilization=0.8)
    assert (b.kv_budget, b.num_blocks) == (2 * MiB, 1)


def test_bad_inputs():
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        budget(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="bytes_per_block must be >= 1"):
        budget(bytes_per_block=0)
    with pytest.raises(ValueError, match="weights_bytes must be >= 0"):
        budget(weights_bytes=-1)


def test_fmt_and_describe():
    assert fmt_bytes(1536 * MiB) == "1.5 GiB"
    assert fmt_bytes(1023 * MiB) == "1023.0 MiB"
    line = budget().describe()
    assert "weights 16.0 GiB" in line and "26880 blocks of 2.0 MiB" in line


def test_breakdown_round_trips_as_msgpack():
    import msgspec

    b = budget()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(b), type=MemoryBreakdown) == b


def test_pure_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, llmd.gpu.memory; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
