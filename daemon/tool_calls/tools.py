"""A request's tools and its tool choice, checked once at the door: OpenAI's
`{"type": "function", "function": {name, description, parameters, strict}}` list,
`tool_choice` (auto, none, required or one named function) and `parallel_tool_calls`.
Every problem is a ToolError naming the field (`tools[1].function.name`), never echoing
the client's value."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# OpenAI's rule for a function name: what every chat template and parser can carry.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128


class ToolError(ValueError):
    """A bad tool definition or choice; `param` is the API field it concerns."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object
    definition: dict[str, Any]  # the function as the client wrote it (its keys in its order)

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates read it: OpenAI's shape, as transformers passes it,
        with the client's own definition (a template may write it out as JSON)."""
        return {"type": "function", "function": self.definition}


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: `mode` auto (text or calls), required (at least one call)
    or named (calls of `tools[0]` only, the one named); `parallel`: more than one call."""

    tools: tuple[FunctionTool, ...]
    mode: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode != "auto"

    def tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)


def parse_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                *, choice_param: str = "tool_choice") -> ToolChoice | None:
    """The request's tools and choice; None when no tool may be called (no tools, or
    tool_choice "none"). `tool_choice` is OpenAI's: "auto", "none", "required" or
    {"type": "function", "function": {"name": ...}}."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError(choice_param, f"{choice_param} needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"tools must list at most {MAX_TOOLS} functions, got {len(tools)}")
    parsed = tuple(_function_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ToolError("tools", "tools must have distinct function names")
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice(parsed, "auto", parallel_tool_calls is not False)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolChoice(parsed, "required", parallel_tool_calls is not False)
    name = _named_choice(tool_choice, choice_param)
    chosen = next((t for t in parsed if t.name == name), None)
    if chosen is None:
        raise ToolError(choice_param, f"{choice_param} names a function that is not in tools")
    return ToolChoice((chosen,), "named", parallel_tool_calls is True)


def _named_choice(choice: Any, param: str) -> str:
    """The function name of {"type": "function", "function": {"name": ...}} (Chat
    Completions) or {"type": "function", "name": ...} (Responses)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if isinstance(name, str):
            return name
    raise ToolError(param, f'{param} must be "auto", "none", "required" or '
                           '{"type": "function", "function": {"name": ...}}')


def _function_tool(tool: Any, where: str) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError("tools", f'{where} must be {{"type": "function", "function": {{...}}}}; '
                                 "only function tools are supported")
    # Chat Completions nest the function; the Responses API and Ollama's flat form do not.
    function = tool["function"] if "function" in tool else tool
    if not isinstance(function, dict):
        raise ToolError("tools", f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError("tools", f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError("tools", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError("tools", f"{where}.function.parameters must be a JSON schema object")
    _check_schema(parameters, f"{where}.function.parameters")
    definition = {k: v for k, v in function.items() if k != "type"} if function is tool else function
    return FunctionTool(name, parameters, definition)


def _check_schema(schema: dict[str, Any], where: str) -> None:
    """A schema both jsonschema (which checks calls the model wrote freely) and xgrammar
    (which makes the model write them) accept."""
    import jsonschema
    import xgrammar as xgr

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise ToolError("tools", f"{where} is not a valid JSON schema (at {path or 'its top'})") from None
    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError, TypeError):  # xgrammar's message may quote the schema: not sent
        raise ToolError("tools", f"{where} cannot be compiled into a grammar (a $ref that does not resolve, "
                                 "or a keyword xgrammar does not support)") from None


def arguments_valid(tool: FunctionTool, arguments: Any) -> bool:
    """Whether `arguments` (decoded JSON) is an object that satisfies the tool's schema."""
    import jsonschema

    if not isinstance(arguments, dict):
        return False
    try:
        jsonschema.validators.validator_for(tool.parameters)(tool.parameters).validate(arguments)
    except jsonschema.ValidationError:
        return False
    return True
