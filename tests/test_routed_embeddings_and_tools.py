"""Embeddings and tool calls on a model the request names (issues 28 and 29 together), end
to end. The daemon's default model ("chat": tiny-llama under a Hermes tool template)
generates; `[models.embedder]` (tiny-qwen2, `task = "embed"`, MEAN pooling, Matryoshka
size 16) is loaded by its first embedding request, on the socket or over HTTP, and its
vectors equal the offline engine's (`LLM.embed`) on that model alone and transformers'
mean-pooled final hidden states; each model pools its own way. Ollama's /api/embed with
no input loads a model and keep_alive 0 unloads it after the reply; the embedding model
refuses generation by name and Ollama's /api/show reports its capability, loaded or not.
`[models.mistral]` (the same weights under a Mistral template, its tokenizer holding
`[TOOL_CALLS]` as a special token) writes forced calls in its own format on
/v1/chat/completions and /v1/responses while the default writes Hermes tags."""
from __future__ import annotations

import json
import time

import jsonschema
import ollama
import openai
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from daemon_util import Daemon, RawConn
from hf_ref import hf_model
from http_clients import http_socket, ollama_client, openai_client
from llmd import LLM
from llmd_client import Client, RequestError
from llmd_client.llmctl import cli as llmctl
from llmd_tools.make_model import fixture_path
from tool_templates import HERMES, MISTRAL, model_with_template, with_special_marker

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 4, "def fib(n): return n"]
MIN_COSINE = 0.9999
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "1 + 2?"}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    llama = fixture_path("tiny-llama")
    return {"chat": str(model_with_template(llama, base / "hermes", HERMES)),
            "embedder": str(fixture_path("tiny-qwen2")),
            "mistral": str(with_special_marker(model_with_template(llama, base / "mistral", MISTRAL)))}


@pytest.fixture(scope="module")
def daemon(paths, tmp_path_factory):
    base = tmp_path_factory.mktemp("routed")
    config = base / "llmd.toml"
    config.write_text(f"""
served_model_name = ["chat"]

[models.embedder]
path = "{paths['embedder']}"
aliases = ["emb"]
task = "embed"
pooling_type = "MEAN"
matryoshka_dimensions = [16]
max_model_len = 256

[models.mistral]
path = "{paths['mistral']}"
tool_call_parser = "mistral"
""")
    d = Daemon(paths["chat"], base / "s.sock", "--config", str(config), "--max-model-len", "1024",
               "--num-gpu-blocks-override", "256").wait_ready()
    d.http_sock = http_socket(d.sock)
    yield d
    assert d.stop() == 0, d.stderr()
    assert "Traceback" not in d.stderr()


def state(d: Daemon, name: str) -> dict:
    with RawConn(d.sock) as conn:
        conn.send({"type": "models"})
        return next(m for m in conn.recv()["models"] if m["name"] == name)


def wait_state(d: Daemon, name: str, wanted: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while (model := state(d, name))["state"] != wanted:
        assert time.monotonic() < deadline, f"{name} never became {wanted}: {model}"
        time.sleep(0.05)
    return model


@torch.inference_mode()
def hf_pooled(path: str, text: str, kind: str, dimensions: int | None = None) -> torch.Tensor:
    """transformers' final hidden states of `text`, pooled (MEAN or LAST), cut, normalized."""
    model, tokenizer = hf_model(path)
    hidden = model.model(torch.tensor([tokenizer(text).input_ids])).last_hidden_state[0].float()
    vector = hidden.mean(dim=0) if kind == "MEAN" else hidden[-1]
    return F.normalize(vector[:dimensions] if dimensions else vector, dim=-1)


def assert_close(got, expected: torch.Tensor, what: str, min_cosine: float = MIN_COSINE) -> None:
    got_t = torch.tensor(list(got), dtype=torch.float32)
    assert got_t.shape == expected.shape, f"{what}: {got_t.shape} != {expected.shape}"
    cosine = F.cosine_similarity(got_t, expected.float(), dim=0).item()
    assert cosine >= min_cosine, f"{what}: cosine {cosine}"


# -- embeddings on the model a request names ----------------------------------------------------

def test_embeddings_load_the_second_model_and_equal_the_offline_engine(daemon, paths):
    assert state(daemon, "embedder")["state"] == "unloaded"
    llm = LLM(model=paths["embedder"], task="embed", pooling_type="MEAN", matryoshka_dimensions=[16],
              max_model_len=256, num_gpu_blocks_override=128)
    offline = [torch.tensor(o.outputs.embedding) for o in llm.embed(TEXTS)]
    llm.engine.shutdown()
    del llm
    with Client(daemon.sock) as client:
        routed = client.embed(TEXTS, model="embedder")  # its first request: it loads meanwhile
        default = client.embed(TEXTS[0])  # the default model pools its own way (LAST)
    assert state(daemon, "embedder")["state"] == "serving"
    for text, result, expected in zip(TEXTS, routed, offline):
        assert torch.allclose(torch.tensor(result.embedding), expected, atol=2e-5), text
        assert_close(result.embedding, hf_pooled(paths["embedder"], text, "MEAN"), f"{text} (transformers)")
    assert_close(default.embedding, hf_pooled(paths["chat"], TEXTS[0], "LAST"), "the default model's")
    reply = openai_client(daemon.http_sock).embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert reply.model == "embedder"
    for item, expected in zip(reply.data, offline):
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=2e-5)
    cut = openai_client(daemon.http_sock).embeddings.create(model="embedder", input=TEXTS[1], dimensions=16,
                                                            encoding_format="float")
    assert_close(cut.data[0].embedding, hf_pooled(paths["embedder"], TEXTS[1], "MEAN", dimensions=16), "16 dims")
    with pytest.raises(openai.BadRequestError) as info:  # only the embedder declares Matryoshka sizes
        openai_client(daemon.http_sock).embeddings.create(model="chat", input="hi", dimensions=16)
    assert info.value.body["param"] == "dimensions"


