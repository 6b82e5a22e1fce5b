"""Fill-in-the-middle over HTTP (OpenAI's `suffix`, llama.cpp's `/infill`, Ollama's
`suffix`) on a model whose vocabulary has FIM tokens, checked against the offline
engine on the prompt built by hand; and `/health`, which must fail while the engine
makes no progress (its worker stopped) and recover when it resumes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import psutil
import pytest

from daemon_util import Daemon, RawConn
from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path
from test_http_api import unix_request

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    """tiny-qwen2 with Qwen2.5-Coder's FIM tokens added (its padded vocabulary has room)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("fim") / "tiny-fim"
    shutil.copytree(fixture_path("tiny-qwen2"), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *FIM]})
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def daemon(fim_model, tmp_path_factory):
    d = Daemon(fim_model, tmp_path_factory.mktemp("sock") / "llmd.sock", "--distributed-executor-backend", "mp",
               "--health-stall-s", "1").wait_ready()
    d.http_sock = d.sock.removesuffix(".sock") + "-http.sock"
    yield d
    assert d.stop() == 0, d.stderr()


@pytest.fixture(scope="module")
def offline(fim_model):
    llm = LLM(model=fim_model, max_model_len=256, num_gpu_blocks_override=64)
    yield llm
    llm.engine.shutdown()


def reference(offline, text: str, max_tokens: int):
    ids = offline.engine.tokenizer(text).input_ids
    return ids, offline.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]


def post(daemon, url: str, body: dict) -> tuple[int, object]:
    status, raw = unix_request(daemon.http_sock, "POST", url, body)
    text = raw.decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def test_openai_suffix_builds_the_fim_prompt(daemon, offline):
    ids, ref = reference(offline, "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>", 12)
    status, body = post(daemon, "/v1/completions", {"prompt": "def add(a, b):\n    ", "suffix": "\n    return c",
                                                    "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == ref.text


def test_infill_with_extra_context_streamed_and_not(daemon, offline):
    text = ("<|fim_prefix|><|file_sep|>util.py\nimport os\n<|file_sep|>main.py\nx = 1\n"
            "for i in range(<|fim_suffix|>):\n    pass<|fim_middle|>10")
    ids, ref = reference(offline, text, 10)
    request = {"input_prefix": "for i in range(", "input_suffix": "):\n    pass", "prompt": "10",
               "input_extra": [{"filename": "util.py", "text": "import os\n"}, {"filename": "main.py", "text": "x = 1"}],
               "n_predict": 10, "temperature": 0}
    status, body = post(daemon, "/infill", request)
    assert status == 200, body
    assert body["content"] == ref.text and body["stop"] is True
    assert body["tokens_evaluated"] == len(ids) and body["tokens_predicted"] == len(ref.token_ids)
    assert body["stop_type"] == {"length": "limit", "stop": "eos"}[ref.finish_reason]
    status, raw = unix_request(daemon.http_sock, "POST", "/infill", {**request, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1]["stop"] is True and all(not e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == ref.text


def test_ollama_suffix_and_capabilities(daemon, offline, fim_model):
    _, ref = reference(offline, "<|fim_prefix|>x = [<|fim_suffix|>]<|fim_middle|>", 8)
    name = os.path.basename(fim_model)
    status, body = post(daemon, "/api/generate", {"model": name, "prompt": "x = [", "suffix": "]", "stream": False,
                                                  "options": {"temperature": 0, "num_predict": 8}})
    assert status == 200 and body["response"] == ref.text
    status, body = post(daemon, "/api/show", {"model": name})
    assert "insert" in body["capabilities"]


def test_infill_refused_without_fim_tokens(tmp_path_factory):
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path_factory.mktemp("nofim") / "llmd.sock").wait_ready()
    try:
        status, raw = unix_request(d.sock.removesuffix(".sock") + "-http.sock", "POST", "/infill",
                                   {"input_prefix": "a", "input_suffix": "b"})
        assert status == 501 and "fill-in-the-middle" in json.loads(raw)["error"]["message"]
    finally:
        assert d.stop() == 0, d.stderr()


def health(daemon) -> tuple[int, dict]:
    status, raw = unix_request(daemon.http_sock, "GET", "/health")
    return status, json.loads(raw)


def test_health_fails_while_the_worker_is_stopped(daemon):
    assert health(daemon) == (200, {"status": "ok", "detail": "idle"})
    (worker,) = psutil.Process(daemon.proc.pid).children()
    worker.send_signal(signal.SIGSTOP)
    try:
        with RawConn(daemon.sock) as conn:
            conn.send({"type": "submit", "id": "a", "prompt": "hello", "sampling": {"max_tokens": 4}})
            assert conn.recv()["type"] == "accepted"
            deadline = time.monotonic() + 10
            while (reply := health(daemon))[0] == 200:
                assert time.monotonic() < deadline, reply
                time.sleep(0.1)
            assert reply[0] == 503 and "no engine step" in reply[1]["detail"]
            worker.send_signal(signal.SIGCONT)
            assert conn.until_final("a")[-1]["finish_reason"] == "length"
        assert health(daemon)[0] == 200
    finally:
        worker.send_signal(signal.SIGCONT)
