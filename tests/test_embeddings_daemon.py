"""Embeddings from a real daemon on every face, with clients nobody here wrote: the
official `openai` package (`client.embeddings.create`, float and base64, `dimensions`)
and the `ollama` package (`embed`, `embeddings`), plus llmd's own socket protocol
(Client.embed, AsyncClient.embed, raw JSON lines, `llmctl embed`). The reference is
transformers on the same weights: the prompt's final hidden states (tokenized by
transformers' own tokenizer) mean-pooled and normalized, fp32, cosine >= 0.9999. The
daemon pools MEAN with a step budget of 32 tokens, so longer inputs are computed in
chunks. Bad input gets an error naming the field, and the daemon keeps serving."""
from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from daemon_util import LLMD, Daemon, RawConn
from hf_ref import hf_model
from http_clients import client, http, http_client, http_socket, olla, ollama_client  # noqa: F401 (fixtures)
from llmd_client import AsyncClient, Client, RequestError
from llmd_tools.make_model import fixture_path

MAX_MODEL_LEN = 256  # daemon_util's
BUDGET = 32
TOKEN_QUOTA = 250  # max_pending_tokens_per_user: less than one input of max_model_len tokens
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 4, "def fib(n): return n"]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("embed")
    config = folder / "llmd.toml"
    config.write_text(f"max_pending_tokens_per_user = {TOKEN_QUOTA}\n")
    d = Daemon(model, folder / "llmd.sock", "--config", str(config), "--pooling-type", "MEAN",
               "--matryoshka-dimensions", "16,32", "--max-num-batched-tokens", str(BUDGET)).wait_ready()
    d.http_sock = http_socket(d.sock)
    yield d
    assert d.stop() == 0, d.stderr()
    assert "Traceback" not in d.stderr()


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """reference(text or token ids, normalize=True, dimensions=None): transformers' mean-pooled vector."""
    hf = hf_model(model)[0]

    @torch.inference_mode()
    def pooled(prompt: str | list[int], *, normalize: bool = True, dimensions: int | None = None) -> torch.Tensor:
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        vector = hf.model(torch.tensor([ids])).last_hidden_state[0].float().mean(dim=0)
        if dimensions is not None:
            vector = vector[:dimensions]
        return F.normalize(vector, dim=-1) if normalize else vector

    return pooled


def assert_close(got, expected: torch.Tensor, what: str) -> None:
    got_t = torch.tensor(list(got), dtype=torch.float32)
    assert got_t.shape == expected.shape, f"{what}: {got_t.shape} != {expected.shape}"
    cosine = F.cosine_similarity(got_t, expected, dim=0).item()
    assert cosine >= MIN_COSINE, f"{what}: cosine {cosine}"
    assert abs(got_t.norm().item() - expected.norm().item()) <= 1e-4 * expected.norm().item(), what


# -- OpenAI --------------------------------------------------------------------------------

def test_openai_embeddings_float_and_base64(client, name, tokenizer, reference):
    assert len(tokenizer(TEXTS[1]).input_ids) > BUDGET  # the daemon computes it in chunks
    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == name
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    for text, item in zip(TEXTS, floats.data):
        assert_close(item.embedding, reference(text), text)
    tokens = sum(len(tokenizer(t).input_ids) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # The SDK's default: it asks for base64 and decodes it to floats itself.
    default = client.embeddings.create(model=name, input=TEXTS)
    for text, item in zip(TEXTS, default.data):
        assert_close(item.embedding, reference(text), f"{text} (the SDK's base64)")
    raw = client.embeddings.create(model=name, input=TEXTS[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert_close(decoded.tolist(), reference(TEXTS[0]), "base64, decoded as little-endian float32")


def test_openai_token_id_inputs_and_dimensions(client, name, reference):
    ids = [[5, 17, 301, 42, 8], list(range(3, 3 + 70))]
    many = client.embeddings.create(model=name, input=ids, encoding_format="float")
    for prompt, item in zip(ids, many.data):
        assert_close(item.embedding, reference(prompt), "token ids")
    one = client.embeddings.create(model=name, input=ids[0], encoding_format="float")
    assert_close(one.data[0].embedding, reference(ids[0]), "one token id list")
    assert one.usage.prompt_tokens == 5
    cut = client.embeddings.create(model=name, input=TEXTS[1], dimensions=16, encoding_format="float")
    assert_close(cut.data[0].embedding, reference(TEXTS[1], dimensions=16), "dimensions 16")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=name, input="hi", dimensions=24)
    assert info.value.body["param"] == "dimensions" and "16, 32" in info.value.message


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "input must not be empty"),
    ({"input": []}, "input", "input must not be an empty list"),
    ({"input": ["fine", ""]}, "input", "input[1] must not be empty"),
    ({"input": [[1, 2], "text"]}, "input", "input must be a string"),
    ({"input": [[1, 2, 99999]]}, "input", "input token ids must be in [0, 1024)"),
    ({"input": ["ok", "word " * 400]}, "input", "input[1] has 1201 tokens, more than max_model_len (256)"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "hi", "dimensions": 0}, "dimensions", "dimensions must be in [1,"),
    ({"input": 42}, "input", None),
    ({"model": "secret-model", "input": "hi"}, "model", None),
])
def test_openai_bad_input_names_the_field(http, body, param, words):
    reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == (404 if param == "model" else 400), reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert words is None or words in error["message"], error
    assert "secret" not in error["message"] and "word word" not in error["message"]


