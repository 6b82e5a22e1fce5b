"""OpenAI's API: `GET /v1/models` (and `/v1/models/{id}`) and `POST /v1/completions`, as
the official SDKs call them (vLLM's extra sampling fields accepted too, and its `echo`
with `max_tokens: 0`), and what the other OpenAI endpoints share: sampling fields,
response formats, usage, streamed chunks. Errors are OpenAI's error object with the
offending `param`; streams are server-sent events. Chat completions, the Responses API
and vLLM's /tokenize live beside this (openai_chat, responses_api, tokenize_api)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, engine_error, raise_for_error
from llmd.http.context import ServedModel, decode_body, resolve_model, served_model
from llmd.http.errors import ApiError
from llmd.http.keep_alive import parse_keep_alive
from llmd.http.model_cards import ModelCard, card_of, listing
from llmd.http.openai_logprobs import LogprobsWriter, with_prompt
from llmd.http.sampling import CommonSampling, build_sampling
from llmd.http.streams import EventStream, json_response
from llmd_client.protocol import INT32_MAX, GuidedDecodingParams, Output, SamplingParams, Submit


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(CommonSampling, kw_only=True):
    """Fields both endpoints take. Unknown fields are ignored (clients send many)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling fields
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    # llmd's own (Ollama's keep_alive): how long the model stays loaded once idle.
    keep_alive: str | int | float | None = None
    # Submit's range: a 400 naming the field, not the ValueError of building a Submit (a 500).
    priority: Annotated[int, msgspec.Meta(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


# Internal field names as this API spells them, for error messages' `param`.
PARAMS = {"guided": "response_format", "token_ids": "prompt"}


def sampling_params(body: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    guided: GuidedDecodingParams | None, params: dict[str, str],
                    prompt_logprobs: int | None = None) -> SamplingParams:
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
    fields = body.sampling_fields() | dict(
        n=body.n, stop=body.stop, repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, logprobs=logprobs, guided=guided,
        prompt_logprobs=prompt_logprobs)
    return build_sampling(fields, max_tokens=max_tokens, params=params)


def guided_from(fmt: ResponseFormat | None) -> GuidedDecodingParams | None:
    if fmt is None:
        return None
    return guided_for(fmt.type, fmt.json_schema.schema if fmt.json_schema is not None else None,
                      param="response_format", schema_field="json_schema.schema")


def guided_for(kind: str, schema: dict[str, Any] | None, *, param: str,
               schema_field: str = "schema") -> GuidedDecodingParams | None:
    """A response format (text, json_object, or json_schema with its schema) as guided
    decoding; errors name the API's `param` and the field holding the schema."""
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return GuidedDecodingParams(json_object=True)
        if kind == "json_schema":
            if schema is None:
                raise ApiError(400, f"{param} json_schema needs {schema_field}", param=param, code="invalid_params")
            return GuidedDecodingParams(json_schema=schema)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_params") from None
    raise ApiError(400, f"{param} type must be text, json_object or json_schema", param=param, code="invalid_params")


def usage_of(outputs: list[Output]) -> dict[str, Any]:
    prompt = sum(o.usage.prompt_tokens for o in outputs if o.usage is not None)
    completion = sum(o.usage.completion_tokens for o in outputs if o.usage is not None)
    cached = sum(o.usage.cached_tokens for o in outputs if o.usage is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- /v1/models ----------------------------------------------------------------------

def _model_card(card: ModelCard | ServedModel, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": card.created, "owned_by": "llmd",
            "max_model_len": card.max_model_len}


async def models(request: web.Request) -> web.Response:
    """Every model this daemon serves, loaded or not (the default first)."""
    cards = await listing(request.app["models"], request.app["model_cards"])
    return json_response({"object": "list", "data": [_model_card(card, card.name) for card in cards]})


async def model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}`: a model under any of its names (ids may hold slashes)."""
    name = request.match_info["model"]
    spec = resolve_model(request, name)
    cards = await listing(request.app["models"], request.app["model_cards"])
    card = next((c for c in cards if c.name == spec.name), None) or card_of(spec)
    return json_response(_model_card(card, name))


# -- /v1/completions -----------------------------------------------------------------

def completion_submits(body: CompletionRequest, served: ServedModel, params: SamplingParams) -> list[Submit]:
    prompts = _prompt_list(body.prompt)
    if body.suffix is not None:
        if served.fim is None:
            raise ApiError(400, "suffix needs a model with fill-in-the-middle tokens; this one has none",
                           param="suffix", code="unsupported")
        if not all(isinstance(p, str) for p in prompts):
            raise ApiError(400, "suffix needs text prompts, not token ids", param="suffix", code="invalid_params")
        prompts = [served.fim.prompt(p, body.suffix) for p in prompts]
    return [Submit(prompt=p, sampling=params, cache_salt=body.cache_salt, priority=body.priority)
            if isinstance(p, str) else
            Submit(token_ids=p, sampling=params, cache_salt=body.cache_salt, priority=body.priority)
            for p in prompts]


def _prompt_list(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: text, a list of texts, token ids, a list of token id lists."""
    bad = ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                   param="prompt", code="invalid_params")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be an empty list", param="prompt", code="invalid_params")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
           for p in prompt):
        return [list(p) for p in prompt]
    raise bad


async def completions(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, CompletionRequest)
    served = await served_model(request, body.model, parse_keep_alive(body.keep_alive))
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of must equal n (or be left out)", param="best_of", code="unsupported")
    echo_logprobs = body.echo and body.logprobs is not None
    if echo_logprobs and body.stream:
        raise ApiError(400, "echo with logprobs is not supported when streaming (the prompt's logprobs come "
                            "with the whole result)", param="echo", code="unsupported")
    # vLLM's way to score a prompt: echo with max_tokens 0 runs the prompt (one token is
    # generated, as the engine must) and answers with the prompt alone.
    prompt_only = body.echo and body.max_tokens == 0
    params = sampling_params(body, max_tokens=1 if prompt_only else body.max_tokens, logprobs=body.logprobs,
                             guided=guided_from(body.response_format), params=PARAMS,
                             prompt_logprobs=body.logprobs if echo_logprobs else None)
    submits = completion_submits(body, served, params)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    async with Generation(request, params=PARAMS,
                          view=_without_generation if prompt_only else None) as gen:
        admitted = await gen.admit(submits)
        echoes = [_echo_text(served, a.prepared, submits[a.slot]) if body.echo else "" for a in admitted]
        n = params.n
        writers = {(a.slot, i): LogprobsWriter(served, body.logprobs or 0, len(echoes[a.slot]))
                   for a in admitted for i in range(n)}

        def choice(slot: int, out: Output, text: str, prompt_logprobs: list | None = None) -> dict[str, Any]:
            logprobs = writers[slot, out.index](out.logprobs or []) if body.logprobs is not None else None
            if prompt_logprobs is not None:
                logprobs = with_prompt(served, admitted[slot].prepared.token_ids, prompt_logprobs, logprobs,
                                        body.logprobs)
            return {"index": slot * n + out.index, "text": text, "logprobs": logprobs,
                    "finish_reason": out.finish_reason}

        head = {"id": ident, "object": "text_completion", "created": created, "model": served.name}
        if body.stream:
            return await stream_chunks(request, gen, head, body.stream_options,
                                 lambda slot, out, first: choice(slot, out, (echoes[slot] if first else "") + out.text))
        merged = await gen.collect()
    finals = [out for samples in merged.values() for out in samples.values()]
    for out in finals:
        raise_for_error(out)
    prompt_lps = {slot: next((o.prompt_logprobs for o in samples.values() if o.prompt_logprobs is not None), None)
                  for slot, samples in merged.items()}
    choices = [choice(slot, out, echoes[slot] + out.text, prompt_lps[slot] if echo_logprobs else None)
               for slot in sorted(merged) for out in (merged[slot][i] for i in sorted(merged[slot]))]
    return json_response({**head, "choices": choices, "usage": usage_of(finals)})


def _without_generation(out: Output) -> Output:
    """An output with its generated token taken out (echo with max_tokens 0): no text,
    ids or logprobs, finished for length, no completion tokens billed."""
    usage = out.usage and msgspec.structs.replace(out.usage, completion_tokens=0)
    finish = out.finish_reason if out.finish_reason in (None, "error", "abort") else "length"
    return msgspec.structs.replace(out, text="", token_ids=[], logprobs=None if out.logprobs is None else [],
                                   finish_reason=finish, stop_reason=None, usage=usage)


def _echo_text(served: ServedModel, prepared, submit: Submit) -> str:
    if submit.prompt is not None:
        return submit.prompt
    return served.tokenizer.decode(prepared.token_ids, skip_special_tokens=False)


async def stream_chunks(request: web.Request, gen: Generation, head: dict[str, Any], options: StreamOptions | None,
                  choice: Callable[[int, Output, bool], dict[str, Any]],
                  opening: list[dict[str, Any]] = ()) -> web.StreamResponse:
    """Chunks as they come: one event per engine output, then (with include_usage) a
    usage event with no choices, then [DONE]. An engine error becomes an error event."""
    include_usage = options is not None and options.include_usage
    stream = EventStream()
    await stream.open(request)
    extra = {"usage": None} if include_usage else {}
    if opening:
        await stream.send({**head, "choices": opening, **extra})
    seen: set[tuple[int, int]] = set()
    finals: list[Output] = []
    async for slot, out in gen:
        if (error := engine_error(out)) is not None:
            await stream.send(error_body(error))
            return await stream.close()
        if out.usage is not None:
            finals.append(out)
        if not (out.text or out.token_ids or out.finish_reason):
            continue
        first = (slot, out.index) not in seen
        seen.add((slot, out.index))
        await stream.send({**head, "choices": [choice(slot, out, first)], **extra})
    if include_usage:
        await stream.send({**head, "choices": [], "usage": usage_of(finals)})
    return await stream.close()


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: ApiError) -> web.Response:
    return json_response(error_body(exc), status=exc.status)


ROUTES = [("GET", "/v1/models", models), ("GET", "/v1/models/{model:.+}", model),
          ("POST", "/v1/completions", completions)]
