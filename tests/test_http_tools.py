"""Tool calling through the real daemon, with the clients nobody here wrote: the official
`openai` SDK (required, named, parallel or not, streamed and reassembled by the SDK's own
accumulator, `beta.chat.completions.parse`, a tool-result turn) and the `ollama`
package's types. The fixture's weights are random, so it never calls a tool by itself:
with `required` or a named function the grammar makes it, and every call must parse as
JSON valid for its schema (jsonschema). The prompt with tools equals transformers'
`apply_chat_template(..., tools=...)` on the same tokenizer."""
from __future__ import annotations

import json

import jsonschema
import ollama
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from daemon_util import Daemon
from http_clients import client, http, http_socket, ollama_client  # noqa: F401 (fixtures)
from llmd_tools.make_model import fixture_path
from tool_templates import HERMES, model_with_template


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
# Bounded values: a random model's call then ends well within max_tokens (an unbounded
# integer lets it write digits until the limit cuts the call short).
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
         for n, s in SCHEMAS.items()]


class Add(pydantic.BaseModel):
    a: int = pydantic.Field(ge=-999, le=999)
    b: int = pydantic.Field(ge=-999, le=999)


MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_with_template(fixture_path("tiny-llama"), tmp_path_factory.mktemp("hermes"), HERMES)


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    d = Daemon(str(model), tmp_path_factory.mktemp("tools") / "llmd.sock", "--served-model-name", "m",
               "--max-model-len", "1024", "--num-gpu-blocks-override", "256").wait_ready()
    d.http_sock = http_socket(d.sock)
    yield d
    assert d.stop() == 0, d.stderr()
    assert "Traceback" not in d.stderr()
    assert "secret_fn" not in d.stderr()


def check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_prompt_with_tools_is_transformers_rendering(client, model):
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = len(tokenizer(text, add_special_tokens=False).input_ids)
    reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert reply.usage.prompt_tokens == expected
    assert "get_weather" in text and expected > len(tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"])


@pytest.mark.parametrize("parallel", [False, None])
def test_required_makes_valid_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, seed=1, **extra)
    choice = reply.choices[0]
    check_calls(choice.message.tool_calls)
    if parallel is False:
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
        assert choice.message.content is None


def test_named_function_is_the_one_called(client):
    reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=80, seed=2,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    check_calls(reply.choices[0].message.tool_calls, names=("add",))
    assert reply.choices[0].finish_reason == "tool_calls"


def test_stream_reassembles_to_the_whole_reply(client):
    """The SDK's accumulator rebuilds the streamed calls: the same as the whole reply's
    under the same seed (ids apart)."""
    args = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, seed=3,
                temperature=0.8, n=2)
    whole = client.chat.completions.create(**args)
    with client.beta.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    for a, b in zip(whole.choices, streamed.choices, strict=True):
        assert (a.message.content or None) == (b.message.content or None)
        assert [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in b.message.tool_calls or []]
        assert a.finish_reason == b.finish_reason
        check_calls(b.message.tool_calls)


def test_parse_with_strict_tools(client):
    """`beta.chat.completions.parse` checks strict tools' arguments itself (parsed_arguments)."""
    strict = [openai.pydantic_function_tool(Add)]
    reply = client.beta.chat.completions.parse(model="m", messages=MESSAGES, tools=strict, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=300, seed=4)
    call = reply.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Add)


def test_a_tool_result_turn_continues_the_conversation(client, model):
    first = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, seed=5)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5, seed=6)
    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "sunny, 21 C"}]
    text = tokenizer.apply_chat_template(reference, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert second.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)