# -- Ollama ---------------------------------------------------------------------------------

def test_ollama_embed_and_legacy_embeddings(olla, name, reference, tokenizer):
    reply = olla.embed(model=name, input=TEXTS)
    assert len(reply.embeddings) == len(TEXTS)
    for text, vector in zip(TEXTS, reply.embeddings):
        assert_close(vector, reference(text), text)
    assert reply.prompt_eval_count == sum(len(tokenizer(t).input_ids) for t in TEXTS)
    # The model serves already: load_duration is the (short) wait for it, within the total.
    assert reply.total_duration > 0 and 0 <= reply.load_duration <= reply.total_duration
    single = olla.embed(model=f"{name}:latest", input=TEXTS[0], dimensions=32)
    assert_close(single.embeddings[0], reference(TEXTS[0], dimensions=32), "ollama dimensions")
    assert_close(olla.embed(model=name, input=TEXTS[0], dimensions=0).embeddings[0], reference(TEXTS[0]),
                 "dimensions 0 is Ollama's 'not given'")
    legacy = olla.embeddings(model=name, prompt=TEXTS[1])  # as pooled: not normalized, as Ollama's
    assert_close(legacy.embedding, reference(TEXTS[1], normalize=False), "legacy")
    assert olla.embed(model=name, input=[]).embeddings == []  # Ollama's way to load the model
    assert list(olla.embeddings(model=name, prompt="").embedding) == []


