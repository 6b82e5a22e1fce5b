"""What the clients hand back (Result, Completion, Delta), how a Submit is built from a
call's arguments, and how a request's Output messages add up to a Result."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from llmd_client.protocol import (Accepted, ChatMessage, GuidedDecodingParams, Output, SamplingParams, Submit,
                                  TokenLogprob, Usage)

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

    def result(self) -> Result:
        outputs = [Completion(index=i, text="".join(self._texts[i]), token_ids=self._token_ids[i],
                              finish_reason=self._finish[i], stop_reason=self._stop[i],
                              logprobs=self._logprobs[i], error=self._error[i])
                   for i in range(len(self._texts))]
        return Result(request_id=self.accepted.request_id, prompt_tokens=self.accepted.prompt_tokens,
                      outputs=outputs, usage=self.usage, prompt_logprobs=self.prompt_logprobs)


def chat_messages(messages: Iterable[ChatMessage | Mapping[str, Any]]) -> list[ChatMessage]:
    """Accept ChatMessage structs or {"role": ..., "content": ...} dicts."""
    out = []
    for m in messages:
        if isinstance(m, ChatMessage):
            out.append(m)
        elif isinstance(m, Mapping):
            extra = set(m) - {"role", "content"}
            if extra or "role" not in m or "content" not in m:
                raise ValueError("messages: each message needs exactly the keys 'role' and 'content'")
            out.append(ChatMessage(role=str(m["role"]), content=str(m["content"])))
        else:
            raise TypeError(f"messages: expected dicts or ChatMessage, got {type(m).__name__}")
    return out


def sampling_params(sampling: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """`sampling` (or the defaults) with every override that is not None applied.
    Raises ValueError naming the field for a value out of range, TypeError for an
    unknown field."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(given.get("guided"), Mapping):
        # guided={"json_schema": {...}} as a plain dict; checked like any decoded message.
        try:
            given["guided"] = msgspec.convert(given["guided"], GuidedDecodingParams)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None
    if sampling is None:
        return SamplingParams(**given)
    if not given:
        return sampling
    return SamplingParams(**(msgspec.structs.asdict(sampling) | given))


def build_submit(id: str, prompt: str | None, messages: Iterable[Any] | None,
                 token_ids: Iterable[int] | None, sampling: SamplingParams, stream: bool,
                 priority: int) -> Submit:
    given = [name for name, v in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
             if v is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids"
                         + (f" (got {', '.join(given)})" if given else ""))
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    return Submit(id=id, prompt=prompt,
                  messages=chat_messages(messages) if messages is not None else None,
                  token_ids=[int(t) for t in token_ids] if token_ids is not None else None,
                  sampling=sampling, stream=stream, priority=priority)
