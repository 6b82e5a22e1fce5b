"""Reading tool calls out of a reply, whole or as it streams, with one rule for both so a
streamed reply reassembles to exactly the whole one:

- a call is given out only once it is complete and checked: its function is one of the
  request's and its arguments are a JSON object valid for that function's schema (vLLM
  streams arguments as they come and may so send a call that turns out invalid);
- a call that fails the check, or is cut short, stays in the reply as text, as written;
- text streams as it comes, except what may begin a call marker (held until it is
  told apart) and whitespace (held until more text follows: a reply with calls drops
  its trailing whitespace, and one whose text is only whitespace has no content).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmd.tool_calls.formats import ExactNumber, RawCall, ToolCallFormat
from llmd.tool_calls.tools import ToolChoice, arguments_valid


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


_ENCODER = msgspec.json.Encoder()


def _as_written(value: Any) -> Any:
    """Decoded JSON with each number a float cannot hold as its text (msgspec.Raw)."""
    if isinstance(value, ExactNumber):
        return msgspec.Raw(value.text.encode())
    if isinstance(value, dict):
        return {k: _as_written(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_written(v) for v in value]
    return value


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]  # encodable by msgspec (numbers a float cannot hold are msgspec.Raw)
    id: str = field(default_factory=new_call_id)

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: JSON text."""
        return _ENCODER.encode(self.arguments).decode()


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall]


class ToolCallParser:
    """One reply's parser: `feed(delta)` returns the new text and the calls completed by
    it; `finish()` those the reply's end settles. `parse(text)` does both at once."""

    def __init__(self, fmt: ToolCallFormat, choice: ToolChoice) -> None:
        self.choice = choice
        self.scanner = fmt.scanner()
        self.buffer = ""
        self.held_space = ""  # whitespace not yet given out
        self.num_calls = 0
        self.num_text_chars = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, calls = self._scan(final=True)
        if not self.num_calls:  # a reply without calls keeps all its text
            text += self.held_space
            self.num_text_chars += len(self.held_space)
        self.held_space = ""
        return text, calls

    def parse(self, text: str) -> ParsedReply:
        head, calls = self.feed(text)
        tail, more = self.finish()
        content = head + tail
        return ParsedReply(content if content else None, calls + more)

    def _scan(self, final: bool) -> tuple[str, list[ToolCall]]:
        pieces, used = self.scanner.scan(self.buffer, final)
        self.buffer = self.buffer[used:]
        text: list[str] = []
        calls: list[ToolCall] = []
        for piece in pieces:
            checked = self._checked(piece[1]) if piece[0] == "calls" else None
            if checked is None:
                text.append(self._text(piece[1] if piece[0] == "text" else piece[2]))
            else:
                calls.extend(checked)
                self.num_calls += len(checked)
        return "".join(text), calls

    def _text(self, text: str) -> str:
        """`text` to give out now: held whitespace first, trailing whitespace held."""
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        self.num_text_chars += len(body)
        return body

    def _checked(self, raw_calls: list[RawCall] | None) -> list[ToolCall] | None:
        if raw_calls is None:
            return None
        if not self.choice.parallel and self.num_calls + len(raw_calls) > 1:
            return None
        calls: list[ToolCall] = []
        for name, arguments in raw_calls:
            tool = self.choice.tool(name) if isinstance(name, str) else None
            if tool is None or not arguments_valid(tool, arguments):
                return None
            calls.append(ToolCall(name, _as_written(arguments)))
        return calls
