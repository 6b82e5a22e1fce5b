"""How each model family writes a tool call, read and forced:

- `hermes` (Hermes 2 Pro, Qwen 2.5/3, SmolLM): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, anywhere in the text, once per call;
- `llama3_json` (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`;
- `mistral` (Mistral v0.3 and later instruct models): `[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]` after any text, to the end of the reply.

Each format has a scanner that splits the model's text, as it streams in, into text and
call segments, and a structural tag (xgrammar 0.2.8) that makes the model write calls of
the request's functions whose arguments satisfy their schemas.
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import Any

from llmd.structured_output.spec import lengths_as_patterns
from llmd.tool_calls.tools import ToolChoice

# A raw call as the model wrote it: the name and the arguments object (decoded JSON).
RawCall = tuple[Any, Any]
# What a scanner makes of text: ("text", text) or ("calls", [RawCall...] or None, raw text).
Piece = tuple


class Scanner(ABC):
    """Splits a reply into pieces as its text arrives: `scan(buffer, final)` returns
    the pieces at the start of `buffer` that are settled, and how many characters they
    took; the rest waits for more text (or `final`, the reply's end)."""

    @abstractmethod
    def scan(self, buffer: str, final: bool) -> tuple[list[Piece], int]:
        """The settled pieces at the start of `buffer`, and the characters they took."""


class ToolCallFormat(ABC):
    name = ""
    # Whether the format writes its calls at the start of the reply only.
    calls_first = False
    # The strings that mark calls: a tokenizer may hold one as a special token, whose text
    # the reply must then keep (skip_special_tokens off) for the scanner to see it.
    markers: tuple[str, ...] = ()

    @abstractmethod
    def scanner(self) -> Scanner:
        """A scanner for one reply (it keeps state across the reply's chunks)."""

    @abstractmethod
    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it (for a history the template cannot render)."""

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(self.render_call(name, arguments) for name, arguments in calls)

    @abstractmethod
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """The structural tag of one call of `name`."""

    def structural_tag(self, choice: ToolChoice) -> dict[str, Any]:
        """The structural tag for a request: with `required` or a named function only
        calls (at least one; one at most unless parallel), else free text in which every
        call is well formed."""
        tags = [self.call_tag(t.name, lengths_as_patterns(t.parameters)) for t in choice.tools]
        return {"type": "structural_tag", "format": self.calls_format(tags, choice)}

    @abstractmethod
    def calls_format(self, tags: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
        """The structural tag's format around the calls' tags, as `choice` asks."""


def _json_call(name: str, key: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


class ExactNumber(float):
    """A JSON number a float cannot hold (`1e400`, valid JSON that a grammar allows): a
    float (infinite) to schema checks, its text as written when it is sent back (as a
    float it would be written `Infinity`, which is not JSON)."""

    text: str

    def __new__(cls, text: str) -> ExactNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number


def _exact_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else ExactNumber(text)


_DECODER = json.JSONDecoder(parse_float=_exact_float)


def _json_tag(name: str, key: str, schema: dict[str, Any], before: str = "", after: str = "") -> dict[str, Any]:
    """The structural tag of a call written {"name": name, key: arguments}."""
    return {"type": "tag", "begin": f'{before}{{"name": {json.dumps(name)}, "{key}": ',
            "content": _arguments(schema), "end": "}" + after}


def _arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """The arguments object of a call: JSON for its schema, compact. The structural
    tag's own JSON format lets whitespace run between tokens (a random or unsure model
    pads with it until max_tokens), so the schema goes in as xgrammar's compact grammar."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return {"type": "grammar", "grammar": str(grammar)}


def _decode_arguments(value: Any) -> Any:
    """Arguments as an object; some models write them as a JSON string."""
    if isinstance(value, str):
        try:
            return _DECODER.decode(value)
        except json.JSONDecodeError:
            return None
    return value


def _call_of(obj: Any, keys: tuple[str, ...]) -> RawCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in keys if k in obj), None)
    return (obj["name"], _decode_arguments(obj[key]) if key is not None else {})


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# -- hermes --------------------------------------------------------------------------------

