"""Tool calls without a model: each family's parser reads back the calls its chat
template wrote into a conversation (transformers renders it), in one piece and streamed
in every split; malformed, invalid and cut-short calls stay text; the structural tag of
each format, driven token by token with random logits, only ever lets a model write
calls that jsonschema accepts; the format is picked from the template; bad tools are
refused naming the field."""
from __future__ import annotations

import json
import random

import jsonschema
import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from llmd.tool_calls import FORMATS, ToolCallParser, ToolError, format_for, for_template, parse_tools
from llmd_tools.make_model import fixture_path
from tool_templates import TEMPLATES, model_with_template, with_special_marker

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
CALLS = [("get_weather", {"city": "Zürich", "days": 3}), ("add", {"a": 1.5, "b": -2})]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = fixture_path("tiny-llama")
    return {name: AutoTokenizer.from_pretrained(model_with_template(base, tmp_path_factory.mktemp(name), template))
            for name, template in TEMPLATES.items()}


def choice(mode="auto", parallel=None):
    return parse_tools(TOOLS, mode, parallel)


def assistant_text(tokenizer, message) -> str:
    """What the template writes for an assistant turn: the conversation with it, less
    the conversation before it (and the turn's closing, which the model's stop token ends)."""
    history = [{"role": "user", "content": "Weather in Zürich, and 1.5 + -2?"}]
    before = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(history + [message], tools=TOOLS, tokenize=False)
    assert whole.startswith(before)
    return whole[len(before):].removesuffix("\n").removesuffix("<|im_end|>").removesuffix(tokenizer.eos_token)


def calls_message(calls, content=""):
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}


def streamed(fmt, text, chunks):
    """The parser fed `text` in pieces ending at `chunks`: the text and calls it gave out."""
    parser = ToolCallParser(FORMATS[fmt], choice())
    out, calls, start = [], [], 0
    for end in list(chunks) + [len(text)]:
        piece, new = parser.feed(text[start:end])
        out.append(piece)
        calls += new
        start = end
    tail, new = parser.finish()
    return "".join(out) + tail, calls + new


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_parser_reads_back_what_the_template_wrote(tokenizers, fmt):
    text = assistant_text(tokenizers[fmt], calls_message(CALLS))
    reply = ToolCallParser(FORMATS[fmt], choice()).parse(text)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == CALLS
    assert reply.content is None
    assert all(c.id.startswith("call_") for c in reply.tool_calls)
    assert len({c.id for c in reply.tool_calls}) == 2
    for call in reply.tool_calls:
        assert json.loads(call.arguments_json) == call.arguments
    rng = random.Random(fmt)
    for _ in range(40):  # streamed in arbitrary splits: the same, with no text given out
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        content, calls = streamed(fmt, text, cuts)
        assert content == "" and [(c.name, c.arguments) for c in calls] == CALLS
    assert streamed(fmt, text, range(1, len(text)))[0] == ""  # one character at a time


def test_hermes_text_around_calls_streams_the_same_as_whole(tokenizers):
    call = FORMATS["hermes"].render_call(*CALLS[0])
    text = f"  Let me look.\n{call}\nThen <tool_ and more\n{FORMATS['hermes'].render_call(*CALLS[1])}\n"
    whole = ToolCallParser(FORMATS["hermes"], choice()).parse(text)
    assert whole.content == "  Let me look.\n\nThen <tool_ and more"
    assert [(c.name, c.arguments) for c in whole.tool_calls] == CALLS
    for size in (1, 2, 3, 7, 11):
        content, calls = streamed("hermes", text, range(size, len(text), size))
        assert content == whole.content and [(c.name, c.arguments) for c in calls] == CALLS


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # not one of the tools
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}}\n</tool_call>',  # schema
    '<tool_call>\n{"name": "get_weather", "arguments": ["Oslo", 2]}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',  # cut short
])
def test_a_call_that_fails_its_check_stays_text(text):
    reply = ToolCallParser(FORMATS["hermes"], choice()).parse("Hi " + text)
    assert reply.tool_calls == [] and reply.content == "Hi " + text
    assert streamed("hermes", "Hi " + text, range(2, len(text), 5)) == ("Hi " + text, [])


def test_arguments_as_json_text_and_one_call_unless_parallel():
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    assert ToolCallParser(FORMATS["hermes"], choice()).parse(text).tool_calls[0].arguments == {"a": 1, "b": 2}
    two = text + "\n" + text
    assert len(ToolCallParser(FORMATS["hermes"], choice()).parse(two).tool_calls) == 2
    single = ToolCallParser(FORMATS["hermes"], choice(parallel=False)).parse(two)
    assert len(single.tool_calls) == 1 and single.content == "\n" + text  # the second call, as written


