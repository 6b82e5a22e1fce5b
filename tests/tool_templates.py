"""Chat templates that know tools, one per call format, written for the tests in the
shape of their families' templates (ChatML with Hermes `<tool_call>` tags; Llama 3.1's
JSON calls with the `ipython` role; Mistral's `[TOOL_CALLS]` list), a model folder that
serves the tiny-llama fixture's weights under one of them, and one whose tokenizer
holds `[TOOL_CALLS]` as a special token."""
from __future__ import annotations

import json
from pathlib import Path

HERMES = """{{- bos_token -}}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
<|im_start|>system
{% if system %}{{ system }}

{% endif %}# Tools
You may call one or more functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, reply with a JSON object in <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- elif message.role == 'assistant' and message.tool_calls -%}
<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif -%}
{%- for call in message.tool_calls -%}
{%- if not loop.first %}
{% endif -%}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

LLAMA3_JSON = """{{- bos_token -}}
<|im_start|>system
{% if tools %}Environment: ipython
Answer with a function call as JSON: {"name": function name, "parameters": arguments object}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}<|im_end|>
{% for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
<|im_start|>assistant
{% for call in message.tool_calls %}{% if not loop.first %}; {% endif -%}
{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>ipython
{{ message.content }}<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

MISTRAL = """{{- bos_token -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endfor -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls -%}
[TOOL_CALLS][{% for call in message.tool_calls %}{% if not loop.first %}, {% endif -%}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' -%}
[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' -%}
{{ message.content }}{{ eos_token }}
{%- else -%}
[INST]{{ message.content }}[/INST]
{%- endif -%}
{%- endfor -%}
"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL}


def model_with_template(fixture: Path, out: Path, template: str) -> Path:
    """`fixture`'s files linked into `out`, its chat template replaced by `template`."""
    out.mkdir(parents=True, exist_ok=True)
    for file in fixture.iterdir():
        if file.name != "chat_template.jinja":
            (out / file.name).symlink_to(file)
    (out / "chat_template.jinja").write_text(template)
    return out


def with_special_marker(folder: Path) -> Path:
    """The fixture's tokenizer with its <|pad|> token renamed [TOOL_CALLS]: a special
    token, as in Mistral's own tokenizers."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    path.unlink()  # a link to the shared fixture's file
    for token in data["added_tokens"]:
        if token["content"] == "<|pad|>":
            token["content"] = "[TOOL_CALLS]"
    vocab = data["model"]["vocab"]
    if "<|pad|>" in vocab:
        vocab["[TOOL_CALLS]"] = vocab.pop("<|pad|>")
    path.write_text(json.dumps(data))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            text = (folder / name).read_text().replace("<|pad|>", "[TOOL_CALLS]")
            (folder / name).unlink()
            (folder / name).write_text(text)
    return folder
