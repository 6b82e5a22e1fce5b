"""Several models in one daemon (issue 29), end to end: the default model loaded at start
and three more by name ([models.NAME] tables), loaded by their first request. Requests
to two models interleaved on one connection and over HTTP give each model's own
output, token for token that of the offline engine on that model alone; every face
routes by `model` and lists what can be served; an unknown model is a clear error
naming the field; keep_alive unloads an idle model; a killed worker of one model fails
only its requests while the other model serves on, and a model whose engine is
declared dead is unloaded and loaded afresh by its next request; a model in a worker
process sleeps and wakes there; unloading gives the memory back; `llmctl ps`, `load`,
`unload`."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import ollama
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from daemon_util import Daemon, RawConn
from http_clients import http_socket, ollama_client, openai_client
from llmd import LLM, SamplingParams
from llmd_client import Client
from llmd_client.llmctl import cli as llmctl
from llmd_tools.bench_model_pool import MIB, settled_rss
from llmd_tools.make_model import fixture_path

PROMPTS = ["def parse(path):", "import os\nimport sys\n", "class Config:"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return {name: str(fixture_path(fixture)) for name, fixture in
            [("default", "tiny-llama"), ("qwen", "tiny-qwen2"), ("q3mp", "tiny-qwen3"), ("brief", "tiny-llama-tied"),
             ("adhoc", "tiny-mistral-sw16"), ("small", "small-llama")]}


@pytest.fixture(scope="module")
def daemon(paths, tmp_path_factory):
    base = tmp_path_factory.mktemp("multi")
    config = base / "llmd.toml"
    config.write_text(f"""
allow_model_paths = true
worker_restart_backoff_s = 0.1
worker_max_failures = 1
served_model_name = ["base"]

[models.qwen]
path = "{paths['qwen']}"
aliases = ["q", "qwen2-tiny"]

[models.q3mp]
path = "{paths['q3mp']}"
distributed_executor_backend = "mp"

[models.brief]
path = "{paths['brief']}"
keep_alive = "1s"

[models.small]
path = "{paths['small']}"
num_gpu_blocks_override = 256
""")
    d = Daemon(paths["default"], base / "s.sock", "--config", str(config)).wait_ready()
    d.http_sock = http_socket(d.sock)
    yield d
    assert d.stop() == 0, d.stderr()


def models(d: Daemon) -> dict[str, dict]:
    with RawConn(d.sock) as conn:
        conn.send({"type": "models"})
        return {m["name"]: m for m in conn.recv()["models"]}


def wait_state(d: Daemon, name: str, state: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = models(d).get(name)
        if model is not None and model["state"] == state:
            return model
        time.sleep(0.05)
    raise TimeoutError(f"{name} never became {state}: {models(d).get(name)}\n{d.stderr()[-3000:]}")


def finals(conn: RawConn, idents: list[str]) -> dict[str, list[dict]]:
    """Each request's messages, up to its final one, whatever order they come in."""
    out: dict[str, list[dict]] = {i: [] for i in idents}
    done: set[str] = set()
    while len(done) < len(idents):
        message = conn.recv()
        ident = message.get("id")
        if ident in out:
            out[ident].append(message)
            if message["type"] == "error" or message.get("usage") is not None:
                done.add(ident)
    return out


def tokens_of(messages: list[dict]) -> list[int]:
    return [t for m in messages if m["type"] == "output" for t in m.get("token_ids", [])]


def worker_pids(d: Daemon) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "llmd.gpu.worker.process", "-P", str(d.proc.pid)],
                         capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_every_model_is_listed_and_only_the_default_is_loaded_at_start(daemon):
    listed = models(daemon)
    assert list(listed) == ["base", "qwen", "q3mp", "brief", "small"]
    assert listed["base"]["default"] and listed["base"]["state"] == "serving" and listed["base"]["device"] == "cpu"
    assert {listed[n]["state"] for n in ("qwen", "q3mp", "brief", "small")} == {"unloaded"}
    assert listed["qwen"]["aliases"] == ["q", "qwen2-tiny"] and listed["qwen"]["memory"] is None
    assert [m.id for m in openai_client(daemon.http_sock).models.list().data] == list(listed)
    olla = ollama_client(daemon.http_sock)
    assert [m.model for m in olla.list().models] == [f"{name}:latest" for name in listed]
    assert [m.model for m in olla.ps().models] == ["base:latest"]


