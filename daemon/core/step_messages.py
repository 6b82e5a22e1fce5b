"""Messages between the scheduler and the workers that run the model.

Only differences cross the boundary: a request's tokens and sampling parameters are
sent once (when it is scheduled for the first time, or again after preemption); after
that a step names it with its new block ids and how many tokens to compute. The worker
keeps its own copy of each request's tokens and appends what it samples.

A step's grammar bitmask rows are filled while its forward runs (only sampling needs
them), so the step goes to the executor before they exist: whoever samples reads them
through `SchedulerOutput.wait_grammar_bitmask`, which waits for them (in process, for the
filling thread; in a worker, for the message that follows the step).
"""
from __future__ import annotations

from typing import Callable

import msgspec

from llmd_client.protocol import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (resumed requests recompute them as context).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True):
    req_ids: list[str]
    new_block_ids: list[list[int]]
    num_computed_tokens: list[int]


class SchedulerOutput(msgspec.Struct, array_like=True, dict=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must forget: finished, aborted or preempted since the last step.
    finished_req_ids: list[str]
    # Guided decoding: the requests that sample under a grammar this step, and their
    # allowed-token bitmask rows in that order (int32 words over the logit width). The
    # rows are read with wait_grammar_bitmask(): they are filled after the step is sent.
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # Speculative decoding: draft tokens to verify, by request. Such a request's
    # scheduled tokens are its last sampled token followed by these drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Draft-model speculation, guided requests: the proposed draft right after the ones
    # being verified, which the grammar refused or which ends the grammar. It is tested
    # (at the request's last row) rather than dropped, since dropping a draft because of
    # its value would bias sampling; if accepted it is the request's last token this step.
    scheduled_spec_tail_tokens: dict[str, int] = {}
    # Draft-model speculation: the requests the worker drafts for after this step's
    # sampling, each with the most tokens (known + drafts) its drafts may reach. The
    # scheduler reserved KV slots for every position those drafts write, and the limit
    # keeps them within what the request may still emit (and max_model_len).
    draft_max_num_tokens: dict[str, int] = {}

    # Where the grammar rows come from is state of this process, never sent: the struct
    # keeps it in its __dict__ (dict=True), which msgspec does not encode.
    def follow_grammar_bitmask(self, source: Callable[[], bytes]) -> None:
        """The grammar rows are `source()`, which blocks until they are filled."""
        self.__dict__["_grammar_bitmask_source"] = source

    def wait_grammar_bitmask(self) -> bytes:
        """The grammar rows, waiting for them if they are still being filled. Called just
        before sampling: the forward ran meanwhile."""
        source = self.__dict__.pop("_grammar_bitmask_source", None)
        if source is not None:
            self.grammar_bitmask = source()
        return self.grammar_bitmask


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
    # CUDA: bytes the device's torch allocator holds after the step (a host-side counter,
    # no sync); None on CPU. For status and metrics.
    device_memory_bytes: int | None = None
