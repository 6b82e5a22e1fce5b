"""Ollama's API: `/api/generate`, `/api/chat`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`, streamed as newline-delimited JSON, so a client set up for Ollama works
by changing its URL. Errors are Ollama's `{"error": "..."}`. `/api/chat` calls tools
(chat_tools): `message.tool_calls` with object arguments, tool turns in the history,
and llmd's own `tool_choice` (Ollama has none) to force a call.

`options.num_ctx` narrows a request's context below max_model_len (a larger one is
refused: the engine's context is set at load). `model` names the model (loaded on its
first request); `keep_alive` says how long it stays loaded after the request (Ollama's
durations; 0: unloaded right after); a request with nothing to generate loads the
model, or with keep_alive 0 unloads it, as Ollama does. /api/ps lists the loaded
models and when each goes; /api/tags every model that can be served."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, engine_error, raise_for_error
from llmd.http.chat_tools import chat_tools, history_call
from llmd.http.context import ServedModel, decode_body, resolve_model, served_model
from llmd.http.errors import ApiError
from llmd.http.keep_alive import expires_at_text, parse_keep_alive
from llmd.http.model_cards import ModelCard, listing
from llmd.http.sampling import LlamaSampling, build_sampling
from llmd.http.streams import NdjsonStream, json_response
from llmd.tool_calls import ToolCall, ToolCallParser
from llmd_client.protocol import ChatMessage, GuidedDecodingParams, Output, SamplingParams, Submit

OLLAMA_VERSION = "0.12.0"  # the Ollama API version these endpoints follow


class Options(LlamaSampling, kw_only=True):
    """Ollama's model options that sample, and num_ctx; the rest (num_gpu, num_thread,
    ...) are ignored, as they are load-time settings of a daemon that serves one loaded
    model."""

    num_predict: int | None = None
    num_ctx: int | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    images: list[str] | None = None
    context: list[int] | None = None
    keep_alive: str | int | float | None = None


class Message(msgspec.Struct):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None  # a tool result's function


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[Message] = []
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    tools: list[Any] | None = None
    # llmd's own (Ollama has none): OpenAI's tool_choice, to force a call.
    tool_choice: str | dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older spelling


_PARAMS = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty", "guided": "format",
           "prompt": "prompt", "messages": "messages"}


def num_ctx_of(options: Options | None, served: ServedModel) -> int | None:
    """The request's context length: num_ctx, which must fit the engine's."""
    num_ctx = options.num_ctx if options is not None else None
    if num_ctx is None:
        return None
    if not 1 <= num_ctx <= served.max_model_len:
        raise ApiError(400, f"num_ctx must be in [1, {served.max_model_len}] (the model's max_model_len, set when "
                            f"the daemon starts), got {num_ctx}", param="num_ctx")
    return num_ctx


def _sampling(options: Options | None, fmt: str | dict[str, Any] | None) -> SamplingParams:
    o = options or Options()
    guided = None
    if fmt == "json":
        guided = GuidedDecodingParams(json_object=True)
    elif isinstance(fmt, dict):
        guided = GuidedDecodingParams(json_schema=fmt)
    elif fmt not in (None, ""):
        raise ApiError(400, 'format must be "json" or a JSON schema object', param="format")
    fields = o.sampling_fields() | {"guided": guided}
    # Ollama's num_predict: -1 (or absent) means until the context is full.
    max_tokens = None if o.num_predict is None or o.num_predict < 0 else o.num_predict
    return build_sampling(fields, max_tokens=max_tokens, params=_PARAMS)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _final_fields(request: web.Request, out: Output, started: float, first_token: float | None) -> dict[str, Any]:
    """The done message's counts and durations (ns), as measured here: the model's load
    (when this request waited for one), the prompt's from the request's arrival to its
    first token, the generation's from there to the end."""
    end = time.monotonic()
    first = first_token if first_token is not None else end
    usage = out.usage
    reason = out.finish_reason if out.finish_reason in ("stop", "length") else out.finish_reason or "stop"
    return {"done": True, "done_reason": reason,
            "total_duration": int((end - request["arrived"]) * 1e9),
            "load_duration": int((started - request["arrived"]) * 1e9),
            "prompt_eval_count": usage.prompt_tokens if usage else 0,
            "prompt_eval_duration": int((first - started) * 1e9),
            "eval_count": usage.completion_tokens if usage else 0,
            "eval_duration": int((end - first) * 1e9)}


