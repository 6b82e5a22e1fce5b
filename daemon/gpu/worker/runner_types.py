"""The model runner's own types: its settings (what the engine decides for the worker),
the worker's copy of a running request, and a step whose sampled tokens are still on
the device. They sit apart from the runner so that its parts (input batch, sampling
step, draft model, memory profile) and the executors name them without importing it.
Importing this module loads no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmd.core.step_messages import RunnerOutput
from llmd_client.protocol import SamplingParams

if TYPE_CHECKING:
    import torch

    from llmd.gpu.sample.sampler import SamplerOutput


@dataclass
class RunnerRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    row: int = -1  # its row of the input batch's persistent block table

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class RunnerSettings:
    block_size: int
    max_model_len: int
    valid_vocab_size: int  # tokenizer size; wider logits are padding and never sampled
    eos_token_id: int | None
    seed: int
    cpu_threads: int | None = None  # torch intra-op threads when running on CPU
    attention_backend: str = "auto"  # "auto", "torch", "triton" or "flash_attn" (see attention_backends)
    # Speculative decoding: the drafts a request verifies per step (both methods: decode
    # graphs and the memory profile size for them) and, with a draft model, its directory.
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    # The scheduler's step limits: the shape of the largest step, which the CUDA memory
    # profile runs (profile_kv_budget); CUDA graphs for decode steps (see cuda_graphs) are
    # captured for batch sizes up to min(max_num_seqs, 512) unless enforce_eager.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enforce_eager: bool = False

    @property
    def max_sampled_rows(self) -> int:
        """The most logit rows one step samples: every request verifying every draft."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))


@dataclass
class PendingStep:
    """A step whose sampled tokens are still on their way to the host (async scheduling
    with chained steps): the next step takes its decode inputs from `sampled` on the
    device, and the output is completed by SamplingStep.collect once the copy is done."""

    out: RunnerOutput
    ordered: list[RunnerRequest]  # the step's rows' requests, in row order
    sample_reqs: list[RunnerRequest]
    sampled: torch.Tensor | None  # [len(sample_reqs)] int64 on the device; None: out is complete
    host: SamplerOutput | None = None  # the sampler's output, copied (or copying) to the host
    ready: object | None = None  # torch.cuda.Event recorded after the copies
    row_of: dict[str, int] = field(default_factory=dict)  # req_id -> index in sampled
