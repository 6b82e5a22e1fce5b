"""Messages between the scheduler and the workers that run the model.

Only differences cross the boundary: a request's tokens and sampling parameters are
sent once (when it is scheduled for the first time, or again after preemption); after
that a step names it with its new block ids and how many tokens to compute. The worker
keeps its own copy of each request's tokens and appends what it samples.

A pooling request (an embedding) is scheduled like any prompt; the step that computes
its last prompt token returns its pooled hidden state (`RunnerOutput.pooled`) instead of
a sampled token, and the scheduler finishes it.

A step's grammar bitmask rows are filled while its forward runs (only sampling needs
them), so the step goes to the executor before they exist. The step names the requests
whose rows it samples with (`grammar_req_ids`); the rows themselves are the step's second
input, `GrammarRows`, handed to the executor beside it (Executor.execute_model) and
waited for just before sampling: in process, for the thread that fills them; in a worker
process, for the message that follows the step (vLLM's execute_model, then
sample_tokens(grammar_output)).
"""
from __future__ import annotations

from typing import Callable

import msgspec

from llmd_client.protocol import PoolingParams, SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (resumed requests recompute them as context).
    output_token_ids: list[int]
    sampling_params: SamplingParams | None  # None: a pooling request
    block_ids: list[int]
    num_computed_tokens: int
    # A pooling request (an embedding): the worker pools its prompt's final hidden
    # states and returns them in RunnerOutput.pooled after its last prompt token.
    pooling_params: PoolingParams | None = None


class CachedRequestData(msgspec.Struct, array_like=True):
    req_ids: list[str]
    new_block_ids: list[list[int]]
    num_computed_tokens: list[int]


class GrammarRows:
    """One step's grammar bitmask rows (int32 words over the logit width, bit i of word j
    = token 32*j + i), each guided request's in `grammar_req_ids` order, one row for each
    position it samples at. `wait()` returns them, blocking while they are being filled.
    Lives in one process: a worker process is sent the bytes (worker/process.py)."""

    __slots__ = ("_fill", "_rows")

    def __init__(self, fill: Callable[[], bytes]) -> None:
        """`fill()` returns the rows, waiting for them; it is called once."""
        self._fill: Callable[[], bytes] | None = fill
        self._rows = b""

    @classmethod
    def filled(cls, rows: bytes) -> GrammarRows:
        return cls(lambda: rows)

    def wait(self) -> bytes:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            self._rows = fill()
        return self._rows


class SchedulerOutput(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must forget: finished, aborted or preempted since the last step.
    finished_req_ids: list[str]
    # Guided decoding: the requests that sample under a grammar this step, in the order
    # of their rows in the step's GrammarRows (which are filled while the step runs).
    grammar_req_ids: list[str] = []
    # Speculative decoding: draft tokens to verify, by request. Such a request's
    # scheduled tokens are its last sampled token followed by these drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Draft-model speculation: the requests the worker drafts for after this step's
    # sampling, each with the most tokens (known + drafts) its drafts may reach. The
    # scheduler reserved KV slots for every position those drafts write, and the limit
    # keeps them within what the request may still emit (and max_model_len).
    draft_max_num_tokens: dict[str, int] = {}


class Logprobs(msgspec.Struct, array_like=True):
    """Per position: the chosen token first, then the top-k, with logprobs, and the
    chosen token's rank (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens start+1 .. start+len computed in one step (a prefill
    chunk); position 0 never has one. A recomputed prompt (after preemption) resends."""

    start: int
    logprobs: Logprobs


class RunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]
    # One list per request in req_ids; empty for a request still in (chunked) prefill.
    sampled_token_ids: list[list[int]]
    # Sampled-token logprobs, by request id, for requests that asked for them.
    logprobs: dict[str, Logprobs] = {}
    # Prompt logprobs computed in this step (one chunk), by request id.
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    # Draft-model speculation: the drafts proposed for the next step, by request id.
    draft_token_ids: dict[str, list[int]] = {}
    # Pooling requests whose last prompt token this step computed: the pooled final
    # hidden state (cut to the request's dimensions, normalized if it asked), by request id.
    pooled: dict[str, list[float]] = {}
    # CUDA: bytes the device's torch allocator holds after the step (a host-side counter,
    # no sync); None on CPU. For status and metrics.
    device_memory_bytes: int | None = None