async def _respond(request: web.Request, served: ServedModel, submit: Submit, num_ctx: int | None, wrap,
                   parser: ToolCallParser | None = None) -> web.StreamResponse:
    """Run one request; `wrap(text, calls)` shapes a piece of output (`response` or
    `message`); with a parser, the text goes through it and its calls come out whole."""
    started = time.monotonic()
    params = {**_PARAMS, "guided": "tools"} if parser is not None and submit.sampling.guided else _PARAMS
    async with Generation(request, params=params, strict_max_tokens=False,
                          num_ctx=num_ctx) as gen:
        await gen.admit([submit])
        if not request["stream"]:
            out = (await gen.collect())[0][0]
            raise_for_error(out, guided_param=params["guided"])
            if parser is None:
                text, calls = out.text, []
            else:
                reply = parser.parse(out.text)
                text, calls = reply.content or "", reply.tool_calls
            return json_response({"model": served.name, "created_at": _now(), **wrap(text, calls),
                                  **_final_fields(request, out, started, gen.first_token_at.get(0))})
        stream = NdjsonStream()
        await stream.open(request)
        async for _slot, out in gen:
            if (error := engine_error(out, guided_param=params["guided"])) is not None:
                await stream.send({"error": error.message})
                return await stream.close()
            text, calls = out.text, []
            if parser is not None:
                text, calls = parser.feed(out.text)
                if out.finish_reason is not None:
                    tail, more = parser.finish()
                    text, calls = text + tail, calls + more
            if text or calls:
                await stream.send({"model": served.name, "created_at": _now(), **wrap(text, calls), "done": False})
            if out.usage is not None:
                await stream.send({"model": served.name, "created_at": _now(), **wrap("", []),
                                   **_final_fields(request, out, started, gen.first_token_at.get(0))})
        return await stream.close()


async def _model(request: web.Request, requested: str, keep_alive: str | int | float | None,
                 nothing_to_generate: bool, wrap) -> ServedModel | web.Response:
    """The model a generate or chat request names, loaded and kept for its keep_alive;
    for a request with nothing to generate, Ollama's answer: the model loaded ("load"),
    or with keep_alive 0 unloaded ("unload")."""
    request["arrived"] = time.monotonic()
    seconds = parse_keep_alive(keep_alive)
    if nothing_to_generate and seconds == 0:
        spec = resolve_model(request, requested)
        await request.app["models"].unload(spec)
        return json_response({"model": spec.name, "created_at": _now(), **wrap("", []), "done": True,
                              "done_reason": "unload"})
    served = await served_model(request, requested, seconds)
    if nothing_to_generate:
        return json_response({"model": served.name, "created_at": _now(), **wrap("", []), "done": True,
                              "done_reason": "load"})
    return served


async def generate(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, GenerateRequest)
    served = await _model(request, body.model, body.keep_alive, not body.prompt and body.suffix is None,
                          _as_response)
    if isinstance(served, web.Response):
        return served
    for name in ("images", "context"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported", param=name)
    if body.template:
        raise ApiError(400, "template is not supported; the model's own chat template is used", param="template")
    request["stream"] = body.stream
    num_ctx = num_ctx_of(body.options, served)
    params = _sampling(body.options, body.format)
    if body.suffix is not None:
        if served.fim is None:
            raise ApiError(400, "suffix needs a model with fill-in-the-middle tokens; this one has none",
                           param="suffix")
        submit = Submit(prompt=served.fim.prompt(body.prompt, body.suffix), sampling=params)
    elif body.raw or served.chat_template is None:
        submit = Submit(prompt=body.prompt, sampling=params)
    else:
        messages = ([ChatMessage("system", body.system)] if body.system else []) + [ChatMessage("user", body.prompt)]
        submit = Submit(messages=messages, sampling=params)
    return await _respond(request, served, submit, num_ctx, _as_response)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ChatRequest)
    served = await _model(request, body.model, body.keep_alive, not body.messages, _as_message)
    if isinstance(served, web.Response):
        return served
    request["stream"] = body.stream
    num_ctx = num_ctx_of(body.options, served)
    params = _sampling(body.options, body.format)
    tools = await chat_tools(request, body.tools, body.tool_choice, None, params.guided, format_param="format")
    if tools.guided is not None:
        params = msgspec.structs.replace(params, guided=tools.guided)
    submit = Submit(**tools.submit_fields(_chat_messages(body.messages), params))
    return await _respond(request, served, submit, num_ctx, _as_message, tools.parser())


