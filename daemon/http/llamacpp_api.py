"""llama.cpp server's `POST /infill`, as llama.vscode-style editor plugins call it: a
prefix, a suffix and extra context files in, the middle out (server-sent events when
streamed). Errors are llama.cpp's `{"error": {"code", "message", "type"}}`."""
from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, engine_error, raise_for_error
from llmd.http.context import ServedModel, decode_body, served_model
from llmd.http.errors import ApiError
from llmd.http.sampling import LlamaSampling, build_sampling
from llmd.http.streams import EventStream, json_response
from llmd_client.protocol import Output, SamplingParams, Submit


class ExtraChunk(msgspec.Struct):
    text: str
    filename: str = ""


class InfillRequest(LlamaSampling, kw_only=True):
    model: str | None = None  # llmd's own (llama.cpp serves one model): which model infills
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""  # the start of the middle, already typed
    n_predict: int = -1
    stream: bool = False


_PARAMS = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}
_STOP_TYPES = {"stop": "eos", "length": "limit"}


def _sampling(body: InfillRequest) -> SamplingParams:
    max_tokens = None if body.n_predict < 0 else body.n_predict
    return build_sampling(body.sampling_fields(), max_tokens=max_tokens, params=_PARAMS)


def _final(served: ServedModel, out: Output, started: float, text: str) -> dict[str, Any]:
    usage = out.usage
    stop_type = "word" if isinstance(out.stop_reason, str) else _STOP_TYPES.get(out.finish_reason or "", "none")
    predicted = usage.completion_tokens if usage else 0
    elapsed_ms = (time.monotonic() - started) * 1000
    return {"content": text, "stop": True, "model": served.name, "tokens_predicted": predicted,
            "tokens_evaluated": usage.prompt_tokens if usage else 0, "tokens_cached": usage.cached_tokens if usage else 0,
            "stop_type": stop_type, "stopping_word": out.stop_reason if isinstance(out.stop_reason, str) else "",
            "truncated": False,
            "timings": {"predicted_n": predicted, "predicted_ms": elapsed_ms,
                        "predicted_per_second": predicted / elapsed_ms * 1000 if elapsed_ms else 0.0}}


async def infill(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, InfillRequest)
    served = await served_model(request, body.model)
    if served.fim is None:
        raise ApiError(501, "this model has no fill-in-the-middle tokens, so it cannot infill", code="not_supported")
    text = served.fim.prompt(body.input_prefix, body.input_suffix,
                             [(c.filename, c.text) for c in body.input_extra]) + body.prompt
    submit = Submit(prompt=text, sampling=_sampling(body))
    started = time.monotonic()
    async with Generation(request, params=_PARAMS, strict_max_tokens=False) as gen:
        await gen.admit([submit])
        if not body.stream:
            out = (await gen.collect())[0][0]
            raise_for_error(out)
            return json_response(_final(served, out, started, out.text))
        stream = EventStream()
        await stream.open(request)
        async for _slot, out in gen:
            if (error := engine_error(out)) is not None:
                await stream.send(error_body(error))
                return await stream.close(done_marker=False)
            if out.usage is not None:
                await stream.send(_final(served, out, started, out.text))
            elif out.text:
                await stream.send({"content": out.text, "stop": False})
        return await stream.close(done_marker=False)


def error_body(exc: ApiError) -> dict[str, Any]:
    kind = "not_supported_error" if exc.status == 501 else exc.type
    return {"error": {"code": exc.status, "message": exc.message, "type": kind}}


def error_response(exc: ApiError) -> web.Response:
    return json_response(error_body(exc), status=exc.status)


ROUTES = [("POST", "/infill", infill)]
