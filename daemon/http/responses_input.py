"""The Responses API's `input` as a chat conversation: message items, and the tool turns
an agent loop sends back — `function_call` items (the model's earlier calls, merged into
one assistant turn with the text before them) and `function_call_output` items (each a
tool result, answered by call id). Anything else (reasoning items, hosted tools' calls,
item references, images) is refused by name, never dropped."""
from __future__ import annotations

from typing import Any

import msgspec

from llmd.http.errors import ApiError
from llmd.http.openai_chat import ChatMessageIn, chat_messages

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Content part types whose text the model reads: the user's, and the model's own earlier output.
_TEXT_PARTS = ("input_text", "output_text")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """A message item (EasyInputMessage or a full message), a function call the model
    made, or a function's output."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if not isinstance(content, list):
        return content or ""
    if any(p.type not in _TEXT_PARTS or p.text is None for p in content):
        raise ApiError(400, f"{where}: only text content parts (input_text, output_text) are supported",
                       param="input", code="unsupported")
    return "".join(p.text for p in content)


def _call(item: InputItem, where: str) -> dict[str, Any]:
    if not item.call_id or not item.name or item.arguments is None:
        raise ApiError(400, f"{where} (a function_call) needs call_id, name and arguments", param="input",
                       code="invalid_params")
    return {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}


def chat_conversation(instructions: str | None, items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`instructions` as the system message, then the input as chat messages in the
    shape chat templates read (openai_chat.chat_messages checks the tool turns)."""
    messages = [ChatMessageIn("system", instructions)] if instructions else []
    if isinstance(items, str):
        return chat_messages(messages + [ChatMessageIn("user", items)])
    if not items:
        raise ApiError(400, "input must not be empty", param="input", code="invalid_params")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role not in _ROLES:
                raise ApiError(400, f"{where}: message roles must be user, assistant, system or developer",
                               param="input", code="unsupported")
            messages.append(ChatMessageIn(_ROLES[item.role], _text(item.content, where)))
        elif item.type == "function_call":
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":  # calls join the assistant turn they follow
                last = ChatMessageIn("assistant", None)
                messages.append(last)
            last.tool_calls = [*(last.tool_calls or []), _call(item, where)]
        elif item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise ApiError(400, f"{where} (a function_call_output) needs call_id and output", param="input",
                               code="invalid_params")
            messages.append(ChatMessageIn("tool", _text(item.output, where), tool_call_id=item.call_id))
        else:
            raise ApiError(400, f"{where}: input items must be messages, function_call or function_call_output "
                                "items (reasoning, hosted tools and item references are not supported)",
                           param="input", code="unsupported")
    try:
        return chat_messages(messages)
    except ApiError as exc:  # its words name the conversation's turns; the API's field is `input`
        exc.param = "input"
        raise
