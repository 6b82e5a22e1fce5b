"""A request's state as the scheduler and KV cache manager see it. No torch."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from llmd_client.protocol import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from llmd.core.step_messages import SchedulerOutput


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_GRAMMAR = 3  # guided decoding: its grammar is compiling
    # Everything past this point is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the executor failed under it, or its grammar did not compile

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# The samples of a request with n > 1 are scheduled as child requests; their ids are the
# parent's id, a NUL and the sample index.
_CHILD_SEPARATOR = "\x00"


def child_request_id(parent_id: str, index: int) -> str:
    """The id of sample `index` of request `parent_id` (n > 1)."""
    return f"{parent_id}{_CHILD_SEPARATOR}{index}"


def parent_request_id(request_id: str) -> str:
    """The id of the client's request a scheduled request (a child or itself) belongs to."""
    return request_id.split(_CHILD_SEPARATOR, 1)[0]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated: prompt, output so far, and how much is in KV.

    A pooling request (an embedding: `pooling_params` set, `sampling_params` None) runs
    its prompt through the model like any other, chunked and batched, samples nothing,
    and finishes when the step that computes its last prompt token returns the pooled
    hidden state."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        max_tokens: int,
        grammar=None,
        owner: object = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        if (sampling_params is None) == (pooling_params is None):
            raise ValueError("a request has either sampling_params or pooling_params")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # Who sent it (the daemon's peer uid): the waiting queue takes turns between owners.
        self.owner = owner
        self.queue_key: tuple | None = None  # its place in the waiting queue, kept across preemption
        # Resolved limit on output tokens (max_tokens or what max_model_len leaves).
        self.max_tokens = max_tokens

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose K/V are in the cache (or are being computed in the current step).
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at the last admission.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Chained hashes of this request's full blocks, filled by the KV cache manager.
        self.block_hashes: list[int] = []
        self.stop_reason: int | str | None = None
        # Guided decoding: a llmd.structured_output.RequestGrammar (spec, then matcher).
        self.grammar = grammar
        # Speculative decoding: draft tokens proposed for the next step.
        self.spec_token_ids: list[int] = []
        # A pooling request: the step (SchedulerOutput) that computes its last prompt
        # token, whose output carries the pooled state.
        self.pooled_by: SchedulerOutput | None = None
        # Async scheduling: tokens being sampled by a step in flight, not yet known here.
        # The next step is scheduled as if they were (the worker has them by then).
        self.num_output_placeholders = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def speculative(self) -> bool:
        """Whether drafts may be proposed for it (a pooling request samples nothing)."""
        return self.sampling_params is not None and self.sampling_params.speculative

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def matcher_stop_token_ids(self) -> list[int] | None:
        """Tokens that end the output once the grammar is complete (EOS even under
        ignore_eos: a guided request ends where its grammar ends)."""
        ids = set(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return sorted(ids) or None

    def sort_key(self) -> tuple[int, float]:
        """Lower runs first (priority policy): lower priority value, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