def _chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as chat templates read them: an assistant's calls (arguments
    are objects), a tool result with its function's name."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.images:
            raise ApiError(400, "images are not supported", param="messages")
        if m.role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, "message roles must be system, user, assistant or tool", param="messages")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [history_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _as_response(text: str, _calls: list[ToolCall]) -> dict[str, Any]:
    return {"response": text}


def _as_message(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    """Ollama's message: its calls' arguments are objects."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return {"message": message}


def _details(card: ServedModel | ModelCard) -> dict[str, Any]:
    family = card.architecture.removesuffix("ForCausalLM").lower()
    return {"parent_model": "", "format": card.format, "family": family, "families": [family],
            "parameter_size": card.parameter_size, "quantization_level": card.quantization}


def _modified_at(card: ServedModel | ModelCard) -> str:
    return datetime.fromtimestamp(card.created, timezone.utc).isoformat().replace("+00:00", "Z")


async def tags(request: web.Request) -> web.Response:
    """Every model that can be served, loaded or not (the default first)."""
    cards = await listing(request.app["models"], request.app["model_cards"])
    return json_response({"models": [
        {"name": f"{card.name}:latest", "model": f"{card.name}:latest", "modified_at": _modified_at(card),
         "size": card.size_bytes, "digest": card.digest, "details": _details(card)} for card in cards]})


async def ps(request: web.Request) -> web.Response:
    """The models loaded now: what each holds, and when it goes (the far future: never)."""
    pool, entries = request.app["models"], []
    for view in pool.snapshot():
        slot = pool.slots.get(view.name)
        served = slot.model.served if slot is not None and slot.model is not None else None
        if view.state != "serving" or served is None:
            continue
        on_gpu = slot.model.engine is not None and slot.model.engine.device.type == "cuda"
        entries.append({"name": f"{served.name}:latest", "model": f"{served.name}:latest", "size": view.memory_bytes,
                        "digest": served.digest, "details": _details(served),
                        "expires_at": expires_at_text(view.expires_at),
                        "size_vram": view.memory_bytes if on_gpu else 0, "context_length": served.max_model_len})
    return json_response({"models": entries})


async def show(request: web.Request) -> web.Response:
    """A model's description, from its files (a model that is not loaded is not loaded
    for it: its template is shown where the files hold it as text, and `insert` once it
    has loaded and its tokenizer was seen to have fill-in-the-middle tokens)."""
    body = await decode_body(request, ShowRequest)
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model is required", param="model")
    spec = resolve_model(request, name)
    cards = await listing(request.app["models"], request.app["model_cards"])
    card = next((c for c in cards if c.name == spec.name), None)
    if card is None:
        raise ApiError(503, f"model {spec.name}: its files cannot be read", param="model", code="model_unavailable")
    family = _details(card)["family"]
    if card.task == "embed":
        capabilities = ["embedding"]
    else:
        capabilities = ["completion", "tools"] + (["insert"] if getattr(card, "fim", None) is not None else [])
    return json_response({
        "license": "", "modelfile": f"FROM {card.name}\n", "parameters": "",
        "template": card.chat_template or "{{ .Prompt }}", "details": _details(card),
        "model_info": {"general.architecture": family, "general.parameter_count": card.num_params,
                       f"{family}.context_length": card.max_model_len},
        "capabilities": capabilities, "modified_at": _modified_at(card)})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": OLLAMA_VERSION})


async def root(request: web.Request) -> web.Response:
    # Ollama answers its root with this text; some clients probe it.
    return web.Response(text="Ollama is running")


def error_response(exc: ApiError) -> web.Response:
    return json_response({"error": exc.message}, status=exc.status)


ROUTES = [("POST", "/api/generate", generate), ("POST", "/api/chat", chat), ("GET", "/api/tags", tags),
          ("GET", "/api/ps", ps), ("POST", "/api/show", show), ("GET", "/api/version", version),
          ("GET", "/", root)]
