"""Models loaded on demand under a budget of one loaded model (issue 29), end to end:
a request for another model evicts the idle one (least recently used) and the evicted
model comes back, with the same outputs, on its next request; a model that cannot fit
even alone is refused with the figures and evicts nothing; a burst of requests across
models, on several connections at once, gets every request its final message; a
request aborted (or whose client left) while its model waited for room never starts
and leaves the busy model be; Ollama's empty prompt loads a model, with keep_alive 0
unloads it."""
from __future__ import annotations

import threading
import time

import ollama
import openai
import pytest

from daemon_util import Daemon, RawConn
from http_clients import http_socket, ollama_client, openai_client
from llmd_tools.make_model import fixture_path
from test_multi_model import finals, models, tokens_of, wait_state

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    config = base / "llmd.toml"
    config.write_text(f"""
max_loaded_models = 1
model_memory_budget_bytes = {{ cpu = 1073741824 }}

[models.qwen]
path = "{fixture_path('tiny-qwen2')}"

[models.huge]
path = "{fixture_path('tiny-llama')}"
num_gpu_blocks_override = 10000000
""")
    d = Daemon(str(fixture_path("tiny-llama")), base / "s.sock", "--config", str(config),
               "--served-model-name", "base").wait_ready()
    d.http_sock = http_socket(d.sock)
    yield d
    assert d.stop() == 0, d.stderr()


def ask(d: Daemon, model: str | None, ident: str = "a", prompt: str = "def f(x):", **extra) -> list[dict]:
    with RawConn(d.sock) as conn:
        conn.send({"type": "submit", "id": ident, "prompt": prompt, "sampling": GREEDY,
                   **({"model": model} if model else {}), **extra})
        return finals(conn, [ident])[ident]


def states(d: Daemon) -> dict[str, str]:
    return {name: m["state"] for name, m in models(d).items()}


def test_a_second_model_evicts_the_idle_one_and_it_comes_back_the_same(daemon):
    first = tokens_of(ask(daemon, None))
    assert states(daemon) == {"base": "serving", "qwen": "unloaded", "huge": "unloaded"}
    qwen = tokens_of(ask(daemon, "qwen"))
    assert states(daemon)["base"] == "unloaded" and states(daemon)["qwen"] == "serving"
    assert tokens_of(ask(daemon, None)) == first and len(first) == 8  # the default model, loaded again
    assert states(daemon)["qwen"] == "unloaded"
    assert tokens_of(ask(daemon, "qwen")) == qwen and qwen != first
    listed = models(daemon)
    assert not listed["base"]["memory_estimated"] and listed["base"]["memory_bytes"] > 0  # what it held


def test_a_model_that_cannot_fit_is_refused_and_evicts_nothing(daemon):
    before = states(daemon)
    error = ask(daemon, "huge")[-1]
    assert error["type"] == "error" and error["code"] == "model_unavailable"
    assert "model huge: the model needs" in error["message"] and "more than the 1024 MiB" in error["message"]
    assert states(daemon) == {**before, "huge": "failed"}
    with pytest.raises(openai.APIStatusError) as info:
        openai_client(daemon.http_sock).completions.create(model="huge", prompt="hi", max_tokens=2)
    assert info.value.status_code == 503 and "model_memory_budget_bytes" in info.value.message


def test_a_burst_across_models_gets_every_request_its_final_message(daemon):
    results: dict[str, dict] = {}

    def client(n: int) -> None:
        with RawConn(daemon.sock, timeout=120) as conn:
            idents = [f"{n}-{i}" for i in range(4)]
            for i, ident in enumerate(idents):
                conn.send({"type": "submit", "id": ident, "prompt": "hello", "sampling": {**GREEDY, "max_tokens": 6},
                           **({"model": "qwen"} if (n + i) % 2 else {})})
            got = finals(conn, idents)
            results.update({ident: got[ident][-1] for ident in idents})

    threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 12
    assert all(r.get("finish_reason") == "length" and r["usage"]["completion_tokens"] == 6 for r in results.values()), \
        results


def test_a_request_aborted_or_left_while_waiting_for_room_never_starts(daemon):
    ask(daemon, None)  # the default model loaded (qwen unloaded)
    with RawConn(daemon.sock) as busy, RawConn(daemon.sock) as waiting:
        busy.send({"type": "submit", "id": "long", "prompt": "hi", "sampling": {"max_tokens": 60, "ignore_eos": True}})
        assert busy.recv()["type"] == "accepted"
        waiting.send({"type": "submit", "id": "w", "prompt": "hi", "model": "qwen", "sampling": GREEDY})
        waiting.send({"type": "status"})
        reply = waiting.recv()  # the connection answers while its submit waits for room
        assert reply["type"] == "status_reply"
        assert {m["name"]: m["state"] for m in reply["models"]}["qwen"] == "loading"  # queued for room
        waiting.send({"type": "abort", "id": "w"})
        aborted = waiting.recv()
        assert aborted["type"] == "error" and aborted["code"] == "aborted" and aborted["id"] == "w"
        with RawConn(daemon.sock) as leaving:  # a client that goes away while it waits: the same
            leaving.send({"type": "submit", "id": "x", "prompt": "hi", "model": "qwen", "sampling": GREEDY})
            leaving.send({"type": "status"})
            assert leaving.recv()["type"] == "status_reply"
        assert finals(busy, ["long"])["long"][-1]["usage"]["completion_tokens"] == 60
    assert states(daemon)["base"] == "serving" and states(daemon)["qwen"] == "unloaded"


def test_ollamas_empty_prompt_loads_a_model_and_keep_alive_zero_unloads_it(daemon):
    olla = ollama_client(daemon.http_sock)
    loaded = olla.generate(model="qwen", prompt="")
    assert loaded.done and loaded.done_reason == "load"
    assert [m.model for m in olla.ps().models] == ["qwen:latest"]  # the default made room
    gone = olla.generate(model="qwen", prompt="", keep_alive=0)
    assert gone.done_reason == "unload" and olla.ps().models == []
    assert states(daemon)["qwen"] == "unloaded"
    reply = olla.chat(model="base", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert reply.done and reply.load_duration > 0  # this request waited for base's load
    with pytest.raises(ollama.ResponseError) as info:
        olla.generate(model="nope", prompt="", keep_alive=0)
    assert info.value.status_code == 404
    wait_state(daemon, "base", "serving", timeout=5)
    assert time.time() - models(daemon)["base"]["last_used"] < 60