class HermesScanner(Scanner):
    BEGIN, END = "<tool_call>", "</tool_call>"

    def scan(self, buffer: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        while True:
            start = buffer.find(self.BEGIN, pos)
            if start < 0:
                end = len(buffer) - (0 if final else _partial_marker(buffer[pos:], self.BEGIN))
                if end > pos:
                    pieces.append(("text", buffer[pos:end]))
                return pieces, max(end, pos)
            if start > pos:
                pieces.append(("text", buffer[pos:start]))
            stop = buffer.find(self.END, start + len(self.BEGIN))
            if stop < 0:
                if final:  # a call cut short: it stays text
                    pieces.append(("text", buffer[start:]))
                    return pieces, len(buffer)
                return pieces, start
            body = buffer[start + len(self.BEGIN):stop]
            raw = buffer[start:stop + len(self.END)]
            try:
                call = _call_of(_DECODER.decode(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            pieces.append(("calls", [call] if call is not None else None, raw))
            pos = stop + len(self.END)


class Hermes(ToolCallFormat):
    name = "hermes"
    markers = (HermesScanner.BEGIN, HermesScanner.END)

    def scanner(self) -> Scanner:
        return HermesScanner()

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<tool_call>\n{_json_call(name, 'arguments', arguments)}\n</tool_call>"

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return _json_tag(name, "arguments", schema, "<tool_call>\n", "\n</tool_call>")

    def calls_format(self, tags: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
        if choice.forced:
            return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                    "stop_after_first": not choice.parallel}
        return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                "stop_after_first": not choice.parallel}


# -- llama3_json ---------------------------------------------------------------------------

class Llama3Scanner(Scanner):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.mode: str | None = None  # "text" or "calls" once the reply's start decides it

    def scan(self, buffer: str, final: bool) -> tuple[list[Piece], int]:
        if self.mode is None:
            head = buffer.lstrip()
            if head.startswith(("{", self.PYTHON_TAG)):
                self.mode = "calls"
            elif not final and (not head or self.PYTHON_TAG.startswith(head)):
                return [], 0
            else:
                self.mode = "text"
        if self.mode == "text":
            return ([("text", buffer)] if buffer else []), len(buffer)
        if not final:
            return [], 0
        return [("calls", self._calls(buffer.strip().removeprefix(self.PYTHON_TAG)), buffer)], len(buffer)

    @staticmethod
    def _calls(body: str) -> list[RawCall] | None:
        """Objects separated by `;` (or whitespace); None unless all of it is calls."""
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                return None
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return calls or None


class Llama3Json(ToolCallFormat):
    name = "llama3_json"
    calls_first = True
    markers = (Llama3Scanner.PYTHON_TAG,)

    def scanner(self) -> Scanner:
        return Llama3Scanner()

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return _json_call(name, "parameters", arguments)

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(self.render_call(name, arguments) for name, arguments in calls)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return _json_tag(name, "parameters", schema)

    def calls_format(self, tags: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True,
                 "stop_after_first": not choice.parallel}
        if choice.forced:
            return calls
        # Calls open the reply, or it is text that does not open like one.
        text = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[^{\s]"}, {"type": "any_text"}]}
        return {"type": "or", "elements": [calls, text]}


# -- mistral -------------------------------------------------------------------------------

class MistralScanner(Scanner):
    MARKER = "[TOOL_CALLS]"

    def scan(self, buffer: str, final: bool) -> tuple[list[Piece], int]:
        start = buffer.find(self.MARKER)
        if start < 0:
            end = len(buffer) - (0 if final else _partial_marker(buffer, self.MARKER))
            return ([("text", buffer[:end])] if end else []), end
        pieces: list[Piece] = [("text", buffer[:start])] if start else []
        if not final:
            return pieces, start
        return pieces + [("calls", self._calls(buffer[start + len(self.MARKER):]), buffer[start:])], len(buffer)

    @staticmethod
    def _calls(body: str) -> list[RawCall] | None:
        try:
            value = _DECODER.decode(body)
        except json.JSONDecodeError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_call_of(item, ("arguments", "parameters")) for item in items]
        return calls if calls and all(c is not None for c in calls) else None


class Mistral(ToolCallFormat):
    name = "mistral"
    markers = (MistralScanner.MARKER,)

    def scanner(self) -> Scanner:
        return MistralScanner()

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return _json_tag(name, "arguments", schema)

    def calls_format(self, tags: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not choice.parallel}
        if choice.forced:
            return {"type": "sequence", "elements": [{"type": "const_string", "value": "[TOOL_CALLS]["}, calls,
                                                     {"type": "const_string", "value": "]"}]}
        return {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "stop_after_first": True,
                "tags": [{"type": "tag", "begin": "[TOOL_CALLS][", "content": calls, "end": "]"}]}


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}


def format_for(setting: str | None, chat_template: str | None, architecture: str = "") -> ToolCallFormat:
    """The tool call format: the operator's `tool_call_parser`, else the one the chat
    template writes (its call markers), else the architecture's family, else hermes
    (what llmd's own tool prompt teaches a template that knows no tools)."""
    if setting:
        return FORMATS[setting]
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FORMATS["llama3_json"]
    if "tools" in template:
        family = architecture.lower()
        if family.startswith(("mistral", "mixtral")):
            return FORMATS["mistral"]
        if family.startswith("llama"):
            return FORMATS["llama3_json"]
    return FORMATS["hermes"]