def test_auto_and_none_leave_a_random_model_to_text(client):
    auto = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=7)
    none = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, seed=7)
    for reply in (auto, none):
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "function", "function": {"parameters": ADD}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/secret_fn"}}}]},
     "tools", "cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "secret_fn"}}}, "tool_choice",
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format cannot be combined"),
    ({"messages": MESSAGES + [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": "m", "messages": MESSAGES, "max_tokens": 4, **body})
    assert info.value.body["param"] == param and words in info.value.message
    assert "secret_fn" not in info.value.message


def test_ollama_tool_calls_have_object_arguments(http, daemon):
    """Ollama's shape (arguments an object), read by the ollama package's own types;
    tool_choice is llmd's addition, since Ollama has no way to force a call."""
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": False,
            "options": {"num_predict": 120, "seed": 8}}
    reply = ollama.ChatResponse.model_validate(http.post("/api/chat", json=body).json())
    assert reply.message.tool_calls
    for call in reply.message.tool_calls:
        jsonschema.validate(dict(call.function.arguments), SCHEMAS[call.function.name])
    lines = http.post("/api/chat", json={**body, "stream": True}).text.splitlines()
    chunks = [ollama.ChatResponse.model_validate(json.loads(line)) for line in lines]
    streamed = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}, {"role": "tool", "content": "3",
                                                                         "tool_name": "add"}]
    client = ollama_client(daemon.http_sock)
    answer = client.chat(model="m", messages=history, tools=TOOLS, options={"num_predict": 4, "seed": 9})
    assert answer.done and answer.prompt_eval_count > 0 and answer.message.tool_calls is None


# -- the Responses API's function tools ------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"{n} tool", "parameters": s, "strict": False}
                   for n, s in SCHEMAS.items()]


def check_function_calls(items, names=tuple(SCHEMAS)):
    calls = [item for item in items if item.type == "function_call"]
    assert calls
    for call in calls:
        assert call.call_id.startswith("call_") and call.name in names and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("choice,names", [("required", tuple(SCHEMAS)), ({"type": "function", "name": "add"},
                                                                          ("add",))])
def test_responses_forced_calls_are_valid_function_call_items(client, choice, names):
    response = client.responses.create(model="m", input=MESSAGES, tools=RESPONSES_TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, max_output_tokens=120, extra_body={"seed": 10})
    assert response.status == "completed"
    [call] = check_function_calls(response.output, names)
    assert response.output == [call] and response.output_text == ""
    assert [t.name for t in response.tools] == list(SCHEMAS)


def test_responses_stream_calls_as_the_sdk_reassembles_them(client):
    """The streamed events (one output item per call, its arguments in one delta) rebuild,
    by the SDK's own accumulator, the whole response under the same seed (ids apart)."""
    args = dict(model="m", input=MESSAGES, tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=160,
                extra_body={"seed": 11}, temperature=0.8)
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert all(item.status == "in_progress" for item in added) and set(done) <= {item.id for item in added}
    with client.responses.stream(**args) as stream:
        final = stream.get_final_response()
    for response in (final, events[-1].response):
        assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output] == \
            [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output]
    assert {c.id: c.arguments for c in check_function_calls(events[-1].response.output)} == done


def test_responses_tool_turns_render_as_transformers_does(client, model):
    """function_call and function_call_output input items are the chat's assistant call
    and tool result: the prompt equals transformers' template over that conversation."""
    first = client.responses.create(model="m", input=MESSAGES, tools=RESPONSES_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": 12})
    [call] = check_function_calls(first.output)
    history = [*MESSAGES, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model="m", input=history, tools=RESPONSES_TOOLS, max_output_tokens=5, extra_body={"seed": 13})
    reference = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                              "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "sunny, 21 C"}]
    as_chat = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in RESPONSES_TOOLS]
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(reference, tools=as_chat, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert second.usage.input_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert second.output[0].type == "message"  # a random model left to `auto` writes text


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "secret_fn"}}, "tool_choice"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "add"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
])
def test_bad_responses_tool_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": "m", "input": "hi", "max_output_tokens": 4, **body})
    assert info.value.body["param"] == param and "secret_fn" not in info.value.message