def test_llama_and_mistral_text_and_broken_bodies():
    llama = ToolCallParser(FORMATS["llama3_json"], choice())
    assert llama.parse('The answer is {"name": "add"}').tool_calls == []  # calls open the reply, or it is text
    tagged = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert ToolCallParser(FORMATS["llama3_json"], choice()).parse(tagged).tool_calls[0].name == "add"
    broken = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add"'
    assert ToolCallParser(FORMATS["llama3_json"], choice()).parse(broken).content == broken
    mistral = 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": 3}]'
    reply = ToolCallParser(FORMATS["mistral"], choice()).parse(mistral)
    assert reply.tool_calls == [] and reply.content == mistral
    assert streamed("mistral", "Plain [TOOL reply.", [8, 11]) == ("Plain [TOOL reply.", [])


def test_a_number_a_float_cannot_hold_is_written_back_as_json():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1e400, "b": 2}}\n</tool_call>'
    call = ToolCallParser(FORMATS["hermes"], choice()).parse(text).tool_calls[0]
    assert json.loads(call.arguments_json, parse_float=str) == {"a": "1e400", "b": 2}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("mode,parallel", [("required", True), ("required", False), ("add", None)])
def test_forced_calls_are_always_valid(tokenizers, fmt, mode, parallel):
    """The format's structural tag, with random logits picking each token: every reply
    is calls of the request's functions, valid for their schemas (jsonschema)."""
    import xgrammar as xgr

    from llmd.structured_output import parse_guided
    from llmd_client.protocol import GuidedDecodingParams

    tokenizer = tokenizers[fmt]
    tool_choice = {"type": "function", "function": {"name": mode}} if mode == "add" else mode
    request = parse_tools(TOOLS, tool_choice, parallel)
    spec = parse_guided(GuidedDecodingParams(structural_tag=FORMATS[fmt].structural_tag(request)))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(spec.grammar))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    generator = torch.Generator().manual_seed(len(fmt) + len(mode))
    ids = []
    while not matcher.is_terminated() and len(ids) < 400:
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.randn(info.vocab_size, generator=generator)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        ids.append(token)
    assert matcher.is_terminated(), "the random walk should end within 400 tokens"
    reply = ToolCallParser(FORMATS[fmt], request).parse(tokenizer.decode(ids[:-1], skip_special_tokens=False))
    assert reply.tool_calls and reply.content is None
    if parallel is False or mode == "add":
        assert len(reply.tool_calls) == 1
    schemas = {"get_weather": WEATHER, "add": ADD}
    for call in reply.tool_calls:
        assert mode != "add" or call.name == "add"
        jsonschema.validate(json.loads(call.arguments_json), schemas[call.name])


def test_format_is_read_from_the_template():
    assert format_for(None, TEMPLATES["hermes"]).name == "hermes"
    assert format_for(None, TEMPLATES["llama3_json"]).name == "llama3_json"
    assert format_for(None, TEMPLATES["mistral"]).name == "mistral"
    assert format_for(None, "{{ messages }}").name == "hermes"  # llmd's own tool prompt teaches hermes
    assert format_for(None, "{% if tools %}{{ tools }}{% endif %}", "MistralForCausalLM").name == "mistral"
    assert format_for("llama3_json", TEMPLATES["hermes"]).name == "llama3_json"  # the operator's setting wins


def test_a_template_without_tools_gets_the_tool_prompt_and_text_history():
    messages = [{"role": "user", "content": "hi"}, calls_message(CALLS[:1]),
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    rendered, tools = for_template(messages, choice(), FORMATS["hermes"], "{{ messages }}")
    assert tools is None and rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert ToolCallParser(FORMATS["hermes"], choice()).parse(rendered[2]["content"]).tool_calls[0].name == \
        "get_weather"
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    same, tools = for_template(messages, choice(), FORMATS["hermes"], TEMPLATES["hermes"])
    assert same is messages and [t["function"]["name"] for t in tools] == ["get_weather", "add"]


@pytest.mark.parametrize("tools,tool_choice,param,words", [
    ([{"type": "function", "function": {"parameters": ADD}}], "auto", "tools", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto", "tools", "tools[0].function.name"),
    ([{"type": "retrieval"}], "auto", "tools", "only function tools"),
    (TOOLS + [TOOLS[0]], "auto", "tools", "distinct"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "auto", "tools",
     "tools[0].function.parameters is not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/(unclosed"}}}}}], "auto", "tools",
     "tools[0].function.parameters cannot be compiled"),
    (TOOLS, {"type": "function", "function": {"name": "secret_fn"}}, "tool_choice", "not in tools"),
    (TOOLS, "sometimes", "tool_choice", "tool_choice must be"),
    (None, "required", "tool_choice", "needs tools"),
])
def test_bad_tools_name_the_field_and_not_the_value(tools, tool_choice, param, words):
    with pytest.raises(ToolError) as info:
        parse_tools(tools, tool_choice, None)
    assert info.value.param == param and words in str(info.value)
    assert "secret_fn" not in str(info.value) and "(unclosed" not in str(info.value)


