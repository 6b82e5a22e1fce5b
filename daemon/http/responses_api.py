"""OpenAI's Responses API, `POST /v1/responses`, as the official SDKs call it: `input`
(a text or a list of messages), `instructions`, `max_output_tokens`, sampling and
`text.format` (structured output), answered whole or streamed as the API's named
events (response.created, response.output_text.delta, ..., response.completed).

llmd stores no responses: `previous_response_id` and `background` are refused, and
each response says `store: false`. Tool calls, reasoning and images are refused by
name, never dropped."""
from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from llmd.http.bridge import Generation, engine_error, raise_for_error
from llmd.http.context import ServedModel, decode_body, served_model
from llmd.http.errors import ApiError
from llmd.http.openai_api import JsonSchemaFormat, guided_for
from llmd.http.sampling import CommonSampling, build_sampling
from llmd.http.streams import TypedEventStream, json_response
from llmd_client.protocol import ChatMessage, Output, SamplingParams, Submit

# Internal field names as this API spells them, for error messages' `param`.
_PARAMS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input", "guided": "text"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Content part types whose text the model reads: the user's, and the model's own earlier output.
_TEXT_PARTS = ("input_text", "output_text")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """A message item (EasyInputMessage or a full message); other item types are refused."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None


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


def _refuse_unsupported(body: ResponsesRequest) -> None:
    refusals = [
        ("tools", bool(body.tools), "tools are not supported"),
        ("tool_choice", body.tool_choice not in (None, "auto", "none"), "tool_choice needs tools, which are "
                                                                         "not supported"),
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


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` as the system message, then the input's messages."""
    messages = [ChatMessage("system", body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [ChatMessage("user", body.input)]
    if not body.input:
        raise ApiError(400, "input must not be empty", param="input", code="invalid_params")
    for item in body.input:
        if item.type != "message" or item.role not in _ROLES:
            raise ApiError(400, "input items must be messages with role user, assistant, system or developer "
                                "(tool calls are not supported)", param="input", code="unsupported")
        if isinstance(item.content, list):
            if any(p.type not in _TEXT_PARTS or p.text is None for p in item.content):
                raise ApiError(400, "only text content parts (input_text, output_text) are supported",
                               param="input", code="unsupported")
            content = "".join(p.text for p in item.content)
        else:
            content = item.content or ""
        messages.append(ChatMessage(_ROLES[item.role], content))
    return messages


def _format(body: ResponsesRequest) -> TextFormat:
    return body.text.format if body.text is not None and body.text.format is not None else TextFormat()


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    """`text.format` as the response repeats it: the type, and a schema's fields."""
    fmt = _format(body)
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {"type": fmt.type, "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict,
            "description": fmt.description}


def _sampling(body: ResponsesRequest) -> SamplingParams:
    fmt = _format(body)
    guided = guided_for(fmt.type, fmt.schema, param="text")
    return build_sampling(body.sampling_fields() | {"guided": guided}, max_tokens=body.max_output_tokens,
                          params=_PARAMS)


class _Response:
    """One response object as it grows: its fixed fields, its message item and the
    snapshot the API sends at each stage."""

    def __init__(self, body: ResponsesRequest, served: ServedModel, params: SamplingParams) -> None:
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.fixed = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": served.name, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "truncation": "disabled",
            "text": {"format": _format_echo(body)}, "metadata": body.metadata or {}, "user": body.user}

    def snapshot(self, status: str, output: list[dict[str, Any]], *, usage: dict[str, Any] | None = None,
                 error: dict[str, str] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        return {**self.fixed, "status": status, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if status == "incomplete" else None}

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [self.part(text)] if status != "in_progress" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def finished(self, out: Output, text: str) -> dict[str, Any]:
        """The whole response for a finished output: completed, or incomplete (at
        max_output_tokens, or aborted: the API has no event for a cancelled stream)."""
        status = "completed" if out.finish_reason == "stop" else "incomplete"
        return self.snapshot(status, [self.message(text, status)], usage=_usage(out),
                             incomplete="max_output_tokens" if out.finish_reason == "length" else None)


def _usage(out: Output) -> dict[str, Any] | None:
    usage = out.usage
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


async def responses(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ResponsesRequest)
    served = await served_model(request, body.model)
    _refuse_unsupported(body)
    params = _sampling(body)
    submit = Submit(messages=_messages(body), sampling=params)
    response = _Response(body, served, params)
    async with Generation(request, params=_PARAMS,
                          strict_max_tokens=body.max_output_tokens is not None) as gen:
        await gen.admit([submit])
        if body.stream:
            return await _stream(request, gen, response)
        out = (await gen.collect())[0][0]
    raise_for_error(out, guided_param="text")
    return json_response(response.finished(out, out.text))


async def _stream(request: web.Request, gen: Generation, response: _Response) -> web.StreamResponse:
    stream = TypedEventStream()
    await stream.open(request)
    where = {"item_id": response.message_id, "output_index": 0, "content_index": 0}
    starting = response.snapshot("in_progress", [])
    await stream.send({"type": "response.created", "response": starting})
    await stream.send({"type": "response.in_progress", "response": starting})
    await stream.send({"type": "response.output_item.added", "output_index": 0,
                       "item": response.message("", "in_progress")})
    await stream.send({"type": "response.content_part.added", **where, "part": response.part("")})
    text = []
    async for _slot, out in gen:
        if (error := engine_error(out, guided_param="text")) is not None:
            failed = response.snapshot("failed", [], error={"code": "server_error", "message": error.message})
            await stream.send({"type": "response.failed", "response": failed})
            return await stream.close()
        if out.text:
            text.append(out.text)
            await stream.send({"type": "response.output_text.delta", **where, "delta": out.text, "logprobs": []})
        if out.usage is not None:
            whole = "".join(text)
            final = response.finished(out, whole)
            await stream.send({"type": "response.output_text.done", **where, "text": whole, "logprobs": []})
            await stream.send({"type": "response.content_part.done", **where, "part": response.part(whole)})
            await stream.send({"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]})
            await stream.send({"type": f"response.{final['status']}", "response": final})
    return await stream.close()


ROUTES = [("POST", "/v1/responses", responses)]
