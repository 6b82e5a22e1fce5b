"""What comes back: what the clients hand back (Result, Completion, Delta, Embedding),
and how a request's Output messages add up to a Result (how a Submit is built is in
request_args)."""
from __future__ import annotations

import msgspec

from llmd_client.errors import RequestError
from llmd_client.protocol import Accepted, Output, TokenLogprob, Usage

Logprobs = list[list[TokenLogprob]]


class Delta(msgspec.Struct, kw_only=True):
    """One streamed piece of sample `index`. The last piece of a sample has
    `finish_reason`; the last piece of the request also has `usage`."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    usage: Usage | None = None
    prompt_logprobs: Logprobs | None = None  # with sampling.prompt_logprobs, on the last piece


class Completion(msgspec.Struct, kw_only=True):
    """One finished sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    error: str | None = None  # with finish_reason "error": what went wrong


class Result(msgspec.Struct, kw_only=True):
    """A finished request. `text`, `token_ids`, ... are those of the first sample; with
    n > 1 every sample is in `outputs`, ordered by index."""

    request_id: str
    prompt_tokens: int
    outputs: list[Completion]
    usage: Usage | None = None
    # With sampling.prompt_logprobs: per prompt position, its own token first, then the
    # top-k (position 0 is empty).
    prompt_logprobs: Logprobs | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> Logprobs | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


def delta_from(output: Output) -> Delta:
    return Delta(index=output.index, text=output.text, token_ids=list(output.token_ids),
                 logprobs=output.logprobs, finish_reason=output.finish_reason,
                 stop_reason=output.stop_reason, error=output.error, usage=output.usage,
                 prompt_logprobs=output.prompt_logprobs)


def is_last(output: Output) -> bool:
    """The request's last message is the one that carries usage."""
    return output.usage is not None


class ResultBuilder:
    """Adds up the Output messages of one request (streamed or not) into a Result."""

    def __init__(self, accepted: Accepted, n: int) -> None:
        self.accepted = accepted
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[Logprobs | None] = [None] * n
        self._finish: list[str | None] = [None] * n
        self._stop: list[int | str | None] = [None] * n
        self._error: list[str | None] = [None] * n
        self.usage: Usage | None = None
        self.prompt_logprobs: Logprobs | None = None

    def add(self, output: Output) -> None:
        i = output.index
        if not 0 <= i < len(self._texts):
            grow = i + 1 - len(self._texts)
            self._texts += [[] for _ in range(grow)]
            self._token_ids += [[] for _ in range(grow)]
            self._logprobs += [None] * grow
            self._finish += [None] * grow
            self._stop += [None] * grow
            self._error += [None] * grow
        self._texts[i].append(output.text)
        self._token_ids[i] += output.token_ids
        if output.logprobs is not None:
            self._logprobs[i] = (self._logprobs[i] or []) + output.logprobs
        if output.finish_reason is not None:
            self._finish[i] = output.finish_reason
            self._stop[i] = output.stop_reason
            self._error[i] = output.error
        if output.usage is not None:
            self.usage = output.usage
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs

    @property
    def done(self) -> bool:
        """The request's last Output has been added."""
        return self.usage is not None

    def result(self) -> Result:
        outputs = [Completion(index=i, text="".join(self._texts[i]), token_ids=self._token_ids[i],
                              finish_reason=self._finish[i], stop_reason=self._stop[i],
                              logprobs=self._logprobs[i], error=self._error[i])
                   for i in range(len(self._texts))]
        return Result(request_id=self.accepted.request_id, prompt_tokens=self.accepted.prompt_tokens,
                      outputs=outputs, usage=self.usage, prompt_logprobs=self.prompt_logprobs)


class Embedding(msgspec.Struct, kw_only=True):
    """One input's embedding: the pooled vector and the input's token count."""

    request_id: str
    embedding: list[float]
    prompt_tokens: int


def embedding_from(accepted: Accepted, output: Output) -> Embedding:
    """An embed request's result from its one Output; RequestError when it has none (the
    engine failed it, or it was aborted)."""
    if output.embedding is None:
        reason = output.finish_reason or "error"
        raise RequestError("aborted" if reason == "abort" else "engine_error",
                           output.error or f"the request ended ({reason}) without an embedding", output.id)
    return Embedding(request_id=accepted.request_id, embedding=output.embedding,
                     prompt_tokens=accepted.prompt_tokens)
