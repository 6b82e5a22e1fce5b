"""What goes out: the keyword arguments every request method of both clients takes
(RequestArgs), and how a call's arguments become the Submit message it sends (or, for
embed(), the Embed messages)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict

import msgspec

from llmd_client.protocol import ChatMessage, Embed, GuidedDecodingParams, PoolingParams, SamplingParams, Submit

# What embed() takes: one text, one list of token ids, or a list of either (a batch).
EmbedInput = str | Sequence[int] | Sequence[str | Sequence[int]]


class RequestArgs(TypedDict, total=False):
    """The keyword arguments of generate() and stream() (Client and AsyncClient), besides
    the positional prompt. Exactly one of prompt, messages or token_ids. Sampling settings
    not given (None) come from `sampling`, else SamplingParams' defaults; every other
    SamplingParams field (min_p, stop_token_ids, guided as a dict, ...) is taken too."""

    messages: Iterable[ChatMessage | Mapping[str, Any]] | None
    token_ids: Iterable[int] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    n: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    min_tokens: int | None
    ignore_eos: bool | None
    include_stop_str_in_output: bool | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    skip_special_tokens: bool | None
    guided: GuidedDecodingParams | Mapping[str, Any] | None
    speculative: bool | None
    priority: int
    sampling: SamplingParams | None
    model: str | None  # which model answers (None: the daemon's default)
    keep_alive: float | str | None  # how long that model stays loaded after this request


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


def sampling_params(sampling: SamplingParams | None, overrides: Mapping[str, Any]) -> SamplingParams:
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


def build_submit(id: str, prompt: str | None, args: RequestArgs, *, stream: bool) -> Submit:
    """The Submit for one call of generate() or stream(): `id` is the connection-local
    request id. Raises ValueError or TypeError (before anything is sent) for arguments
    that do not make a request."""
    options: dict[str, Any] = dict(args)
    messages = options.pop("messages", None)
    token_ids = options.pop("token_ids", None)
    priority = options.pop("priority", 0)
    model = options.pop("model", None)
    keep_alive = options.pop("keep_alive", None)
    sampling = sampling_params(options.pop("sampling", None), options)
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
                  sampling=sampling, stream=stream, priority=priority, model=model, keep_alive=keep_alive)


def build_embeds(new_id: Callable[[], str], input: EmbedInput, *, normalize: bool, dimensions: int | None,
                 truncate: bool, priority: int, model: str | None = None,
                 keep_alive: float | str | None = None) -> tuple[list[Embed], bool]:
    """The Embed messages for one call of embed() (one per input, each with a fresh
    connection-local id from `new_id`), and whether `input` was a single one (a text or
    a list of token ids) rather than a list of them; `model` and `keep_alive` as
    build_submit's. Raises ValueError or TypeError before anything is sent."""
    if isinstance(input, str) or (isinstance(input, Sequence) and input
                                  and all(isinstance(t, int) and not isinstance(t, bool) for t in input)):
        items, single = [input], True
    elif isinstance(input, Sequence) and not isinstance(input, (bytes, bytearray)):
        items, single = list(input), False
        if not items:
            raise ValueError("input must not be an empty list")
    else:
        raise TypeError(f"input must be a str, a list of token ids or a list of those, got {type(input).__name__}")
    pooling = PoolingParams(normalize=normalize, dimensions=dimensions)
    common = {"pooling": pooling, "truncate": truncate, "priority": priority, "model": model,
              "keep_alive": keep_alive}
    embeds = []
    for item in items:
        if isinstance(item, str):
            embeds.append(Embed(id=new_id(), prompt=item, **common))
        elif isinstance(item, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            embeds.append(Embed(id=new_id(), token_ids=[int(t) for t in item], **common))
        else:
            raise TypeError("each input must be a str or a list of token ids")
    return embeds, single