def test_llm_chat_renders_tools_as_transformers_does(tmp_path):
    from llmd import LLM, SamplingParams

    model = model_with_template(fixture_path("tiny-llama"), tmp_path / "model", TEMPLATES["hermes"])
    llm = LLM(model=str(model), device="cpu", max_model_len=1024, num_gpu_blocks_override=128)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0), tools=TOOLS)[0]
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert out.prompt == tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                       add_generation_prompt=True)
    plain = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0))[0]
    assert "get_weather" not in plain.prompt
    with pytest.raises(ToolError, match=r"tools\[0\]\.function\.name"):
        llm.chat(messages, tools=[{"type": "function", "function": {}}])


def test_tool_settings_from_the_config_file_and_command_line(tmp_path):
    from llmd.daemon_config import load_settings

    config = tmp_path / "llmd.toml"
    config.write_text('tool_call_parser = "mistral"\nguided_tool_calls = "always"\n')
    daemon, _ = load_settings(str(config), {})
    assert (daemon.tool_call_parser, daemon.guided_tool_calls) == ("mistral", "always")
    daemon, _ = load_settings(str(config), {"tool_call_parser": "hermes"})
    assert daemon.tool_call_parser == "hermes"
    assert load_settings(None, {})[0].tool_call_parser is None  # read from the template
    config.write_text('tool_call_parser = "pythonic"\n')
    with pytest.raises(ValueError, match="tool_call_parser"):
        load_settings(str(config), {})


def test_a_special_marker_token_reaches_the_parser(tmp_path):
    """Mistral's [TOOL_CALLS] as a special token: a reply that may call tools keeps the
    special tokens' text, the EOS that ends it is not text, and the parser reads the call
    back (transformers' decode is the reference); the plain fixture keeps the default."""
    from llmd.detokenizer.output_processor import OutputProcessor
    from llmd.core.scheduler import RequestUpdate
    from llmd.http.chat_tools import ChatTools
    from llmd.http.context import ServedModel
    from llmd_client.protocol import SamplingParams

    def served(folder):
        return ServedModel(names=("m",), created=0, max_model_len=256, tokenizer=AutoTokenizer.from_pretrained(folder),
                           architecture="llama", num_params=1, dtype="float32", size_bytes=1, digest="sha256:0",
                           tool_format=FORMATS["mistral"])

    plain = served(model_with_template(fixture_path("tiny-llama"), tmp_path / "plain", TEMPLATES["mistral"]))
    special = served(with_special_marker(model_with_template(fixture_path("tiny-llama"), tmp_path / "special",
                                                              TEMPLATES["mistral"])))
    request = choice("auto")
    messages = [{"role": "user", "content": "1 + 2?"}]
    assert ChatTools(request, plain).submit_fields(messages, SamplingParams())["sampling"].skip_special_tokens
    assert ChatTools(None, special).submit_fields(messages, SamplingParams())["sampling"].skip_special_tokens
    params = ChatTools(request, special).submit_fields(messages, SamplingParams())["sampling"]
    assert not params.skip_special_tokens

    tokenizer = special.tokenizer
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    body = tokenizer('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', add_special_tokens=False).input_ids
    ids = [marker, *body, tokenizer.eos_token_id]
    texts = {}
    for skip in (True, False):
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, [1, 2], msgspec.structs.replace(params, skip_special_tokens=skip), ["r"])
        [out], _ = processor.process([RequestUpdate("r", ids, finish_reason="stop")], {})
        assert out.outputs[0].token_ids == ids
        texts[skip] = out.outputs[0].text
    assert texts[False] == tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert texts[True] == tokenizer.decode(ids, skip_special_tokens=True)
    reply = ToolCallParser(FORMATS["mistral"], request).parse(texts[False])
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("add", {"a": 1, "b": 2})] and reply.content is None
    assert not ToolCallParser(FORMATS["mistral"], request).parse(texts[True]).tool_calls
