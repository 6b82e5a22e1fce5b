"""What clients probe and rely on beyond generation (issue 28), against the real daemon
with the clients nobody here wrote: the official `openai` package (models by id and by
alias, the Responses API whole and streamed, echo with max_tokens 0) and the `ollama`
package (durations, quantization level, num_ctx, keep_alive), plus vLLM's /tokenize and
/detokenize over plain HTTP. References are independent: transformers' tokenizer and
chat template, /v1/completions on the same token ids, the safetensors header."""
from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import ollama
import openai
import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from daemon_util import Daemon
from http_clients import client, http, http_socket, olla  # noqa: F401 (fixtures)
from llmd_tools.make_model import fixture_path


ALIASES = ("alias-one", "org/alias-two")
MAX_MODEL_LEN = 256
INSTRUCTIONS = "You answer briefly."
QUESTION = "def fibonacci(n):"


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-llama"))


@pytest.fixture(scope="module")
def name(model) -> str:
    return Path(model).name


@pytest.fixture(scope="module")
def daemon(model, name, tmp_path_factory):
    """Served under its file name (listed) and two aliases, given both ways the CLI takes them."""
    d = Daemon(model, tmp_path_factory.mktemp("probes") / "llmd.sock", "--served-model-name",
               f"{name},{ALIASES[0]}", "--served-model-name", ALIASES[1]).wait_ready()
    d.http_sock = http_socket(d.sock)
    yield d
    assert d.stop() == 0, d.stderr()
    assert "Traceback" not in d.stderr()


@pytest.fixture(scope="module")
def hf_tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


def chat_ids(hf_tokenizer, messages, **template) -> list[int]:
    """transformers' rendering of a chat: its template, then its tokenizer (the template writes BOS)."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **template)
    return hf_tokenizer(text, add_special_tokens=False).input_ids


# -- models and their names --------------------------------------------------------------

def test_models_by_id_and_alias(client, olla, name):
    assert [m.id for m in client.models.list().data] == [name]
    for model_id in (name, *ALIASES):
        card = client.models.retrieve(model_id)
        assert card.id == model_id and card.object == "model" and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o/secret")
    assert info.value.body["param"] == "model" and "secret" not in info.value.message
    texts = {client.completions.create(model=m, prompt=QUESTION, max_tokens=6, temperature=0).choices[0].text
             for m in (name, *ALIASES)}
    assert len(texts) == 1  # one model, whatever it is called
    assert olla.show(f"{ALIASES[0]}:latest").details.family == "llama"
    assert [m.model for m in olla.list().models] == [f"{name}:latest"]
    with pytest.raises(ollama.ResponseError) as missing:
        olla.generate(model="llama3:8b", prompt="hi")
    assert missing.value.status_code == 404


def test_served_model_name_from_the_config_file(tmp_path):
    from llmd.daemon_config import load_settings

    config = tmp_path / "llmd.toml"
    config.write_text('served_model_name = ["first", "second"]\n')
    assert load_settings(str(config), {})[0].served_names(("file",)) == ("first", "second")
    assert load_settings(str(config), {"served_model_name": ["cli"]})[0].served_names(("file",)) == ("cli",)
    config.write_text('served_model_name = "only"\n')
    assert load_settings(str(config), {})[0].served_names(("file",)) == ("only",)
    assert load_settings(None, {})[0].served_names(("file",)) == ("file",)
    for bad in ('["a", "a"]', '[""]', '[" a"]'):
        config.write_text(f"served_model_name = {bad}\n")
        with pytest.raises(ValueError, match="served_model_name"):
            load_settings(str(config), {})


# -- vLLM's /tokenize and /detokenize --------------------------------------------------------

def test_tokenize_and_detokenize_match_transformers(http, hf_tokenizer, name):
    text = "The quick brown fox, naïvely: 1 + 1 = 2"
    reply = http.post("/tokenize", json={"model": ALIASES[1], "prompt": text, "return_token_strs": True}).json()
    expected = hf_tokenizer(text).input_ids
    assert reply == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected,
                     "token_strs": hf_tokenizer.convert_ids_to_tokens(expected)}
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids and bare["token_strs"] is None

    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = http.post("/tokenize", json={"model": name, "messages": messages}).json()
    assert chat["tokens"] == chat_ids(hf_tokenizer, messages, add_generation_prompt=True)
    open_turn = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert open_turn["tokens"] == chat_ids(hf_tokenizer, messages, add_generation_prompt=False)
    assert open_turn["count"] < chat["count"]

    detok = http.post("/detokenize", json={"model": name, "tokens": expected}).json()
    assert detok == {"prompt": hf_tokenizer.decode(expected)}


def test_tokenize_errors_name_the_field(http, hf_tokenizer):
    vocab = len(hf_tokenizer)
    cases = [("/detokenize", {"tokens": [1, vocab]}, 400, "tokens"),
             ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
             ("/detokenize", {"tokens": "12"}, 400, "tokens"),
             ("/tokenize", {}, 400, "prompt"),
             ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
             ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, 400, "messages"),
             ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": True,
                            "continue_final_message": True}, 400, "messages"),
             ("/tokenize", {"model": "secret-name", "prompt": "a"}, 404, "model")]
    for path, body, status, param in cases:
        reply = http.post(path, json=body)
        assert reply.status_code == status, (body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and "secret" not in error["message"], (body, error)


# -- /v1/responses -------------------------------------------------------------------------

def test_responses_equal_a_completion_of_the_same_tokens(client, http, name):
    """The Responses API's text is the completion of the chat's tokens (as /tokenize
    renders them) with the same sampling; its usage counts those tokens."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    reference = client.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0, top_p=0.9)
    ref = reference.choices[0]
    response = client.responses.create(model=ALIASES[0], instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=12, temperature=0, top_p=0.9)
    assert response.object == "response" and response.model == name
    assert response.output_text == ref.text
    assert response.usage.input_tokens == len(ids) and response.usage.output_tokens == reference.usage.completion_tokens
    assert response.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    if ref.finish_reason == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.temperature == 0 and response.top_p == 0.9 and response.instructions == INSTRUCTIONS

    history = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
               {"role": "developer", "content": "Be kind."}, {"role": "user", "content": QUESTION}]
    as_chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "system", "content": "Be kind."}, {"role": "user", "content": QUESTION}]
    ids = http.post("/tokenize", json={"messages": as_chat}).json()["tokens"]
    expected = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0).choices[0].text
    assert client.responses.create(model=name, input=history, max_output_tokens=8,
                                   temperature=0).output_text == expected


