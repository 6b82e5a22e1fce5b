"""Tool calling as the HTTP faces share it: a request's tools checked (a 400 naming the
field), the grammar that forces valid calls when the request or the operator asks for
it, the conversation's tool turns as the chat template reads them, and a parser for
each reply. Each face spells the calls in its own shape (openai_chat, ollama_api,
responses_api)."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from llmd.http.context import ServedModel, current_served
from llmd.http.errors import ApiError
from llmd.tool_calls import ToolCallParser, ToolChoice, ToolError, for_template, parse_tools
from llmd_client.protocol import ChatMessage, GuidedDecodingParams, SamplingParams


@dataclass(frozen=True)
class ChatTools:
    """A request's tools: `choice` None when no tool may be called; `guided` the grammar
    that makes the calls valid, when one applies."""

    choice: ToolChoice | None
    served: ServedModel
    guided: GuidedDecodingParams | None = None

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.served.tool_format, self.choice) if self.choice is not None else None

    def submit_fields(self, messages: list[dict[str, Any]], sampling: SamplingParams) -> dict[str, Any]:
        """Submit's `messages`, `tools` and `sampling` for the conversation (tool turns
        included): a reply that may call tools in a format whose markers are special
        tokens keeps their text (vLLM's Mistral parser does the same)."""
        rendered, tools = for_template(messages, self.choice, self.served.tool_format, self.served.chat_template)
        if self.choice is not None and sampling.skip_special_tokens and self.served.tool_markers_are_special:
            sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
        return {"messages": [ChatMessage(**m) for m in rendered], "tools": tools, "sampling": sampling}


async def chat_tools(request, tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                     response_guided: GuidedDecodingParams | None, *, choice_param: str = "tool_choice",
                     format_param: str = "response_format") -> ChatTools:
    """The request's tools, checked off the event loop (each schema is compiled once to
    know that it can be). A forced call (tool_choice required or a named function), or
    any call where the operator says `guided_tool_calls = "always"`, is guided by the
    model's call format; a forced call cannot be combined with a response format."""
    served: ServedModel = current_served(request)
    size = len(json.dumps(tools)) if tools else 0
    try:
        choice = await request.app["intake"].in_tokenizer_pool(size, functools.partial(
            parse_tools, tools, tool_choice, parallel_tool_calls, choice_param=choice_param))
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_params") from None
    if choice is None:
        return ChatTools(None, served)
    if choice.forced and response_guided is not None:
        raise ApiError(400, f"{format_param} cannot be combined with a forced tool call ({choice_param} required "
                            "or a named function): the call's own grammar shapes the reply", param=choice_param,
                       code="invalid_params")
    if response_guided is not None or not (choice.forced or served.guided_tool_calls == "always"):
        return ChatTools(choice, served)
    try:
        guided = GuidedDecodingParams(structural_tag=served.tool_format.structural_tag(choice))
    except ValueError as exc:
        raise ApiError(400, f"tools cannot be guided: {exc}", param="tools", code="invalid_params") from None
    return ChatTools(choice, served, guided)


def history_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """An earlier call's arguments as the template reads them: an object (OpenAI sends
    them as JSON text, Ollama as an object)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ApiError(400, f"{where} must be a JSON object (as text)", param="messages",
                           code="invalid_params") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where} must be a JSON object", param="messages", code="invalid_params")
    return arguments


def history_call(call: Any, where: str) -> dict[str, Any]:
    """One call of an assistant turn in the history, in transformers' shape."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"arguments\": ...}}", param="messages", code="invalid_params")
    out = {"type": "function", "function": {"name": function["name"], "arguments": history_arguments(
        function.get("arguments", {}), f"{where}.function.arguments")}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
