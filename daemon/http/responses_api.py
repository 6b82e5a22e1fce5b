"""OpenAI's Responses API, `POST /v1/responses`, as the official SDKs call it: `input`
(a text, or a list of messages and tool turns), `instructions`, `max_output_tokens`,
sampling, `text.format` (structured output) and function `tools` with `tool_choice`
(auto, none, required, a named function: chat_tools makes forced calls valid), answered
whole or streamed as the API's named events (response.created, ...output_text.delta,
...function_call_arguments.done, ..., response.completed). Each call is an output item
`function_call` given out once it is complete and checked (llmd.tool_calls).

`model` names the model (loaded first if need be) and llmd's own `keep_alive` how long
it stays loaded after, as on the other endpoints; tools are written and parsed in that
model's call format. llmd stores no responses: `previous_response_id` and `background`
are refused, and each response says `store: false`. Hosted tools, reasoning and images are refused by
name, never dropped."""
from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, engine_error, raise_for_error
from llmd.http.chat_tools import ChatTools, chat_tools
from llmd.http.context import ServedModel, decode_body, served_model
from llmd.http.errors import ApiError
from llmd.http.keep_alive import parse_keep_alive
from llmd.http.openai_api import JsonSchemaFormat, guided_for
from llmd.http.responses_input import InputItem, chat_conversation
from llmd.http.sampling import CommonSampling, build_sampling
from llmd.http.streams import TypedEventStream, json_response
from llmd.tool_calls import ToolCall, ToolCallParser
from llmd_client.protocol import GuidedDecodingParams, Output, SamplingParams, Submit

# Internal field names as this API spells them, for error messages' `param`.
_PARAMS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input", "guided": "text"}


class TextFormat(JsonSchemaFormat, kw_only=True):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or the json_schema fields
    flattened beside the type."""

    type: str = "text"


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(CommonSampling, kw_only=True):
    """Unknown fields are ignored (clients send many); those that would change the answer
    and that llmd cannot honour are refused by name."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    # llmd's own (Ollama's keep_alive), as on the other OpenAI endpoints: how long the
    # model stays loaded once idle.
    keep_alive: str | int | float | None = None


def _refuse_unsupported(body: ResponsesRequest) -> None:
    refusals = [
        ("previous_response_id", body.previous_response_id is not None,
         "previous_response_id is not supported: llmd stores no responses; send the conversation as input"),
        ("background", bool(body.background), "background responses are not supported"),
        ("reasoning", any(v is not None for v in (body.reasoning or {}).values()),
         "reasoning options are not supported by this model"),
        ("top_logprobs", bool(body.top_logprobs), "top_logprobs is not supported on /v1/responses; "
                                                  "use /v1/chat/completions"),
        ("truncation", body.truncation not in (None, "disabled"), "truncation must be disabled: llmd does not "
                                                                  "drop input to make it fit"),
    ]
    for param, refused, message in refusals:
        if refused:
            raise ApiError(400, message, param=param, code="unsupported")


def _format(body: ResponsesRequest) -> TextFormat:
    return body.text.format if body.text is not None and body.text.format is not None else TextFormat()


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    """`text.format` as the response repeats it: the type, and a schema's fields."""
    fmt = _format(body)
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {"type": fmt.type, "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict,
            "description": fmt.description}


def _sampling(body: ResponsesRequest, guided: GuidedDecodingParams | None) -> SamplingParams:
    return build_sampling(body.sampling_fields() | {"guided": guided}, max_tokens=body.max_output_tokens,
                          params=_PARAMS)


def _status(out: Output) -> str:
    """completed, or incomplete (at max_output_tokens, or aborted: the API has no event
    for a cancelled stream)."""
    return "completed" if out.finish_reason == "stop" else "incomplete"


