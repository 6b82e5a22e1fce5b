"""llmd_client's Client, AsyncClient and the llmctl command against the real daemon:
the same greedy text as the offline engine, through every path."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_util import Daemon
from llmd import LLM, SamplingParams
from llmd_client import AsyncClient, Client, DaemonNotRunning, RequestError
from llmd_tools.make_model import fixture_path

LLMCTL = str(Path(sys.executable).parent / "llmctl")  # CI does not activate the venv
PROMPT = "def parse(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-qwen3"))


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    d = Daemon(model, tmp_path_factory.mktemp("sock") / "llmd.sock").wait_ready()
    yield d
    assert d.stop() == 0, d.stderr()


@pytest.fixture(scope="module")
def offline(model) -> str:
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=128)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].text


def test_client_generate_and_stream_match_offline(daemon, offline):
    with Client(socket=daemon.sock) as client:
        result = client.generate(PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
        assert result.text == offline and result.finish_reason == "length"
        assert result.usage.completion_tokens == 20
        deltas = list(client.stream(PROMPT, max_tokens=20, temperature=0, ignore_eos=True))
        assert "".join(d.text for d in deltas) == offline
        assert deltas[-1].usage is not None
        status = client.status()
        assert status.num_running == 0


def test_async_client_concurrent(daemon, offline):
    async def main():
        async with AsyncClient(socket=daemon.sock) as client:
            results = await asyncio.gather(*[client.generate(PROMPT, max_tokens=20, temperature=0,
                                                             ignore_eos=True) for _ in range(8)])
            return [r.text for r in results]
    assert asyncio.run(main()) == [offline] * 8


def test_client_errors_are_exceptions(daemon, tmp_path):
    with Client(socket=daemon.sock) as client:
        with pytest.raises(RequestError) as err:
            client.generate(token_ids=[1, 10**9], max_tokens=2)
        assert err.value.code == "invalid_params"
        assert client.generate("still fine", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(DaemonNotRunning):
        Client(socket=str(tmp_path / "missing.sock")).status()


def test_breaking_a_stream_aborts_the_request(daemon):
    with Client(socket=daemon.sock) as client:
        for i, _ in enumerate(client.stream("hi", max_tokens=240, ignore_eos=True)):
            if i == 2:
                break
        deadline = time.monotonic() + 10
        while (status := client.status()).num_running and time.monotonic() < deadline:
            time.sleep(0.02)
        metrics = client.metrics()
    assert status.num_running == 0 and status.num_waiting == 0 and status.kv_blocks_used == 0
    # Every finish reason is exposed from the start (at 0), so read the abort count itself.
    aborted = [s.value for family in text_string_to_metric_families(metrics) for s in family.samples
               if s.name == "llmd:request_success_total" and s.labels["finished_reason"] == "abort"]
    assert aborted and aborted[0] >= 1


def llmctl(daemon, *args, **kwargs):
    return subprocess.run([LLMCTL, "--socket", daemon.sock, *args], capture_output=True, text=True,
                          timeout=60, **kwargs)


def test_llmctl_submit_status_metrics(daemon, offline):
    out = llmctl(daemon, "submit", PROMPT, "--max-tokens", "20", "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    # ignore_eos is not a CLI flag: equal up to where the model may have emitted EOS.
    text = json.loads(out.stdout)["text"]
    assert offline.startswith(text)
    piped = llmctl(daemon, "submit", "--max-tokens", "20", "--temperature", "0", "--no-stream", input=PROMPT)
    assert piped.returncode == 0 and piped.stdout.rstrip("\n") == text
    status = llmctl(daemon, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["kv_blocks_total"] == 128
    reply = json.loads(status.stdout)
    memory = reply["memory"]  # the model runs in the daemon's process (no workers)
    assert memory["workers_rss"] is None and reply["rss_bytes"] > memory["weights"]["float32"] > 0
    assert memory["kv_cache"] % 128 == 0 and 0 <= memory["kv_cache_used"] <= memory["kv_cache"]
    shown = llmctl(daemon, "status").stdout
    assert "weights      " in shown and "float32" in shown and "other        " in shown, shown
    metrics = llmctl(daemon, "metrics")
    assert metrics.returncode == 0 and "llmd:generation_tokens_total" in metrics.stdout
    weights = {s.labels["storage"]: s.value for family in text_string_to_metric_families(metrics.stdout)
               if family.name == "llmd:model_weights_bytes" for s in family.samples}
    assert weights == memory["weights"]
    bad = llmctl(daemon, "abort", "r999999")
    assert bad.returncode == 1 and "unknown_id" in bad.stderr and "Traceback" not in bad.stderr


def test_prompt_logprobs_are_returned(daemon, model):
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=64)
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    with Client(socket=daemon.sock) as client:
        result = client.generate(PROMPT, temperature=0, max_tokens=2, prompt_logprobs=3)
        streamed = list(client.stream(PROMPT, temperature=0, max_tokens=2, prompt_logprobs=3))
    assert streamed[-1].prompt_logprobs == result.prompt_logprobs
    got = result.prompt_logprobs
    assert len(got) == len(ref.prompt_token_ids) and got[0] == []
    for position, expected, token in zip(got[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
        assert position[0].token_id == token
        assert position[0].logprob == pytest.approx(expected[token].logprob, abs=1e-4)
        assert {t.token_id for t in position} == set(expected)


def test_llmctl_sampling_flags_match_the_client(daemon):
    flags = ["--temperature", "0.7", "--top-k", "20", "--min-p", "0.05", "--seed", "3", "--presence-penalty", "0.5",
             "--repetition-penalty", "1.2", "--ignore-eos", "--max-tokens", "12", "--logprobs", "2"]
    out = llmctl(daemon, "submit", PROMPT, *flags, "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    with Client(socket=daemon.sock) as client:
        ref = client.generate(PROMPT, temperature=0.7, top_k=20, min_p=0.05, seed=3, presence_penalty=0.5,
                              repetition_penalty=1.2, ignore_eos=True, max_tokens=12, logprobs=2)
    assert got["token_ids"] == ref.token_ids and got["finish_reason"] == "length"
    assert len(got["outputs"][0]["logprobs"]) == 12
    bad = llmctl(daemon, "submit", PROMPT, "--min-p", "3")
    assert bad.returncode == 2 and "--min-p" in bad.stderr


def test_llmctl_exit_codes_for_abort_and_limits(model, tmp_path):
    """`llmctl abort` of a running request exits 0 and its submitter 4; a request past
    max_model_len exits 1 naming both. A daemon of its own, whose request runs 1,000
    tokens: the abort is a new llmctl process, and on a loaded machine the module's
    daemon (max_model_len 256) finished 240 tokens before it arrived."""
    d = Daemon(model, tmp_path / "a.sock", "--max-model-len", "1024").wait_ready()
    proc = None
    try:
        proc = subprocess.Popen([LLMCTL, "--socket", d.sock, "submit", "hi", "--max-tokens", "1000", "--ignore-eos",
                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        with Client(socket=d.sock) as client:
            while not (running := client.status().requests):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.01)
        aborted = llmctl(d, "abort", running[0].request_id)
        assert aborted.returncode == 0, aborted.stderr
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 4 and "aborted" in stderr
        assert json.loads(stdout)["finish_reason"] == "abort"
        too_long = llmctl(d, "submit", "hi", "--max-tokens", "5000")
        assert too_long.returncode == 1 and "max_model_len (1024)" in too_long.stderr and "5000" in too_long.stderr
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        assert d.stop() == 0, d.stderr()


def test_llmctl_chat_keeps_the_conversation(daemon):
    out = llmctl(daemon, "chat", "--temperature", "0", "--max-tokens", "6", "--system", "Be brief.",
                 input="hello there\nand again\n")
    assert out.returncode == 0, out.stderr
    with Client(socket=daemon.sock) as client:
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
        first = client.chat(history, temperature=0, max_tokens=6).text
        history += [{"role": "assistant", "content": first}, {"role": "user", "content": "and again"}]
        second = client.chat(history, temperature=0, max_tokens=6).text
    assert out.stdout == f"{first}\n{second}\n"


def test_llmctl_without_daemon_says_so(tmp_path):
    out = subprocess.run([LLMCTL, "--socket", str(tmp_path / "none.sock"), "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3
    assert len(out.stderr.strip().splitlines()) == 1 and "llmd serve" in out.stderr


def test_prometheus_text_parses(daemon):
    with Client(socket=daemon.sock) as client:
        client.generate("x", max_tokens=3)
        text = client.metrics()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "llmd:time_to_first_token_seconds" in families


def test_status_counts_generated_tokens_and_top_refreshes(daemon):
    # A fast machine finishes one 240-token request before llmctl has even started, so
    # a thread keeps requests streaming until `top` has drawn its frames.
    stop, ids = threading.Event(), []

    def keep_streaming():
        with Client(socket=daemon.sock) as c:
            while not stop.is_set():
                s = c.stream("hello", max_tokens=240, ignore_eos=True)
                ids.append(s.request_id)
                for _ in s:
                    if stop.is_set():
                        s.close()
                        break

    thread = threading.Thread(target=keep_streaming, daemon=True)
    thread.start()
    try:
        deadline, running = time.monotonic() + 30, []
        with Client(socket=daemon.sock) as client:
            while not running and time.monotonic() < deadline:
                running = [r for r in client.status().requests
                           if r.request_id in ids and r.completion_tokens >= 5]
        assert running, "status never showed a running request with its generated tokens"
        top = subprocess.run([LLMCTL, "--socket", daemon.sock, "top", "-n", "2", "--interval", "0.05"],
                             capture_output=True, text=True, timeout=60)
    finally:
        stop.set()
        thread.join(30)
    assert top.returncode == 0, top.stderr
    assert top.stdout.count("throughput") == 2 and any(i in top.stdout for i in ids)
