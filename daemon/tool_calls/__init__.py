"""Tool calling: a request's functions rendered by the model's chat template, the
model's calls read back in its family's format, and (when the request forces a call, or
the operator asks for it always) guided decoding that makes every call valid JSON for
its function's schema.

- tools.py: the request's tools and tool choice, checked (ToolChoice);
- formats.py: each family's call format (hermes, llama3_json, mistral): a scanner for
  its replies and the xgrammar structural tag that forces well-formed calls;
- parser.py: one reply's calls, whole or streamed, each checked against its schema;
- template.py: the conversation as the chat template reads it, with a tool prompt of
  llmd's own for templates that know no tools.
"""
from llmd.tool_calls.formats import FORMATS, ToolCallFormat, format_for
from llmd.tool_calls.parser import ParsedReply, ToolCall, ToolCallParser, new_call_id
from llmd.tool_calls.template import for_template, template_reads_tools
from llmd.tool_calls.tools import FunctionTool, ToolChoice, ToolError, parse_tools

__all__ = ["FORMATS", "FunctionTool", "ParsedReply", "ToolCall", "ToolCallFormat", "ToolCallParser", "ToolChoice",
           "ToolError", "for_template", "format_for", "new_call_id", "parse_tools", "template_reads_tools"]
