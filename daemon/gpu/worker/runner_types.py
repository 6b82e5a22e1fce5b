"""The model runner's own types: its settings (what the engine decides for the worker),
the worker's copy of a running request, and the handle of a launched step (whose
sampled tokens may still be on the device). They sit apart from the runner so that its
parts (input batch, sampling step, draft model, memory profile) and the executors name
them without importing it.
Importing this module loads no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmd.core.step_messages import Logprobs, RunnerOutput
from llmd_client.protocol import PoolingParams, SamplingParams

if TYPE_CHECKING:
    import torch

    from llmd.gpu.sample.rejection_sampler import VerifyOutput
    from llmd.gpu.sample.sampler import SamplerOutput


@dataclass
class RunnerRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams | None  # None: a pooling request
    num_computed_tokens: int
    row: int = -1  # its row of the input batch's persistent block table (its KV blocks)
    pooling_params: PoolingParams | None = None
    # A pooling request's state across the chunks of its prompt (pooling_step): the sum
    # of the hidden states so far (MEAN) or the first token's (CLS).
    pooled_partial: torch.Tensor | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None


@dataclass
class RunnerSettings:
    block_size: int
    max_model_len: int
    valid_vocab_size: int  # tokenizer size; wider logits are padding and never sampled
    eos_token_id: int | None
    seed: int
    cpu_threads: int | None = None  # torch intra-op threads when running on CPU
    attention_backend: str = "auto"  # "auto", "torch", "triton" or "flash_attn" (see attention_backends)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8", "fp8_e4m3" or "int8" (see kv_quant)
    dequantize: bool = False  # GGUF: every weight dequantized at load, none kept packed
    cpu_int8_activations: bool = False  # packed weights on CPU meet int8-rounded activations (EngineConfig)
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
    # Embedding requests: how the final hidden states are pooled ("LAST", "MEAN", "CLS").
    pooling_type: str = "LAST"

    @property
    def max_sampled_rows(self) -> int:
        """The most logit rows one step samples: every request verifying every draft."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))


@dataclass(eq=False)
class StepHandle:
    """A launched step (the step contract: execute_model returns one for every step).

    Its sampled tokens may still be on the device (`sampled`, copying to `host` behind
    the `ready` event): the next step launched before `output()` takes its decode inputs
    from `sampled` there, so the device goes from one step to the next without waiting
    for the host. `output()` waits for the copy once, appends the tokens to the worker's
    copy of each request and returns the RunnerOutput (vLLM's AsyncModelRunnerOutput).
    A step whose tokens are already on the host (with a draft model, with tensor
    parallelism, verifying drafts) comes back complete: `output()` just returns it."""

    out: RunnerOutput
    ordered: list[RunnerRequest] = field(default_factory=list)  # the step's rows' requests, in row order
    sample_reqs: list[RunnerRequest] = field(default_factory=list)
    sampled: torch.Tensor | None = None  # [len(sample_reqs)] int64 on the device; None: out is complete
    host: SamplerOutput | None = None  # the sampler's output, copied (or copying) to the host
    ready: object | None = None  # torch.cuda.Event recorded after the copies
    row_of: dict[str, int] = field(default_factory=dict)  # req_id -> index in sampled
    collected: bool = False
    before: StepHandle | None = None  # the pending step whose tokens this one read on the device


    @property
    def pending(self) -> bool:
        """Its tokens are not yet on the host (the next step may read them on the device)."""
        return self.sampled is not None and not self.collected

    def output(self) -> RunnerOutput:
        if self.before is not None:  # its tokens precede ours in every request
            before, self.before = self.before, None
            before.output()
        if self.pending:
            self.collected = True
            if self.ready is not None:
                self.ready.synchronize()
            tokens = self.host.sampled_token_ids.tolist()
            if self.host.logprobs_token_ids is not None:
                collect_logprobs(self.out, self.sample_reqs, [[i] for i in range(len(self.sample_reqs))], self.host)
            record_sampled(self.out, self.ordered, self.sample_reqs,
                           [[tokens[self.row_of[r.req_id]]] for r in self.sample_reqs])
        return self.out


def record_sampled(out: RunnerOutput, ordered: list[RunnerRequest], sample_reqs: list[RunnerRequest],
                   sampled: list[list[int]]) -> None:
    """Append each request's emitted tokens (sampled[i] is sample_reqs[i]'s) to its
    token ids and, one entry per row's request in row order, to `out`."""
    sampled_by_req = {r.req_id: t for r, t in zip(sample_reqs, sampled)}
    for req in ordered:
        tokens = sampled_by_req.get(req.req_id, [])
        req.token_ids.extend(tokens)
        out.req_ids.append(req.req_id)
        out.sampled_token_ids.append(tokens)


def collect_logprobs(out: RunnerOutput, reqs: list[RunnerRequest], rows: list[list[int]],
                     result: SamplerOutput | VerifyOutput) -> None:
    """rows[i]: the result rows of request i's emitted tokens, in order."""
    ids = result.logprobs_token_ids.tolist()
    lps = result.logprobs.tolist()
    ranks = result.ranks.tolist()
    for req, req_rows in zip(reqs, rows):
        k = req.sampling_params.logprobs
        if k is None:
            continue
        out.logprobs[req.req_id] = Logprobs(token_ids=[ids[r][:k + 1] for r in req_rows],
                                            logprobs=[lps[r][:k + 1] for r in req_rows],
                                            ranks=[ranks[r] for r in req_rows])
