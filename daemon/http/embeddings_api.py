"""Embeddings on the HTTP faces: OpenAI's `POST /v1/embeddings` and Ollama's
`POST /api/embed` and legacy `POST /api/embeddings`, as the official `openai` and
`ollama` packages call them. Each input is one engine request (an `Embed`, admitted
through the intake like any prompt, so limits, quotas and metrics count it), all of a
request's inputs batched together by the scheduler; the model's final hidden states are
pooled by the engine's `pooling_type`. They work on a model served for generation too,
as Ollama's do.

- OpenAI: `input` is a string, a list of strings, a list of token ids or a list of
  such lists; `encoding_format` "float" or "base64" (the float32 values, little-endian,
  as the SDK decodes them; the SDK asks for base64 when the caller does not choose);
  `dimensions` for Matryoshka models (cut, then normalized; refused otherwise). An input
  longer than max_model_len is refused.
- Ollama `/api/embed`: `input` a string or a list of strings, unit vectors; `truncate`
  (default true, Ollama's) keeps an input's first tokens that fit the context
  (`options.num_ctx`, at most max_model_len); no input at all loads the model (an empty
  list back), as Ollama answers it. `/api/embeddings` (`prompt` -> `embedding`) returns
  the vector as pooled, not normalized, and refuses what does not fit, as Ollama's does.

`model` names the model that embeds (loaded first if need be, as for generation; a
model table may serve one with `task = "embed"`); Ollama's `keep_alive` (and llmd's own
on OpenAI's endpoint) says how long it stays loaded after.
"""
from __future__ import annotations

import base64
import struct
import time
from typing import Any, Literal

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, raise_for_error
from llmd.http.context import decode_body, served_model
from llmd.http.errors import ApiError
from llmd.http.keep_alive import parse_keep_alive
from llmd.http.ollama_api import Options, num_ctx_of
from llmd.http.streams import json_response
from llmd_client.protocol import Embed, Output, PoolingParams


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings request (unknown fields are ignored, as clients send extras)."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # llmd's own (Ollama's keep_alive): how long the model stays loaded once idle.
    keep_alive: str | int | float | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    """Ollama's /api/embed."""

    model: str
    input: str | list[str] | None = None
    truncate: bool = True
    options: Options | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class LegacyEmbeddingsRequest(msgspec.Struct, kw_only=True):
    """Ollama's /api/embeddings (deprecated there, still used by older clients)."""

    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | int | float | None = None


async def _embed(request: web.Request, inputs: list[str | list[int]], pooling: PoolingParams, *, field: str,
                 truncate: bool = False, num_ctx: int | None = None) -> list[Output]:
    """Each input's final Output (its embedding and usage), in order; an input that is
    refused fails the whole request with an error naming it (`field`, indexed in a list)."""
    embeds = [Embed(prompt=i, pooling=pooling, truncate=truncate) if isinstance(i, str) else
              Embed(token_ids=i, pooling=pooling, truncate=truncate) for i in inputs]
    params = {"prompt": field, "token_ids": field}
    async with Generation(request, params=params, num_ctx=num_ctx) as gen:
        try:
            await gen.admit(embeds)
        except ApiError as exc:
            raise _naming_input(exc, field, len(gen.admitted) if len(inputs) > 1 else None) from None
        merged = await gen.collect()
    outputs = [merged[slot][0] for slot in range(len(inputs))]
    for out in outputs:
        raise_for_error(out)
        if out.embedding is None:  # aborted: the daemon is draining
            raise ApiError(503, out.error or "the request was aborted before its embedding was made",
                           code="shutting_down")
    return outputs


def _naming_input(exc: ApiError, field: str, index: int | None) -> ApiError:
    """The intake's message names the text `prompt`; this API calls it `field`, and in a
    list the one refused (`input[2] is empty`)."""
    if exc.param != field:
        return exc
    name = field if index is None else f"{field}[{index}]"
    return ApiError(exc.status, name + exc.message.removeprefix("prompt"), param=field, code=exc.code)


# -- OpenAI ------------------------------------------------------------------------------

def _openai_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four input shapes; empty texts and lists are refused, as OpenAI does."""
    def bad(message: str) -> ApiError:
        return ApiError(400, message, param="input", code="invalid_params")

    if isinstance(value, str):
        inputs: list[Any] = [value]
    elif not value:
        raise bad("input must not be an empty list")
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        inputs = [value]
    elif all(isinstance(t, str) for t in value) or all(isinstance(t, list) for t in value):
        inputs = value
    else:
        raise bad("input must be a string, a list of strings, a list of token ids or a list of such lists")
    for i, item in enumerate(inputs):
        name = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise bad(f"{name} must be a list of token ids (integers)")
        if not item:
            raise bad(f"{name} must not be empty")
    return inputs


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def embeddings(request: web.Request) -> web.Response:
    body = await decode_body(request, EmbeddingRequest)
    inputs, pooling = _openai_inputs(body.input), _pooling(body.dimensions, normalize=True)
    served = await served_model(request, body.model, parse_keep_alive(body.keep_alive))
    outputs = await _embed(request, inputs, pooling, field="input")
    prompt_tokens = sum(out.usage.prompt_tokens for out in outputs)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, body.encoding_format)}
            for i, out in enumerate(outputs)]
    return json_response({"object": "list", "data": data, "model": served.name,
                          "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


def _pooling(dimensions: int | None, *, normalize: bool) -> PoolingParams:
    try:
        return PoolingParams(normalize=normalize, dimensions=dimensions)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="dimensions", code="invalid_params") from None


# -- Ollama ------------------------------------------------------------------------------

async def embed(request: web.Request) -> web.Response:
    started = time.monotonic()
    body = await decode_body(request, EmbedRequest)
    inputs: list[str] = [body.input] if isinstance(body.input, str) else list(body.input or [])
    if inputs == [""]:
        inputs = []  # an empty string loads the model, as no input does
    for i, text in enumerate(inputs):
        if not text:
            raise ApiError(400, f"input[{i}] must not be empty", param="input")
    # Ollama reads dimensions 0 as not given (Go's zero value).
    pooling = _pooling(body.dimensions or None, normalize=True)
    # No input: the model is loaded and kept for keep_alive (0: unloaded once answered).
    served = await served_model(request, body.model, parse_keep_alive(body.keep_alive))
    loaded = time.monotonic()
    num_ctx = num_ctx_of(body.options, served)
    outputs = [] if not inputs else await _embed(request, inputs, pooling, field="input", truncate=body.truncate,
                                                  num_ctx=num_ctx)
    return json_response({"model": body.model, "embeddings": [out.embedding for out in outputs],
                          "total_duration": int((time.monotonic() - started) * 1e9),
                          "load_duration": int((loaded - started) * 1e9),
                          "prompt_eval_count": sum(out.usage.prompt_tokens for out in outputs)})


async def legacy_embeddings(request: web.Request) -> web.Response:
    body = await decode_body(request, LegacyEmbeddingsRequest)
    served = await served_model(request, body.model, parse_keep_alive(body.keep_alive))
    num_ctx = num_ctx_of(body.options, served)
    outputs = [] if not body.prompt else await _embed(request, [body.prompt], PoolingParams(normalize=False),
                                                       field="prompt", num_ctx=num_ctx)
    return json_response({"embedding": outputs[0].embedding if outputs else []})


ROUTES = [("POST", "/v1/embeddings", embeddings), ("POST", "/api/embed", embed),
          ("POST", "/api/embeddings", legacy_embeddings)]