def test_interleaved_requests_give_each_models_own_output(daemon, paths):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = {}
    for name in ("default", "qwen"):
        llm = LLM(model=paths[name], max_model_len=256, num_gpu_blocks_override=128)
        offline[name] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        del llm
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with RawConn(daemon.sock) as conn:
        sent = []
        for i, prompt in enumerate(PROMPTS):  # qwen's first request loads it; base's go on meanwhile
            for model in ("qwen", None, "q") if i == 0 else (None, "qwen2-tiny"):
                ident = f"{model}-{i}"
                conn.send({"type": "submit", "id": ident, "prompt": prompt, "sampling": sampling,
                           **({"model": model} if model else {})})
                sent.append((ident, "default" if model is None else "qwen", i))
        got = finals(conn, [ident for ident, _, _ in sent])
    for ident, model, i in sent:
        assert got[ident][0]["type"] == "accepted", got[ident]
        assert tokens_of(got[ident]) == offline[model][i].token_ids, ident
    client = openai_client(daemon.http_sock)
    for model, name in (("qwen", "q"), ("default", "base")):
        reply = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == offline[model][1].text and reply.model == ("qwen" if name == "q" else "base")
    raw = ollama_client(daemon.http_sock).generate(model="qwen:latest", prompt=PROMPTS[2], raw=True,
                                                   options={"num_predict": MAX_TOKENS, "temperature": 0})
    assert raw.response.startswith(offline["qwen"][2].text[:8])
    qwen = models(daemon)["qwen"]
    assert qwen["state"] == "serving" and not qwen["memory_estimated"] and qwen["memory"]["weights"]


def test_an_unknown_model_is_a_clear_error_on_every_face(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "x", "prompt": "hi", "model": "no-such-model-4711"})
        error = conn.recv()
    assert error["type"] == "error" and error["code"] == "model_not_found" and error["id"] == "x"
    assert error["message"].startswith("model: ") and "4711" not in error["message"] and "qwen" in error["message"]
    with pytest.raises(openai.NotFoundError) as info:
        openai_client(daemon.http_sock).chat.completions.create(
            model="no-such-model-4711", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(ollama.ResponseError) as olla:
        ollama_client(daemon.http_sock).generate(model="no-such-model-4711", prompt="hi")
    assert olla.value.status_code == 404 and "4711" not in olla.value.error


def test_keep_alive_unloads_an_idle_model(daemon, paths):
    with RawConn(daemon.sock) as conn:  # brief's table says 1 s
        conn.send({"type": "submit", "id": "b", "prompt": "hi", "model": "brief", "sampling": {"max_tokens": 2}})
        assert finals(conn, ["b"])["b"][-1]["usage"]["completion_tokens"] == 2
    brief = models(daemon)["brief"]
    assert brief["state"] == "serving" and brief["keep_alive_s"] == 1
    assert brief["expires_at"] is not None and brief["expires_at"] - time.time() <= 1.0
    wait_state(daemon, "brief", "unloaded", timeout=10)
    # A request's own keep_alive (0: right after it), and a model named by its path.
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "p", "prompt": "hi", "model": paths["adhoc"], "keep_alive": 0,
                   "sampling": {"max_tokens": 2}})
        assert finals(conn, ["p"])["p"][-1]["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 10
    while paths["adhoc"] in models(daemon):  # unloaded, and forgotten: only the operator's models stay
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_killed_worker_of_one_model_leaves_the_other_serving(daemon):
    """worker_max_failures = 1: the kill also declares q3mp's engine dead, so q3mp is
    unloaded ("failed"), the daemon serves on, and the next request for q3mp loads it
    afresh (a worker restarted in place is test_faults.py's and test_mp_executor.py's)."""
    long = {"max_tokens": 200, "ignore_eos": True}
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "m", "prompt": "hi", "model": "q3mp", "sampling": {"max_tokens": 2}})
        finals(conn, ["m"])
        (worker,) = worker_pids(daemon)
        conn.send({"type": "submit", "id": "doomed", "prompt": "hi", "model": "q3mp", "sampling": long})
        conn.send({"type": "submit", "id": "fine", "prompt": "hi", "sampling": long})
        for _ in range(4):
            assert conn.recv()["type"] in ("accepted", "output")
        os.kill(worker, signal.SIGKILL)
        got = finals(conn, ["doomed", "fine"])
    assert got["doomed"][-1]["finish_reason"] == "error"
    assert got["doomed"][-1]["error"].startswith(f"worker process 0 (pid {worker}) exited with signal SIGKILL")
    assert got["fine"][-1]["finish_reason"] == "length" and got["fine"][-1]["usage"]["completion_tokens"] == 200
    failed = wait_state(daemon, "q3mp", "failed")
    assert "its engine is dead" in failed["error"] and worker_pids(daemon) == []
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "b", "prompt": "hi", "sampling": {"max_tokens": 3}})
        conn.send({"type": "submit", "id": "again", "prompt": "hi", "model": "q3mp", "sampling": {"max_tokens": 3}})
        got = finals(conn, ["b", "again"])
    assert all(got[i][-1]["usage"]["completion_tokens"] == 3 for i in ("b", "again"))
    assert models(daemon)["q3mp"]["state"] == "serving" and daemon.proc.poll() is None