def test_ollama_embed_loads_with_no_input_and_keep_alive_unloads(daemon, paths):
    with Client(daemon.sock) as client:
        client.unload("embedder")
        assert state(daemon, "embedder")["state"] == "unloaded"
        olla = ollama_client(daemon.http_sock)
        loaded = olla.embed(model="embedder", input=[])  # Ollama's way to load a model
        assert loaded.embeddings == [] and loaded.load_duration > 0
        assert state(daemon, "embedder")["state"] == "serving"
        one = olla.embed(model="emb:latest", input=TEXTS[2], keep_alive=0)  # unloaded once answered
        assert_close(one.embeddings[0], hf_pooled(paths["embedder"], TEXTS[2], "MEAN"), "ollama")
        wait_state(daemon, "embedder", "unloaded")
        client.embed("hi", model="embedder", keep_alive="7m")  # the socket's keep_alive
        assert state(daemon, "embedder")["keep_alive_s"] == 420
        with pytest.raises(RequestError) as unknown:
            client.embed("hi", model="no-such-model-4711")
        assert unknown.value.code == "model_not_found" and "4711" not in str(unknown.value)
    shown = CliRunner().invoke(llmctl, ["--socket", daemon.sock, "embed", "--model", "emb", "--dimensions", "16", "hi"])
    assert shown.exit_code == 0, shown.output
    assert len(json.loads(shown.output)) == 16
    with pytest.raises(ollama.ResponseError) as missing:
        olla.embed(model="no-such-model-4711", input="hi")
    assert missing.value.status_code == 404 and "4711" not in missing.value.error


def test_the_embedding_model_refuses_generation_and_shows_its_capability(daemon):
    olla = ollama_client(daemon.http_sock)
    with Client(daemon.sock) as client:
        client.unload("embedder")
    assert olla.show("embedder").capabilities == ["embedding"]  # from its settings, not loaded
    assert "completion" in olla.show("chat").capabilities
    with pytest.raises(ollama.ResponseError) as info:
        olla.generate(model="embedder", prompt="hi")
    assert info.value.status_code == 400 and "task embed" in info.value.error
    assert state(daemon, "embedder")["state"] == "serving"
    assert olla.show("embedder").capabilities == ["embedding"]  # loaded: its engine's
    with Client(daemon.sock) as client, pytest.raises(RequestError) as error:
        client.generate("hi", max_tokens=2, model="emb")
    assert error.value.code == "invalid_params" and "task embed" in str(error.value)


# -- tool calls in the routed model's format ------------------------------------------------------

def test_forced_calls_are_written_in_each_models_own_format(daemon):
    client = openai_client(daemon.http_sock)
    tools = [{"type": "function", "function": {"name": "add", "description": "add tool", "parameters": ADD}}]
    written = {}
    for model in ("mistral", "chat"):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=120, logprobs=True, seed=3)
        [call] = reply.choices[0].message.tool_calls
        assert reply.model == model and call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD)
        written[model] = "".join(t.token for t in reply.choices[0].logprobs.content)
    # The reply's own tokens (special ones kept where the format's marker is one).
    assert written["mistral"].startswith("[TOOL_CALLS]") and "<tool_call>" not in written["mistral"]
    assert written["chat"].startswith("<tool_call>")
    response = client.responses.create(
        model="mistral", input=MESSAGES, tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
        tools=[{"type": "function", "name": "add", "description": "add tool", "parameters": ADD, "strict": False}],
        extra_body={"seed": 4, "keep_alive": "9m"})
    [item] = response.output
    assert response.model == "mistral" and item.type == "function_call" and item.name == "add"
    jsonschema.validate(json.loads(item.arguments), ADD)
    assert state(daemon, "mistral")["keep_alive_s"] == 540  # llmd's own keep_alive, as on chat completions
