"""The CUDA memory profile behind KV cache sizing: run the largest step the scheduler
can send on a throwaway cache, measure its peak, and hand the numbers to the pure
arithmetic of kv_budget.kv_cache_budget. Runs in the worker that holds the model; the
runner describes itself in a ProfileSubject."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.gpu.layers.attention import AttentionMetadata, GatherWorkspace, new_model_kv_caches
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.sample.graph_sampler import tail_pool_bytes
from llmd.gpu.worker.kv_budget import MemoryBreakdown, kv_cache_budget
from llmd.gpu.worker.runner_types import RunnerSettings
from llmd.gpu.sample.sampler import Sampler, SamplingMetadata
from llmd_client.protocol import SamplingParams


@dataclass
class ProfileSubject:
    """The model to profile and what the budget needs to know beside it."""

    model: torch.nn.Module  # the loaded model: forward over a paged cache, compute_logits
    settings: RunnerSettings
    device: torch.device
    cache_dtype: torch.dtype  # of the KV cache's elements (the model's dtype, or a quantized cache's storage)
    before_load: tuple[int, int, int] | None  # CUDA free, allocated, reserved bytes before the weights
    bytes_per_block: int  # KV bytes per block, the draft model's included
    graph_batch: int  # the largest decode graph batch, captured after the KV cache; 0: no graphs
    draft: torch.nn.Module | None = None  # the draft model, whose decode graphs have a pool of their own


@dataclass
class _LargestStep:
    """The largest step the scheduler can send: max_num_batched_tokens of prefill
    spread over up to max_num_seqs requests (each at most max_model_len), each request's
    blocks consecutive, and the rows the LM head and the sampler see."""

    seq_lens: list[int]
    first_block: np.ndarray  # request i's blocks are first_block[i]..first_block[i + 1] - 1
    sample_rows: np.ndarray  # the rows that sample (last rows of the requests, repeated)

    @classmethod
    def of(cls, settings: RunnerSettings) -> _LargestStep:
        total = min(settings.max_num_batched_tokens, settings.max_num_seqs * settings.max_model_len)
        num_seqs = min(settings.max_num_seqs, total)
        seq_lens = [total // num_seqs + (i < total % num_seqs) for i in range(num_seqs)]
        first_block = np.cumsum([0] + [-(-n // settings.block_size) for n in seq_lens])
        num_rows = min(total, settings.max_sampled_rows)
        return cls(seq_lens, first_block, np.resize(np.cumsum(seq_lens) - 1, num_rows))

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    def attention_metadata(self, block_size: int, dev: torch.device) -> AttentionMetadata:
        slots, prefills, start = [], [], 0
        for i, n in enumerate(self.seq_lens):
            blocks = torch.arange(self.first_block[i], self.first_block[i + 1], dtype=torch.int64, device=dev)
            slots.append(np.arange(n, dtype=np.int64) + self.first_block[i] * block_size)
            prefills.append((start, n, 0, blocks))
            start += n
        return AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev), num_decodes=0,
                                 decode_block_table=None, decode_seq_lens=None, prefills=prefills,
                                 workspace=GatherWorkspace())


@torch.inference_mode()
def profile_kv_budget(subject: ProfileSubject, gpu_memory_utilization: float,
                      extra_reserved_bytes: int = 0) -> MemoryBreakdown:
    """CUDA: run the largest step the scheduler can send (max_num_batched_tokens of
    prefill over up to max_num_seqs requests, the LM head and a sampler call on the
    rows that sample) on a throwaway KV cache just big enough for it, measure its
    peak, and size the KV cache from what is left (kv_budget.kv_cache_budget).
    Call before initialize_kv_cache. With tensor parallelism every rank calls it
    together (the forward has collectives). A draft model's activations are not added
    to the peak (its forward runs after the target's and is smaller), but with decode
    graphs its forward is profiled too: its graphs keep a memory pool of their own."""
    if subject.before_load is None:
        raise ValueError(f"the KV cache budget is profiled on CUDA devices only, not {subject.device}")
    dev = subject.device
    free_before, allocated_before, reserved_before = subject.before_load
    # The allocator's growth over the load (the draft model's weights included), and
    # never less than the target's own tensors.
    weights = max(torch.cuda.memory_allocated(dev) - allocated_before, _tensor_bytes(subject.model))
    step = _LargestStep.of(subject.settings)
    activations = _peak_activation_bytes(subject, step)
    graphs = _graph_pool_estimate(subject, activations, step.num_tokens)
    if subject.draft is not None and subject.graph_batch:  # the draft's graphs: their own pool, no tails
        graphs += _graph_pool_estimate(subject, _peak_activation_bytes(subject, step, subject.draft),
                                       step.num_tokens, tails=False)
    free_now, device_total = torch.cuda.mem_get_info(dev)
    # Grown outside torch's allocator since before the load: NCCL, cuBLAS/cuDNN handles.
    non_torch = (device_total - free_now) - (device_total - free_before) \
        - (torch.cuda.memory_reserved(dev) - reserved_before)
    return kv_cache_budget(total_bytes=device_total, free_bytes_before_load=free_before,
                           weights_bytes=weights, peak_activation_bytes=activations,
                           non_torch_bytes=max(0, non_torch), gpu_memory_utilization=gpu_memory_utilization,
                           bytes_per_block=subject.bytes_per_block,
                           extra_reserved_bytes=extra_reserved_bytes + graphs)


def weight_storage(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by how they are kept: a packed GGUF type's name or a
    quantized checkpoint's (`awq-int4`, `fp8-e4m3`: its scales counted with it), a dense
    dtype's ("float32"; buffers such as rotary tables with them), and "onednn" for the
    reordered copies CPU linear layers multiply with (cpu_linear: the checkpoint layout
    stays beside them). Each storage counted once (tied embeddings share one)."""
    seen: set[int] = set()
    kinds: dict[str, int] = {}

    def add(kind: str, key: int, nbytes: int) -> None:
        if key not in seen:
            seen.add(key)
            kinds[kind] = kinds.get(kind, 0) + nbytes

    for module in model.modules():
        quant = getattr(module, "quant", None)
        for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            storage = t.untyped_storage()
            packed = name == "weight" or name in getattr(module, "quant_tensors", ())  # scales, column orders
            kind = quant if quant is not None and packed else str(t.dtype).removeprefix("torch.")
            add(kind, storage.data_ptr(), storage.nbytes())
        for forward in (getattr(module, "kernel", None), module.__dict__.get("forward")):
            packed = getattr(forward, "packed", None)
            if isinstance(packed, torch.Tensor):  # an opaque oneDNN tensor: no storage to ask
                add("onednn", id(packed), packed.numel() * packed.element_size())
    return kinds


def _tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages behind the model's parameters and buffers, each storage
    once (tied embeddings share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def _peak_activation_bytes(subject: ProfileSubject, step: _LargestStep, draft: torch.nn.Module | None = None) -> int:
    """Run `step` (forward, LM head, a sampler of its own) on a throwaway KV cache and
    return the allocator's peak above what was allocated before it; frees all it made.
    With `draft`, the draft model's forward alone over the same step."""
    dev, settings = subject.device, subject.settings
    model = subject.model if draft is None else draft
    total, num_rows = step.num_tokens, len(step.sample_rows)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20)
    try:
        kv_caches = new_model_kv_caches(model, int(step.first_block[-1]), settings.block_size, subject.cache_dtype,
                                        dev)
        md = step.attention_metadata(settings.block_size, dev)
        metadata_builder(model, settings.block_size, dev).build(md)
        ids = torch.zeros(total, dtype=torch.int64, device=dev)
        positions = torch.from_numpy(np.concatenate([np.arange(n, dtype=np.int64) for n in step.seq_lens])).to(dev)
        rows = torch.from_numpy(step.sample_rows).to(dev)
        torch.cuda.synchronize(dev)
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        hidden = model(ids, positions, kv_caches, md)
        if draft is not None:
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - baseline
        logits = model.compute_logits(hidden.index_select(0, rows))
        del hidden
        sampling = SamplingMetadata.build([params] * num_rows, [[0]] * num_rows, [[]] * num_rows,
                                          valid_vocab_size=settings.valid_vocab_size,
                                          eos_token_id=settings.eos_token_id, device=dev)
        Sampler(seed=settings.seed)(logits, sampling)  # its own: the real one's RNG stays untouched
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - baseline
    except torch.cuda.OutOfMemoryError:
        raise ValueError(f"a step of {total} tokens over {len(step.seq_lens)} requests does not fit in GPU "
                         f"memory beside the weights: lower max_num_batched_tokens or max_num_seqs") from None
    finally:
        kv_caches = md = hidden = logits = sampling = None
        torch.cuda.empty_cache()


def _graph_pool_estimate(subject: ProfileSubject, activations: int, profiled_tokens: int, tails: bool = True) -> int:
    """Bytes to keep free for the decode graphs, which are captured after the KV cache
    takes its budget: the profiled activation peak scaled to the largest captured batch
    (an over-estimate: the profile also held the LM head's and the sampler's buffers),
    plus the graphs' static input buffers and (`tails`: the target's graphs) their
    sampling tails (graph_sampler). Called again for the draft model's graphs with its
    own activation peak."""
    largest = subject.graph_batch
    if largest == 0:
        return 0
    width = -(-subject.settings.max_model_len // subject.settings.block_size)
    estimate = int(activations * min(1.0, largest / max(1, profiled_tokens))) + largest * (4 + width) * 8
    return estimate + (tail_pool_bytes(largest, subject.settings.valid_vocab_size) if tails else 0)
