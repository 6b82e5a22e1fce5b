"""OpenAI's `POST /v1/chat/completions`, as the official SDKs call it: messages (tool
turns included), sampling, response formats, logprobs, n, and tools: `tools`,
`tool_choice` (auto, none, required, a named function), `parallel_tool_calls`. The
reply's `message.tool_calls` carry ids `call_...` and JSON text arguments, with
`finish_reason: "tool_calls"`; streamed, each call comes whole in one `tool_calls`
delta once it is complete and checked (chat_tools, llmd.tool_calls)."""
from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, raise_for_error
from llmd.http.chat_tools import ChatTools, chat_tools, history_call
from llmd.http.context import decode_body, served_model
from llmd.http.errors import ApiError
from llmd.http.keep_alive import parse_keep_alive
from llmd.http.openai_api import PARAMS, _SamplingFields, guided_from, sampling_params, stream_chunks, usage_of
from llmd.http.openai_logprobs import chat_logprobs
from llmd.http.streams import json_response
from llmd.tool_calls import ToolCall, ToolCallParser
from llmd_client.protocol import Output, Submit

_CHAT_PARAMS = {**PARAMS, "prompt": "messages", "logprobs": "top_logprobs"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def chat_messages(messages: list[ChatMessageIn]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: text content, and the tool fields of
    tool turns (an assistant's calls with their arguments as objects; a tool result's
    call id and, found from that id, its function's name)."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_params")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, from the assistant turns so far
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise ApiError(400, "message roles must be system, developer, user, assistant or tool",
                           param="messages", code="unsupported")
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ApiError(400, "only text content parts are supported", param="messages", code="unsupported")
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": _ROLES[m.role], "content": content}
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, f"messages[{i}].tool_calls belong to assistant messages", param="messages",
                               code="invalid_params")
            message["tool_calls"] = [history_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
            names.update((c["id"], c["function"]["name"]) for c in message["tool_calls"] if "id" in c)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(400, f"messages[{i}] (role tool) needs tool_call_id", param="messages",
                               code="invalid_params")
            message["tool_call_id"] = m.tool_call_id
            name = m.name or names.get(m.tool_call_id)
            if name is not None:
                message["name"] = name
        out.append(message)
    return out


def tool_call_entry(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI writes it (with its index, in a streamed delta)."""
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return entry if index is None else {"index": index, **entry}


def finish_reason(out: Output, num_calls: int) -> str | None:
    """"tool_calls" for a reply with calls that ended on its own; else the engine's."""
    return "tool_calls" if num_calls and out.finish_reason == "stop" else out.finish_reason


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ChatRequest)
    served = await served_model(request, body.model, parse_keep_alive(body.keep_alive))
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_params")
    messages = chat_messages(body.messages)
    response_guided = guided_from(body.response_format)
    tools = await chat_tools(request, body.tools, body.tool_choice, body.parallel_tool_calls, response_guided)
    k = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens=max_tokens, logprobs=k if body.logprobs else None,
                             guided=tools.guided or response_guided, params=_CHAT_PARAMS)
    names = {**_CHAT_PARAMS, "guided": "tools"} if tools.guided is not None else _CHAT_PARAMS
    submit = Submit(**tools.submit_fields(messages, params), cache_salt=body.cache_salt,
                    priority=body.priority)
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "object": "chat.completion", "created": created, "model": served.name}
    async with Generation(request, params=names,
                          strict_max_tokens=max_tokens is not None) as gen:
        await gen.admit([submit])

        def logprobs(out: Output) -> dict[str, list] | None:
            return chat_logprobs(served, out.logprobs, k) if body.logprobs and out.logprobs else None

        if body.stream:
            return await _stream(request, gen, {**head, "object": "chat.completion.chunk"}, body, tools,
                                 params.n, logprobs)
        merged = await gen.collect()
    finals = [merged[0][i] for i in sorted(merged[0])]
    for out in finals:
        raise_for_error(out, guided_param=names["guided"])
    choices = []
    for out in finals:
        parser = tools.parser()
        if parser is None:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            num_calls = 0
        else:
            reply = parser.parse(out.text)
            message = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                message["tool_calls"] = [tool_call_entry(c) for c in reply.tool_calls]
            num_calls = len(reply.tool_calls)
        choices.append({"index": out.index, "message": message, "logprobs": logprobs(out),
                        "finish_reason": finish_reason(out, num_calls)})
    return json_response({**head, "choices": choices, "usage": usage_of(finals)})


async def _stream(request: web.Request, gen: Generation, head: dict[str, Any], body: ChatRequest, tools: ChatTools,
                  n: int, logprobs) -> web.StreamResponse:
    """Chunks as the engine's outputs come; with tools, each sample's text goes through
    its parser: text deltas as `content`, each finished call as one `tool_calls` entry."""
    parsers: dict[int, ToolCallParser | None] = {i: tools.parser() for i in range(n)}
    opening = [{"index": i, "delta": {"role": "assistant", "content": "" if tools.choice is None else None},
                "logprobs": None, "finish_reason": None} for i in range(n)]

    def choice(_slot: int, out: Output, _first: bool) -> dict[str, Any]:
        parser = parsers[out.index]
        if parser is None:
            return {"index": out.index, "delta": {"content": out.text} if out.text else {},
                    "logprobs": logprobs(out), "finish_reason": out.finish_reason}
        before = parser.num_calls
        text, calls = parser.feed(out.text)
        if out.finish_reason is not None:
            tail, more = parser.finish()
            text, calls = text + tail, calls + more
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [tool_call_entry(c, before + i) for i, c in enumerate(calls)]
        return {"index": out.index, "delta": delta, "logprobs": logprobs(out),
                "finish_reason": finish_reason(out, parser.num_calls) if out.finish_reason else None}

    return await stream_chunks(request, gen, head, body.stream_options, choice, opening)


ROUTES = [("POST", "/v1/chat/completions", chat_completions)]
