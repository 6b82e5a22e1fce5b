"""The CUDA memory profile behind KV cache sizing: run the largest step the scheduler
can send on a throwaway cache, measure its peak, and hand the numbers to the pure
arithmetic of memory.kv_cache_budget. Runs in the worker that holds the model."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from llmd.gpu.attention import AttentionMetadata, GatherWorkspace, new_model_kv_caches
from llmd.gpu.cuda_graphs import capture_sizes
from llmd.gpu.kv_budget import MemoryBreakdown, kv_cache_budget
from llmd.gpu.sampler import Sampler, SamplingMetadata
from llmd_client.protocol import SamplingParams

if TYPE_CHECKING:
    from llmd.gpu.model_runner import ModelRunner


@torch.inference_mode()
def profile_kv_budget(runner: ModelRunner, gpu_memory_utilization: float,
                      extra_reserved_bytes: int = 0) -> MemoryBreakdown:
    """CUDA: run the largest step the scheduler can send (max_num_batched_tokens of
    prefill over up to max_num_seqs requests, the LM head and a sampler call on the
    rows that sample) on a throwaway KV cache just big enough for it, measure its
    peak, and size the KV cache from what is left (memory.kv_cache_budget).
    Call before initialize_kv_cache. With tensor parallelism every rank calls it
    together (the forward has collectives). A draft model's forward is not profiled:
    it runs after the target's and its activations are smaller."""
    if runner._cuda_before_load is None:
        raise ValueError(f"the KV cache budget is profiled on CUDA devices only, not {runner.device}")
    dev, bs, settings = runner.device, runner.block_size, runner.settings
    free_before, allocated_before, reserved_before = runner._cuda_before_load
    weights = torch.cuda.memory_allocated(dev) - allocated_before
    total = min(settings.max_num_batched_tokens, settings.max_num_seqs * settings.max_model_len)
    num_seqs = min(settings.max_num_seqs, total)
    seq_lens = [total // num_seqs + (i < total % num_seqs) for i in range(num_seqs)]
    block_counts = [-(-n // bs) for n in seq_lens]
    first_block = np.cumsum([0] + block_counts)
    slots, prefills, start = [], [], 0
    for i, n in enumerate(seq_lens):
        blocks = torch.arange(first_block[i], first_block[i + 1], dtype=torch.int64, device=dev)
        slots.append(np.arange(n, dtype=np.int64) + first_block[i] * bs)  # its blocks are consecutive
        prefills.append((start, n, 0, blocks))
        start += n
    num_rows = min(total, settings.max_sampled_rows)
    last_rows = np.cumsum(seq_lens) - 1
    rows = torch.from_numpy(np.resize(last_rows, num_rows)).to(dev)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20)
    try:
        kv_caches = new_model_kv_caches(runner.model, int(first_block[-1]), bs, runner.dtype, dev)
        md = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev), num_decodes=0,
                               decode_block_table=None, decode_seq_lens=None, prefills=prefills,
                               workspace=GatherWorkspace())
        ids = torch.zeros(total, dtype=torch.int64, device=dev)
        positions = torch.from_numpy(np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens])).to(dev)
        torch.cuda.synchronize(dev)
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        hidden = runner.model(ids, positions, kv_caches, md)
        logits = runner.model.compute_logits(hidden.index_select(0, rows))
        del hidden
        sampling = SamplingMetadata.build([params] * num_rows, [[0]] * num_rows, [[]] * num_rows,
                                          valid_vocab_size=settings.valid_vocab_size,
                                          eos_token_id=settings.eos_token_id, device=dev)
        Sampler(seed=settings.seed)(logits, sampling)  # its own: the real one's RNG stays untouched
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - baseline
    except torch.cuda.OutOfMemoryError:
        raise ValueError(f"a step of {total} tokens over {num_seqs} requests does not fit in GPU memory "
                         f"beside the weights: lower max_num_batched_tokens or max_num_seqs") from None
    finally:
        kv_caches = md = hidden = logits = sampling = None
        torch.cuda.empty_cache()
    free_now, device_total = torch.cuda.mem_get_info(dev)
    # Grown outside torch's allocator since before the load: NCCL, cuBLAS/cuDNN handles.
    non_torch = (device_total - free_now) - (device_total - free_before) \
        - (torch.cuda.memory_reserved(dev) - reserved_before)
    return kv_cache_budget(total_bytes=device_total, free_bytes_before_load=free_before,
                           weights_bytes=weights, peak_activation_bytes=activations,
                           non_torch_bytes=max(0, non_torch), gpu_memory_utilization=gpu_memory_utilization,
                           bytes_per_block=runner.kv_cache_bytes_per_block(),
                           extra_reserved_bytes=extra_reserved_bytes
                           + _graph_pool_estimate(runner, activations, total))


def _graph_pool_estimate(runner: ModelRunner, activations: int, profiled_tokens: int) -> int:
    """Bytes to keep free for the decode graphs, which are captured after the KV cache
    takes its budget: the profiled activation peak scaled to the largest captured batch
    (an over-estimate: the profile also held the LM head's and the sampler's buffers),
    plus the graphs' static input buffers."""
    if runner._graphs_off_reason() is not None:
        return 0
    s = runner.settings
    largest = capture_sizes(s.max_num_seqs, s.max_num_batched_tokens)[-1]
    width = -(-s.max_model_len // runner.block_size)
    return int(activations * min(1.0, largest / max(1, profiled_tokens))) + largest * (4 + width) * 8
