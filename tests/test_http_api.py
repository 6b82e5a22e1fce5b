"""The HTTP face of the real daemon: the official `openai` package against /v1 on a
loopback TCP port (bearer token), curl over the HTTP Unix socket, Ollama's endpoints
with plain HTTP. Greedy text over HTTP must equal what the offline engine and `llmctl`
produce; a client that hangs up mid-stream must get its KV blocks back."""
from __future__ import annotations

import functools
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import openai
import pytest

from daemon_util import Daemon, RawConn
from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path
from test_guided import PERSON

API_KEY = "test-key-5f2a"
MAX_MODEL_LEN = 512
LLMCTL = str(Path(sys.executable).parent / "llmctl")  # CI does not activate the venv
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def unix_request(path: str, method: str, url: str, body: object | None = None) -> tuple[int, bytes]:
    conn = UnixHTTPConnection(path)
    try:
        conn.request(method, url, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    port = free_port()
    d = Daemon(model, tmp_path_factory.mktemp("http") / "llmd.sock", "--max-model-len", str(MAX_MODEL_LEN),
               "--http-port", str(port), "--api-key", API_KEY).wait_ready()
    d.port = port
    d.http_sock = d.sock.removesuffix(".sock") + "-http.sock"
    yield d
    assert d.stop() == 0, d.stderr()


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def complete(client, model):
    return functools.partial(client.completions.create, model=served_name(model))


@pytest.fixture(scope="module")
def chat(client, model):
    return functools.partial(client.chat.completions.create, model=served_name(model))


@pytest.fixture(scope="module")
def offline(model):
    llm = LLM(model=model, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=128)
    yield llm
    llm.engine.shutdown()


def served_name(model: str) -> str:
    return Path(model).name


def wait_idle(daemon, timeout: float = 10.0) -> dict:
    """Status once no request is in flight and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        with RawConn(daemon.sock) as conn:
            conn.send({"type": "status"})
            status = conn.recv()
        if status["num_running"] == 0 and status["num_waiting"] == 0 and status["kv_blocks_used"] == 0:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon not idle: {status}")
        time.sleep(0.05)


# -- OpenAI --------------------------------------------------------------------------

def test_models_lists_the_served_model(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [served_name(model)]


def test_sdk_over_the_unix_socket_needs_no_key(daemon, model):
    """The README's recipe: the SDK's own HTTP client, pointed at the HTTP Unix socket."""
    try:
        import httpx2 as httpx  # what the installed openai SDK is built on
    except ImportError:
        import httpx
    local = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                          http_client=httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_sock)))
    reply = local.chat.completions.create(model=served_name(model), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3


def test_greedy_completion_equals_offline_engine_and_llmctl(daemon, complete, offline):
    reference = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, ref in zip(PROMPTS, reference):
        result = complete(prompt=prompt, max_tokens=24, temperature=0)
        assert result.choices[0].text == ref.outputs[0].text
        assert result.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert result.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert result.usage.completion_tokens == len(ref.outputs[0].token_ids)
        streamed = complete(prompt=prompt, max_tokens=24, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == ref.outputs[0].text
        cli = subprocess.run([LLMCTL, "--socket", daemon.sock, "submit", prompt, "--max-tokens", "24",
                              "--temperature", "0", "--json"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["text"] == ref.outputs[0].text


def test_prompt_shapes_n_and_seed(complete, offline):
    ids = [offline.engine.tokenizer(text).input_ids for text in ("def f(x):", "The quick")]
    ref = offline.generate(ids, SamplingParams(temperature=0, max_tokens=8))
    expected = [ref[0].outputs[0].text] * 2 + [ref[1].outputs[0].text] * 2
    for prompt in (ids, ["def f(x):", "The quick"]):
        result = complete(prompt=prompt, max_tokens=8, temperature=0, n=2)
        assert [c.index for c in result.choices] == [0, 1, 2, 3]
        assert [c.text for c in result.choices] == expected
    single = complete(prompt=ids[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0]
    sampled = [complete(prompt="x = ", max_tokens=12, temperature=1.0, seed=7, n=3)
               for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len({c.text for c in sampled[0].choices}) > 1  # each sample its own seed


def test_stream_with_usage_and_echo(complete):
    chunks = list(complete(prompt="for i in range(3):", max_tokens=10, temperature=0, stream=True, echo=True,
                           stream_options={"include_usage": True}))
    whole = complete(prompt="for i in range(3):", max_tokens=10, temperature=0, echo=True)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text.startswith("for i in range(3):")
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completion_logprobs_equal_offline_engine(complete, offline):
    ref = offline.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    result = complete(prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == 6
    tokenizer = offline.engine.tokenizer
    assert lp.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    for got, position, token in zip(lp.token_logprobs, ref.logprobs, ref.token_ids):
        assert got == pytest.approx(position[token].logprob, abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_with_logprobs_scores_the_prompt(complete, offline):
    prompt = "def add(a, b):\n    return"
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2))[0]
    result = complete(prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = result.choices[0].logprobs
    prompt_ids = ref.prompt_token_ids
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][prompt_ids[i]].logprob, abs=1e-4)
        assert len(lp.top_logprobs[i]) == 2
    for got, position, token in zip(lp.token_logprobs[len(prompt_ids):], ref.outputs[0].logprobs,
                                    ref.outputs[0].token_ids):
        assert got == pytest.approx(position[token].logprob, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert result.choices[0].text == prompt + ref.outputs[0].text


def test_chat_json_schema_streams_and_validates(chat):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    result = chat(messages=messages, max_tokens=200, temperature=0.8, seed=3, response_format=fmt)
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(chat(messages=messages, max_tokens=200, temperature=0.8, seed=3, response_format=fmt, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    obj = chat(messages=messages, max_tokens=100, temperature=0.5, seed=1, response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":  # a random model may not close it within max_tokens
        assert isinstance(json.loads(content), dict)


def test_chat_logprobs_and_top_logprobs(chat):
    result = chat(messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0, logprobs=True,
                  top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 5
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content).startswith(
        result.choices[0].message.content[:1])
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the top one


def test_errors_name_the_parameter(daemon, complete, chat):
    cases = [
        (dict(prompt="hi", temperature=-1), openai.BadRequestError, "temperature"),
        (dict(prompt="hi", max_tokens=MAX_MODEL_LEN), openai.BadRequestError, "max_tokens"),
        (dict(prompt="hi", echo=True, logprobs=1, stream=True), openai.BadRequestError, "echo"),
        (dict(prompt="hi", suffix="x"), openai.BadRequestError, "suffix"),
        (dict(prompt="hi", extra_body={"logit_bias": {"5": 1.0}}), openai.BadRequestError, "logit_bias"),
        (dict(prompt=[], max_tokens=2), openai.BadRequestError, "prompt"),
        (dict(prompt="hi", model="gpt-4o"), openai.NotFoundError, "model"),
        (dict(prompt="hi", n="two"), openai.BadRequestError, "n"),
    ]
    for kwargs, error, param in cases:
        with pytest.raises(error) as info:
            complete(**{"max_tokens": 4, **kwargs})
        assert info.value.body["param"] == param, (kwargs, info.value.body)
        assert "gpt-4o" not in info.value.message and "two" not in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        chat(messages=[{"role": "user", "content": "x"}],
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert info.value.body["param"] == "response_format"
    for key in ("wrong-key", ""):
        bad = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 401
    conn.close()
    assert wait_idle(daemon)["kv_blocks_used"] == 0
    assert "Traceback" not in daemon.stderr()


def test_abort_from_another_shell_ends_the_stream(daemon, complete):
    stream = complete(prompt="x", max_tokens=480, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "status"})
        (running,) = conn.recv()["requests"]
        conn.send({"type": "abort", "id": running["request_id"]})
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "abort"
    assert sum(1 for c in rest if c.choices[0].text) < 470
    wait_idle(daemon)


# -- curl over the HTTP Unix socket ----------------------------------------------------

def test_curl_over_the_unix_socket(daemon, offline):
    ref = offline.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "--unix-socket", daemon.http_sock, "http://localhost/v1/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["text"] == ref.text
    status, raw = unix_request(daemon.http_sock, "GET", "/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"
    status, raw = unix_request(daemon.http_sock, "GET", "/metrics")
    assert status == 200 and b"llmd:generation_tokens_total" in raw
    status, raw = unix_request(daemon.http_sock, "POST", "/v1/completions", None)
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    assert os.stat(daemon.http_sock).st_mode & 0o777 == 0o660


def test_client_disconnect_mid_stream_frees_blocks(daemon):
    before = metric(daemon, 'finished_reason="abort"')
    conn = UnixHTTPConnection(daemon.http_sock)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    with RawConn(daemon.sock) as status_conn:
        status_conn.send({"type": "status"})
        assert status_conn.recv()["kv_blocks_used"] > 0
    started = time.monotonic()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_idle(daemon, timeout=5.0)
    assert time.monotonic() - started < 5.0
    assert metric(daemon, 'finished_reason="abort"') == before + 1


def test_client_disconnect_while_waiting_for_a_whole_response(daemon):
    """Without streaming nothing is written until the end: the hang-up itself must abort."""
    before = metric(daemon, 'finished_reason="abort"')
    conn = UnixHTTPConnection(daemon.http_sock)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "ignore_eos": True}),
        headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while True:  # until the request runs
        with RawConn(daemon.sock) as status_conn:
            status_conn.send({"type": "status"})
            if status_conn.recv()["num_running"] == 1:
                break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_idle(daemon, timeout=5.0)
    assert metric(daemon, 'finished_reason="abort"') == before + 1


def metric(daemon, label: str) -> float:
    status, raw = unix_request(daemon.http_sock, "GET", "/metrics")
    lines = [line for line in raw.decode().splitlines() if line.startswith("llmd:request_success_total") and label in line]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


# -- Ollama ------------------------------------------------------------------------------

def test_ollama_generate_and_chat(daemon, offline, model):
    name = served_name(model)
    ref = offline.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    status, raw = unix_request(daemon.http_sock, "POST", "/api/generate",
                               {"model": f"{name}:latest", "prompt": "def fibonacci(n):", "raw": True,
                                "options": {"temperature": 0, "num_predict": 10}})
    assert status == 200
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert "".join(line["response"] for line in lines) == ref.text
    assert lines[-1]["eval_count"] == len(ref.token_ids) and lines[-1]["done_reason"] == ref.finish_reason
    status, raw = unix_request(daemon.http_sock, "POST", "/api/generate",
                               {"model": name, "prompt": "def fibonacci(n):", "raw": True, "stream": False,
                                "options": {"temperature": 0, "num_predict": 10}})
    assert status == 200 and json.loads(raw)["response"] == ref.text

    messages = [{"role": "user", "content": "hi there"}]
    chat_ref = offline.generate([offline.engine.input_processor.render_chat(messages)],
                                SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    status, raw = unix_request(daemon.http_sock, "POST", "/api/chat",
                               {"model": name, "messages": messages, "stream": False,
                                "options": {"temperature": 0, "num_predict": 8}})
    reply = json.loads(raw)
    assert status == 200 and reply["message"] == {"role": "assistant", "content": chat_ref.text}
    status, raw = unix_request(daemon.http_sock, "POST", "/api/chat",
                               {"model": name, "messages": messages, "format": PERSON,
                                "options": {"temperature": 0.8, "seed": 3, "num_predict": 200}})
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    jsonschema.validate(json.loads("".join(line["message"]["content"] for line in lines)), PERSON)


def test_ollama_metadata_and_errors(daemon, model):
    name = served_name(model)
    status, raw = unix_request(daemon.http_sock, "GET", "/api/tags")
    tags = json.loads(raw)["models"]
    assert status == 200 and [t["name"] for t in tags] == [f"{name}:latest"] and tags[0]["size"] > 0
    status, raw = unix_request(daemon.http_sock, "POST", "/api/show", {"model": name})
    shown = json.loads(raw)
    assert status == 200 and shown["model_info"]["llama.context_length"] == MAX_MODEL_LEN
    assert "completion" in shown["capabilities"] and "insert" not in shown["capabilities"]
    assert json.loads(unix_request(daemon.http_sock, "GET", "/api/version")[1])["version"]
    status, raw = unix_request(daemon.http_sock, "POST", "/api/generate", {"model": "llama3:8b", "prompt": "hi"})
    assert status == 404 and "llama3" not in json.loads(raw)["error"]
    status, raw = unix_request(daemon.http_sock, "POST", "/api/generate",
                               {"model": name, "prompt": "hi", "options": {"top_p": 5}})
    assert status == 400 and "top_p" in json.loads(raw)["error"]


# -- prefix-cache isolation ----------------------------------------------------------

def test_cache_salt_separates_prefix_cache_hits(complete):
    prompt = "class Config:\n    def __init__(self, path):\n        self.path = path\n" * 3
    first = complete(prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "a"})
    again = complete(prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "a"})
    other = complete(prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": "b"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_tcp_port_needs_a_key_unless_turned_off(model, tmp_path):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "llmd.cli", "serve", "--model", model, "--socket",
                          str(tmp_path / "a.sock"), "--http-port", str(port)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "LLMD_API_KEY": ""})
    assert out.returncode == 2 and "http_port needs an API key" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing bound, nothing left behind
    d = Daemon(model, tmp_path / "b.sock", "--http-port", str(port), "--no-http-require-api-key").wait_ready()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/version")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        assert d.stop() == 0, d.stderr()
    assert not list(tmp_path.iterdir()) or all(p.suffix == ".log" for p in tmp_path.iterdir())


def test_tcp_peer_uid_is_the_connecting_process():
    from llmd.actors.peer_credentials import tcp_peer_uid

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client_sock:
            conn, peer = server.accept()
            with conn:
                assert tcp_peer_uid(peer, conn.getsockname()) == os.getuid()
                assert tcp_peer_uid((peer[0], peer[1] ^ 1), conn.getsockname()) == -1