class _Response:
    """One response object as it grows: its fixed fields, its output items and the
    snapshot the API sends at each stage."""

    def __init__(self, body: ResponsesRequest, served: ServedModel, params: SamplingParams) -> None:
        self.fixed = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": served.name, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "truncation": "disabled",
            "text": {"format": _format_echo(body)}, "metadata": body.metadata or {}, "user": body.user}

    def snapshot(self, status: str, output: list[dict[str, Any]], *, usage: dict[str, Any] | None = None,
                 error: dict[str, str] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        return {**self.fixed, "status": status, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if status == "incomplete" else None}

    def finished(self, out: Output, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response for a finished output with these items."""
        status = _status(out)
        return self.snapshot(status, output, usage=_usage(out),
                             incomplete="max_output_tokens" if out.finish_reason == "length" else None)


def _message(ident: str, text: str, status: str) -> dict[str, Any]:
    content = [_part(text)] if status != "in_progress" else []
    return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": content}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: ToolCall, ident: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": ident or f"fc_{uuid.uuid4().hex}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments_json, "status": "completed"}


def _output_items(out: Output, parser: ToolCallParser | None) -> list[dict[str, Any]]:
    """A finished reply as output items: its text as a message (also when it is empty
    and there is nothing else), then each call it made."""
    if parser is None:
        return [_message(f"msg_{uuid.uuid4().hex}", out.text, _status(out))]
    reply = parser.parse(out.text)
    calls = [_function_call(call) for call in reply.tool_calls]
    if reply.content is None and calls:
        return calls
    return [_message(f"msg_{uuid.uuid4().hex}", reply.content or "", _status(out)), *calls]


def _usage(out: Output) -> dict[str, Any] | None:
    usage = out.usage
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


async def responses(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ResponsesRequest)
    served = await served_model(request, body.model, parse_keep_alive(body.keep_alive))
    _refuse_unsupported(body)
    messages = chat_conversation(body.instructions, body.input)
    fmt = _format(body)
    response_guided = guided_for(fmt.type, fmt.schema, param="text")
    tools = await chat_tools(request, body.tools, body.tool_choice, body.parallel_tool_calls, response_guided,
                             format_param="text")
    params = _sampling(body, tools.guided or response_guided)
    names = {**_PARAMS, "guided": "tools"} if tools.guided is not None else _PARAMS
    submit = Submit(**tools.submit_fields(messages, params))
    response = _Response(body, served, params)
    async with Generation(request, params=names,
                          strict_max_tokens=body.max_output_tokens is not None) as gen:
        await gen.admit([submit])
        if body.stream:
            return await _stream(request, gen, response, tools, names["guided"])
        out = (await gen.collect())[0][0]
    raise_for_error(out, guided_param=names["guided"])
    return json_response(response.finished(out, _output_items(out, tools.parser())))


class _StreamedItems:
    """The output items of a streamed response, each announced, filled and closed with
    the API's events: the text as a message (opened at its first delta when the reply
    may hold calls), each call as a function_call item once it is complete."""

    def __init__(self, stream: TypedEventStream) -> None:
        self.stream = stream
        self.done: list[dict[str, Any]] = []  # the closed items, in output order
        self.message: dict[str, Any] | None = None  # the open message item's place: item_id, output_index
        self.text: list[str] = []

    async def open_message(self) -> None:
        ident = f"msg_{uuid.uuid4().hex}"
        self.message = {"item_id": ident, "output_index": len(self.done), "content_index": 0}
        await self.stream.send({"type": "response.output_item.added", "output_index": len(self.done),
                                "item": _message(ident, "", "in_progress")})
        await self.stream.send({"type": "response.content_part.added", **self.message, "part": _part("")})

    async def add_text(self, text: str) -> None:
        if self.message is None:
            await self.open_message()
        self.text.append(text)
        await self.stream.send({"type": "response.output_text.delta", **self.message, "delta": text,
                                "logprobs": []})

    async def close_message(self, status: str) -> None:
        where, self.message = self.message, None
        if where is None:
            return
        whole, self.text = "".join(self.text), []
        await self.stream.send({"type": "response.output_text.done", **where, "text": whole, "logprobs": []})
        await self.stream.send({"type": "response.content_part.done", **where, "part": _part(whole)})
        item = _message(where["item_id"], whole, status)
        self.done.append(item)
        await self.stream.send({"type": "response.output_item.done", "output_index": where["output_index"],
                                "item": item})

    async def add_call(self, call: ToolCall) -> None:
        await self.close_message("completed")
        item = _function_call(call)
        where = {"item_id": item["id"], "output_index": len(self.done)}
        await self.stream.send({"type": "response.output_item.added", "output_index": where["output_index"],
                                "item": {**item, "arguments": "", "status": "in_progress"}})
        await self.stream.send({"type": "response.function_call_arguments.delta", **where,
                                "delta": item["arguments"]})
        await self.stream.send({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                                "arguments": item["arguments"]})
        self.done.append(item)
        await self.stream.send({"type": "response.output_item.done", "output_index": where["output_index"],
                                "item": item})


async def _stream(request: web.Request, gen: Generation, response: _Response, tools: ChatTools,
                  guided_param: str) -> web.StreamResponse:
    stream = TypedEventStream()
    await stream.open(request)
    starting = response.snapshot("in_progress", [])
    await stream.send({"type": "response.created", "response": starting})
    await stream.send({"type": "response.in_progress", "response": starting})
    parser = tools.parser()
    items = _StreamedItems(stream)
    if parser is None:
        await items.open_message()
    async for _slot, out in gen:
        if (error := engine_error(out, guided_param=guided_param)) is not None:
            failed = response.snapshot("failed", [], error={"code": "server_error", "message": error.message})
            await stream.send({"type": "response.failed", "response": failed})
            return await stream.close()
        text, calls = (out.text, []) if parser is None else parser.feed(out.text)
        if parser is not None and out.finish_reason is not None:
            tail, more = parser.finish()
            text, calls = text + tail, calls + more
        if text:
            await items.add_text(text)
        for call in calls:
            await items.add_call(call)
        if out.usage is not None:
            if not items.done and items.message is None:  # a reply with nothing in it: an empty message
                await items.open_message()
            await items.close_message(_status(out))
            final = response.finished(out, items.done)
            await stream.send({"type": f"response.{final['status']}", "response": final})
    return await stream.close()


ROUTES = [("POST", "/v1/responses", responses)]