def test_ollama_truncates_unless_told_not_to(olla, name, reference, tokenizer):
    text = "word " * 400
    cut = olla.embed(model=name, input=text, options={"num_ctx": 128})  # truncate defaults to true, as in Ollama
    assert cut.prompt_eval_count == 128
    assert_close(cut.embeddings[0], reference(tokenizer(text).input_ids[:128]), "truncated")
    for call, words in ((lambda: olla.embed(model=name, input=text, truncate=False), "more than max_model_len"),
                        (lambda: olla.embed(model=name, input=text, truncate=False, options={"num_ctx": 128}),
                         "more than the request's num_ctx (128)"),
                        (lambda: olla.embed(model=name, input=["ok", ""]), "input[1] must not be empty"),
                        (lambda: olla.embed(model=name, input="hi", dimensions=24), "dimensions"),
                        (lambda: olla.embed(model=name, input="hi", options={"num_ctx": 100000}), "num_ctx"),
                        (lambda: olla.embed(model=name, input="hi", keep_alive="soon"), "keep_alive"),
                        (lambda: olla.embeddings(model=name, prompt=text), "prompt has 1201 tokens")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 400 and words in info.value.error, info.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        olla.embed(model="llama3:8b", input="hi")
    assert missing.value.status_code == 404


# -- the socket protocol ------------------------------------------------------------------------

def test_client_embed_single_batch_and_token_ids(daemon, reference, tokenizer):
    with Client(socket=daemon.sock) as llm:
        one = llm.embed(TEXTS[1])
        assert one.prompt_tokens == len(tokenizer(TEXTS[1]).input_ids) and one.request_id
        assert_close(one.embedding, reference(TEXTS[1]), "Client.embed")
        batch = llm.embed([TEXTS[0], [5, 17, 301], TEXTS[2]], dimensions=32)
        for prompt, result in zip([TEXTS[0], [5, 17, 301], TEXTS[2]], batch):
            assert_close(result.embedding, reference(prompt, dimensions=32), "Client.embed batch")
        raw = llm.embed([5, 17, 301], normalize=False)
        assert_close(raw.embedding, reference([5, 17, 301], normalize=False), "token ids, raw")
        with pytest.raises(RequestError) as info:
            llm.embed(["fine", ""])
        assert info.value.code == "invalid_params" and info.value.message == "prompt is empty"
        assert llm.embed("still serving").prompt_tokens > 0  # the connection is usable


def test_async_client_embeds_concurrently(daemon, reference):
    async def run():
        async with AsyncClient(socket=daemon.sock) as llm:
            return await asyncio.gather(llm.embed(TEXTS), llm.embed(TEXTS[2]))

    batch, single = asyncio.run(run())
    for text, result in zip(TEXTS, batch):
        assert_close(result.embedding, reference(text), "AsyncClient.embed")
    assert_close(single.embedding, reference(TEXTS[2]), "AsyncClient.embed, one text")


def test_raw_json_lines_embed(daemon, reference):
    with RawConn(daemon.sock, json_mode=True) as conn:
        conn.send({"type": "embed", "id": "e", "prompt": TEXTS[0], "pooling": {"dimensions": 16}})
        accepted, output = conn.until_final("e")
        assert accepted["type"] == "accepted" and output["finish_reason"] == "stop"
        assert output["usage"] == {"prompt_tokens": accepted["prompt_tokens"], "completion_tokens": 0,
                                   "cached_tokens": 0}
        assert_close(output["embedding"], reference(TEXTS[0], dimensions=16), "raw embed")
        for message, code, words in (
                ({"type": "embed", "id": "x", "prompt": "a", "token_ids": [1]}, "bad_request", "exactly one of"),
                ({"type": "embed", "id": "x", "prompt": "a", "pooling": {"dimensions": -1}}, "invalid_params",
                 "dimensions"),
                ({"type": "embed", "id": "x", "prompt": "a", "sampling": {}}, "bad_request", "sampling"),
                ({"type": "embed", "id": "x", "prompt": "word " * 400}, "invalid_params", "max_model_len")):
            conn.send(message)
            reply = conn.recv()
            assert reply["type"] == "error" and reply["code"] == code and words in reply["message"], reply


def test_llmctl_embed_prints_one_json_array_per_text(daemon, reference):
    run = subprocess.run(LLMD[:2] + ["llmd_client.llmctl", "--socket", daemon.sock, "embed", TEXTS[0], TEXTS[2]],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(lines) == 2
    for text, line in zip((TEXTS[0], TEXTS[2]), lines):
        assert_close(line, reference(text), "llmctl embed")
    refused = subprocess.run(LLMD[:2] + ["llmd_client.llmctl", "--socket", daemon.sock, "embed", "--dimensions", "24",
                                         "hi"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "dimensions" in refused.stderr


# -- beside generation, quotas and metrics --------------------------------------------------------

def test_embeddings_beside_a_generation_count_in_quotas_and_metrics(daemon, client, name, reference):
    """An embedding made while a generation streams; its prompt tokens count in the
    prompt-token metrics and in the user's quota of tokens in flight, which one input
    of max_model_len tokens passes (refused on the socket and over HTTP alike)."""
    with Client(socket=daemon.sock) as llm:
        before = llm.status()
        stream = llm.stream(token_ids=list(range(3, 3 + 200)), max_tokens=40, temperature=0, ignore_eos=True)
        first = next(iter(stream))
        embedded = llm.embed(TEXTS[0])
        assert_close(embedded.embedding, reference(TEXTS[0]), "beside a generation")
        rest = list(stream)
        assert rest[-1].finish_reason == "length" and len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
        whole = list(range(3, 3 + MAX_MODEL_LEN))  # fits the context, not the quota
        with pytest.raises(RequestError) as refused:
            llm.embed(whole)
        assert refused.value.code == "overloaded" and "too many prompt tokens" in refused.value.message
        with pytest.raises(openai.InternalServerError) as info:
            client.embeddings.create(model=name, input=[whole])
        assert info.value.status_code == 503 and "too many prompt tokens" in info.value.message
        after = llm.status()
    assert after.prompt_tokens_total - before.prompt_tokens_total == 200 + embedded.prompt_tokens
    assert after.requests_finished_total - before.requests_finished_total == 2


# -- a model served for embeddings only --------------------------------------------------------

def test_task_embed_serves_embeddings_and_refuses_generation(model, reference, tmp_path):
    d = Daemon(model, tmp_path / "llmd.sock", "--task", "embed", "--pooling-type", "MEAN").wait_ready()
    try:
        sock = http_socket(d.sock)
        with http_client(sock) as http_:
            reply = http_.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"})
            assert reply.status_code == 200, reply.text
            assert_close(reply.json()["data"][0]["embedding"], reference(TEXTS[0]), "task embed")
            refused = http_.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 400 and "task embed" in refused.json()["error"]["message"]
        olla = ollama_client(sock)
        assert olla.show(Path(model).name).capabilities == ["embedding"]
        with pytest.raises(ollama.ResponseError) as info:
            olla.generate(model=Path(model).name, prompt="hi")
        assert info.value.status_code == 400 and "task embed" in info.value.error
        with Client(socket=d.sock) as llm, pytest.raises(RequestError) as error:
            llm.generate("hi", max_tokens=2)
        assert error.value.code == "invalid_params"
    finally:
        assert d.stop() == 0, d.stderr()
    assert "Traceback" not in d.stderr()
