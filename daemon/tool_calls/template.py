"""A conversation with tools, as the model's chat template reads it.

A template that knows tools (it reads the `tools` variable, as transformers passes it)
gets them, and the history as transformers documents it: assistant messages with
`tool_calls` (arguments as objects) and `tool` messages with their `tool_call_id`. A
template that does not (SmolLM2's, plain ChatML) would drop all of that silently: it
gets llmd's own tool prompt instead, in the system message, and the history written
out as text in the format the parser reads back."""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from llmd.tool_calls.formats import ToolCallFormat
from llmd.tool_calls.tools import ToolChoice

# A message as chat templates read it: role, content, and tool_calls / tool_call_id / name.
Message = dict[str, Any]


@functools.lru_cache(maxsize=8)
def template_reads_tools(chat_template: str | None) -> bool:
    """Whether the template uses the `tools` variable at all."""
    if not chat_template:
        return False
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): look for the name
        return re.search(r"\btools\b", chat_template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def for_template(messages: list[Message], choice: ToolChoice | None, fmt: ToolCallFormat,
                 chat_template: str | None) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The messages and tools to render: as they are, for a template that reads tools;
    else with the tools described in the system message and calls and their results
    written as text. Without tools and tool turns the messages pass unchanged."""
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if template_reads_tools(chat_template):
        return messages, [t.as_openai() for t in choice.tools] if choice is not None else None
    if choice is None and not has_tool_turns:
        return messages, None
    written = [_as_text(m, fmt) for m in messages]
    if choice is not None:
        prompt = tool_prompt(choice, fmt)
        if written and written[0]["role"] == "system":
            written[0] = {"role": "system", "content": f"{written[0]['content']}\n\n{prompt}"}
        else:
            written.insert(0, {"role": "system", "content": prompt})
    return written, None


def tool_prompt(choice: ToolChoice, fmt: ToolCallFormat) -> str:
    """llmd's tool prompt: the functions' definitions and how to call one."""
    definitions = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in choice.tools)
    example = fmt.render_call("<function name>", {"<argument name>": "<value>"})
    return ("You may call functions to help with the user's request. The functions, as JSON schemas:\n"
            f"{definitions}\n"
            f"To call a function, reply with:\n{example}\n"
            "The results come back in <tool_response></tool_response> tags.")


def _as_text(message: Message, fmt: ToolCallFormat) -> Message:
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if calls:
        written = fmt.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        content = f"{content}\n{written}" if content else written
    return {"role": message["role"], "content": content}