def test_a_model_in_a_worker_process_sleeps_and_wakes_there(daemon):
    """q3mp runs in a worker process: asleep at either level the process stays (the sleep
    and wake messages reach its runner), and woken it answers as transformers does."""
    from hf_ref import hf_greedy

    ids = [5, 80, 113, 7, 301, 42]
    expected = hf_greedy(str(fixture_path("tiny-qwen3")), ids, MAX_TOKENS)[0]
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with Client(daemon.sock) as client:
        client.load("q3mp")
        (worker,) = worker_pids(daemon)
        for level in (1, 2):
            asleep = client.sleep("q3mp", level=level)
            assert asleep.state == "asleep" and asleep.sleep_level == level and asleep.memory.workers_rss > 0
            assert worker_pids(daemon) == [worker]
            with RawConn(daemon.sock) as conn:  # its request wakes it
                conn.send({"type": "submit", "id": "w", "token_ids": ids, "model": "q3mp", "sampling": greedy})
                assert tokens_of(finals(conn, ["w"])["w"]) == expected
    assert worker_pids(daemon) == [worker]


def test_unloading_gives_the_memory_back(daemon):
    """The daemon and its children's resident memory after an unload is back near where
    it was before the load (small-llama, 44M parameters, in the daemon's process: what
    its weights, 176 MB in float32, and its KV pool held); figures and the benchmark in
    docs/benchmarks.md (llmd_tools.bench_model_pool)."""
    with Client(daemon.sock) as client:
        before = settled_rss(daemon.proc.pid)
        status = client.load("small")
        client.generate("def f(x):", max_tokens=8, temperature=0, model="small")
        loaded = settled_rss(daemon.proc.pid)
        client.unload("small")
        after = settled_rss(daemon.proc.pid)
    assert status.state == "serving" and status.memory_bytes > 200 * MIB
    assert loaded - before > 150 * MIB  # it was really there (its weights alone: 168 MiB)
    # What stays is what a first load leaves for good (~8 MiB) and glibc's freed blocks it
    # cannot hand back. With an arena per thread the model thread's freed weights sat in its
    # heap's top, which malloc_trim leaves (up to 64 MiB, until the next unload: CI at 8bb4791
    # kept 70); the daemon runs with one arena (llmd.heap.one_arena, tests/test_heap.py).
    # Keeping the weights (168 MiB) still fails this.
    assert after - before < 32 * MIB, (before / MIB, loaded / MIB, after / MIB)


def test_llmctl_ps_load_and_unload(daemon):
    run = CliRunner().invoke
    shown = run(llmctl, ["--socket", daemon.sock, "ps"])
    assert shown.exit_code == 0 and shown.output.startswith("NAME")
    assert "base (default)" in shown.output and "brief" not in shown.output  # unloaded ones only with --all
    assert "brief" in run(llmctl, ["--socket", daemon.sock, "ps", "--all"]).output
    loaded = run(llmctl, ["--socket", daemon.sock, "load", "brief", "--keep-alive", "10m"])
    assert loaded.exit_code == 0, loaded.output
    assert "serving" in loaded.output and "(in 9m" in loaded.output
    assert models(daemon)["brief"]["state"] == "serving"
    gone = run(llmctl, ["--socket", daemon.sock, "unload", "brief"])
    assert gone.exit_code == 0 and "unloaded" in gone.output
    assert models(daemon)["brief"]["state"] == "unloaded"
    unknown = run(llmctl, ["--socket", daemon.sock, "load", "nope"])
    assert unknown.exit_code == 1 and "model_not_found" in unknown.output
    bad = run(llmctl, ["--socket", daemon.sock, "load", "brief", "--keep-alive", "soon"])
    assert bad.exit_code == 2 and "--keep-alive" in bad.output


def test_status_and_metrics_speak_of_every_model(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "status"})
        status = conn.recv()
        conn.send({"type": "metrics"})
        text = conn.recv()["text"]
    assert status["model"] == "base" and status["engine_state"] == "serving"
    assert [m["name"] for m in status["models"]] == ["base", "qwen", "q3mp", "brief", "small"]
    samples = {(s.name, s.labels.get("model_name"), s.labels.get("finished_reason")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("llmd:model_loaded", "qwen", None)] == 1 and samples[("llmd:model_loaded", "brief", None)] == 0
    assert samples[("llmd:request_success_total", "qwen", "length")] == 6  # 4 on the socket, 2 over HTTP
    assert samples[("llmd:model_loads_total", "q3mp", None)] == 2  # loaded, died, loaded again
    assert samples[("llmd:request_success_total", "q3mp", "error")] >= 1