def test_responses_stream_the_official_events(client, name):
    kwargs = dict(model=name, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text and events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The SDK's own accumulator follows the events to the same response.
    with client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_responses_refuse_what_they_cannot_honour(client, name):
    cases = [(dict(tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]), "tools"),
             (dict(tool_choice="required"), "tool_choice"),
             (dict(previous_response_id="resp_123"), "previous_response_id"),
             (dict(input=[]), "input"),
             (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input"),
             (dict(max_output_tokens=MAX_MODEL_LEN), "max_output_tokens"),
             (dict(temperature=-1), "temperature"),
             (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**{"model": name, "input": "hi", **kwargs})
        assert info.value.body["param"] == param, (kwargs, info.value.body)


# -- echo with max_tokens 0 ------------------------------------------------------------------

def test_echo_with_max_tokens_zero_scores_the_prompt(client, name, hf_tokenizer):
    """lm-evaluation-harness's loglikelihood request: the prompt back with its logprobs,
    equal to a normal echo request's prompt positions, and nothing generated."""
    prompt = "def add(a, b):\n    return a + b"
    scored = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    normal = client.completions.create(model=name, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    n = len(hf_tokenizer(prompt).input_ids)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(lp.tokens) == n and lp.tokens == normal.choices[0].logprobs.tokens[:n]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs == pytest.approx(normal.choices[0].logprobs.token_logprobs[:n], abs=1e-6)
    assert lp.text_offset == normal.choices[0].logprobs.text_offset[:n]
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    ids = hf_tokenizer(prompt).input_ids  # lm-eval sends token ids
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)
    streamed = list(client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == prompt
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=prompt, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


# -- Ollama ----------------------------------------------------------------------------------

def test_ollama_durations_are_measured_in_every_path(olla, name):
    opts = {"temperature": 0, "num_predict": 8}
    for call in (lambda: olla.generate(model=name, prompt=QUESTION, options=opts),
                 lambda: olla.chat(model=name, messages=[{"role": "user", "content": QUESTION}], options=opts),
                 lambda: list(olla.generate(model=name, prompt=QUESTION, options=opts, stream=True))[-1],
                 lambda: list(olla.chat(model=name, messages=[{"role": "user", "content": "hi"}], options=opts,
                                        stream=True))[-1]):
        started = time.monotonic_ns()
        final = call()
        elapsed = time.monotonic_ns() - started
        assert final.done and final.eval_count > 0 and final.prompt_eval_count > 0
        assert final.eval_duration > 0 and final.prompt_eval_duration > 0
        assert final.prompt_eval_duration + final.eval_duration <= final.total_duration <= elapsed


def test_ollama_quantization_level_is_the_files(olla, model, name):
    with safe_open(str(Path(model) / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}  # the fixture's file: every tensor float32
    assert olla.show(name).details.quantization_level == "F32"
    assert olla.list().models[0].details.quantization_level == "F32"


def test_ollama_num_ctx_bounds_the_request(olla, name, hf_tokenizer):
    prompt = "import os\nimport sys\n"
    free = olla.generate(model=name, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 20})
    n_prompt = free.prompt_eval_count
    assert n_prompt == len(hf_tokenizer(prompt).input_ids) and free.eval_count > 4  # room to cut it short
    narrow = olla.generate(model=name, prompt=prompt, raw=True,
                           options={"temperature": 0, "num_predict": 20, "num_ctx": n_prompt + 4})
    assert narrow.eval_count == 4 and narrow.done_reason == "length" and free.response.startswith(narrow.response)
    for num_ctx in (MAX_MODEL_LEN + 1, 0, n_prompt):  # beyond the engine's, none, no room to generate
        with pytest.raises(ollama.ResponseError) as info:
            olla.generate(model=name, prompt=prompt, raw=True, options={"num_ctx": num_ctx})
        assert info.value.status_code == 400 and "num_ctx" in info.value.error


def test_ollama_keep_alive_is_reported(olla, name):
    def expires() -> datetime:
        return olla.ps().models[0].expires_at

    olla.generate(model=name, prompt="hi", options={"num_predict": 2}, keep_alive="10m")
    assert abs(expires() - (datetime.now(timezone.utc) + timedelta(minutes=10))) < timedelta(seconds=30)
    olla.chat(model=name, messages=[], keep_alive=90)  # a load request, seconds as a number
    assert abs(expires() - (datetime.now(timezone.utc) + timedelta(seconds=90))) < timedelta(seconds=30)
    olla.generate(model=name, prompt="hi", options={"num_predict": 2}, keep_alive=-1)
    assert expires().year == 9999
    olla.generate(model=name, prompt="hi", options={"num_predict": 2}, keep_alive="2h")
    olla.generate(model=name, prompt="hi", options={"num_predict": 2})  # none: llmd's default, kept loaded
    assert expires().year == 9999
    with pytest.raises(ollama.ResponseError) as info:
        olla.generate(model=name, prompt="hi", keep_alive="soon-ish")
    assert info.value.status_code == 400 and "keep_alive" in info.value.error and "soon" not in info.value.error


def test_go_durations_as_ollama_reads_them():
    from llmd.http.errors import ApiError
    from llmd.http.keep_alive import FOREVER, parse_keep_alive

    # Go's time.ParseDuration documentation's examples, and Ollama's number-of-seconds form.
    expected = {"300ms": 0.3, "1.5h": 5400.0, "2h45m": 9900.0, "1h15m30.5s": 4530.5, "0": 0.0, "5m": 300.0,
                "+5s": 5.0, "-1.5h": FOREVER, "-1": FOREVER, 3600: 3600.0, 0.5: 0.5, -1: FOREVER, "10": 10.0,
                "1us": 1e-6, "2562048h": FOREVER}
    for value, seconds in expected.items():
        assert parse_keep_alive(value) == pytest.approx(seconds), value
    for bad in ("", "1d", "m", "--5s", "5m x", "1e3s", True):
        with pytest.raises(ApiError):
            parse_keep_alive(bad)


def test_json_body_of_a_probe_is_not_echoed_into_the_log(daemon, http):
    secret = "zebra-canary-7431"
    http.post("/tokenize", json={"prompt": 5, "model": secret})
    http.post("/detokenize", content=json.dumps({"tokens": [secret]}), headers={"Content-Type": "application/json"})
    http.post("/v1/responses", json={"model": secret, "input": secret})
    assert secret not in daemon.stderr()
