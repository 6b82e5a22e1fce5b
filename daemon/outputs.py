"""What the offline engine returns, shaped like vLLM's RequestOutput (generation) and
EmbeddingRequestOutput (embeddings)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # with finish_reason "error": what went wrong
    # What the latest step added (for streaming consumers).
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # empty when the request did not finish (abort, error)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `.outputs.embedding`).
    `finish_reason` is "stop" when the embedding is there; "abort" or "error" (with
    `error` saying what went wrong) when it is not."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    finish_reason: str = "stop"
    error: str | None = None
