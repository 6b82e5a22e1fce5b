"""The Python clients (blocking and asyncio) and socket discovery, against the scripted
fake daemon (fake_daemon.py: it echoes the prompt word by word, so every expected text is
known independently of the client code; the real daemon is exercised by the end-to-end
tests)."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

import llmd_client
from llmd_client import (AsyncClient, Client, ClientTimeout, ConnectionLost, DaemonNotRunning, LlmdError,
                         ProtocolError, RequestError, SamplingParams)
from llmd_client import socket_path as socket_path_module
from llmd_client.protocol import Abort, Submit, TokenLogprob, Usage

from fake_daemon import METRICS_TEXT, client, daemon, run_async, short_dir  # noqa: F401


# -- the blocking client ----------------------------------------------------------------------

def test_generate_returns_the_whole_text_usage_and_ids(client, daemon):
    result = client.generate("the quick brown fox", max_tokens=10)
    assert result.text == "the quick brown fox"
    assert result.token_ids == [4, 6, 6, 3]  # the fake's token id is the piece's length
    assert result.finish_reason == "stop"
    assert result.usage == Usage(prompt_tokens=4, completion_tokens=4)
    assert result.request_id.startswith("req-") and result.prompt_tokens == 4
    submit = daemon.messages(Submit)[-1]
    assert submit.stream is False and submit.sampling.max_tokens == 10
    assert client.welcome.model == "fake-model"


def test_stream_deltas_concatenate_to_the_generated_text(client):
    prompt = "one two three four five six"
    deltas = list(client.stream(prompt, max_tokens=4))
    assert [d.text for d in deltas] == ["one ", "two ", "three ", "four "]
    assert "".join(d.text for d in deltas) == client.generate(prompt, max_tokens=4).text
    assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
    assert [d.usage for d in deltas[:-1]] == [None] * 3
    assert deltas[-1].usage == Usage(prompt_tokens=6, completion_tokens=4)


def test_n_samples_each_get_their_own_output(client):
    result = client.generate("a b", n=3)
    assert [(c.index, c.text, c.finish_reason) for c in result.outputs] == [
        (0, "[0] a b", "stop"), (1, "[1] a b", "stop"), (2, "[2] a b", "stop")]
    assert result.text == "[0] a b" and result.usage.completion_tokens == 9

    by_index: dict[int, str] = {}
    deltas = list(client.stream("a b", n=2))
    for d in deltas:
        by_index[d.index] = by_index.get(d.index, "") + d.text
    assert by_index == {0: "[0] a b", 1: "[1] a b"}
    assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1]
    assert [d.usage is not None for d in deltas].count(True) == 1 and deltas[-1].usage is not None


def test_logprobs_add_up_per_token(client):
    result = client.generate("alpha be", logprobs=1)
    assert result.logprobs == [[TokenLogprob(6, 0.0, 1)], [TokenLogprob(2, -0.25, 1)]]
    deltas = list(client.stream("alpha be", logprobs=1))
    assert [lp[0].token_id for d in deltas for lp in d.logprobs or []] == [6, 2]
    assert client.generate("alpha be").logprobs is None


def test_sampling_settings_reach_the_daemon(client, daemon):
    client.generate("x", temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=["\n"], logprobs=2, priority=3,
                    min_p=0.1, repetition_penalty=1.2)
    submit = daemon.messages(Submit)[-1]
    assert submit.priority == 3
    assert submit.sampling == SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=["\n"],
                                             logprobs=2, min_p=0.1, repetition_penalty=1.2)
    base = SamplingParams(temperature=0.0, max_tokens=3, stop="END")
    client.generate("x", sampling=base, max_tokens=5)
    assert daemon.messages(Submit)[-1].sampling == SamplingParams(temperature=0.0, max_tokens=5, stop=["END"])


def test_bad_arguments_fail_before_anything_is_sent(client, daemon):
    sent = len(daemon.messages(Submit))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        client.generate("x", temperature=-1)
    with pytest.raises(TypeError):
        client.generate("x", not_a_setting=1)
    with pytest.raises(ValueError, match="exactly one of prompt, messages or token_ids"):
        client.generate("x", token_ids=[1, 2])
    with pytest.raises(ValueError, match="exactly one"):
        client.generate()
    assert len(daemon.messages(Submit)) == sent


def test_chat_messages_and_token_ids(client, daemon):
    result = client.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}])
    assert result.text == "hi there"
    assert [m.role for m in daemon.messages(Submit)[-1].messages] == ["system", "user"]
    assert client.generate(token_ids=[5, 6]).text == "t5 t6"
    with pytest.raises(ValueError, match="role"):
        client.chat([{"content": "no role"}])


def test_breaking_out_of_a_stream_aborts_it_and_the_client_goes_on(client, daemon):
    for i, delta in enumerate(client.stream("FOREVER", max_tokens=100_000)):
        assert delta.text == "tick "
        if i == 2:
            break
    submitted = daemon.last_submit()
    daemon.wait_for(lambda: submitted in daemon.aborted())  # by the connection's own id
    daemon.wait_for(lambda: not daemon.running)
    assert client.generate("still works").text == "still works"  # the late abort Output is dropped


def test_a_finished_stream_is_not_aborted(client, daemon):
    aborts = len(daemon.messages(Abort))
    with client.stream("short one") as stream:
        assert "".join(d.text for d in stream) == "short one"
    client.status()  # a round trip: an Abort sent before it would have arrived
    assert len(daemon.messages(Abort)) == aborts


def test_interleaved_streams_on_one_client(client):
    a = client.stream("a1 a2 a3")
    b = client.stream("b1 b2")
    first_a = next(a)
    assert "".join(d.text for d in b) == "b1 b2"
    assert first_a.text + "".join(d.text for d in a) == "a1 a2 a3"


def test_errors_map_to_exceptions_with_codes(client, daemon):
    with pytest.raises(RequestError) as info:
        client.generate("TOOLONG")
    assert info.value.code == "too_long" and "limit is 2048" in info.value.message
    with pytest.raises(RequestError) as info:
        list(client.stream("MIDERROR and more"))
    assert info.value.code == "internal"
    with pytest.raises(RequestError) as info:
        client.abort("req-nope")
    assert info.value.code == "unknown_id"
    with pytest.raises(RequestError) as info:
        client.abort("req-forbidden")
    assert info.value.code == "forbidden"
    assert isinstance(info.value, LlmdError)
    assert client.generate("fine").text == "fine"


def test_a_dropped_connection_raises_connection_lost_then_reconnects(client, daemon):
    with pytest.raises(ConnectionLost):
        client.generate("DROP")
    assert client.generate("back again").text == "back again"


def test_abort_by_request_id_from_another_connection(client, daemon):
    stream = client.stream("FOREVER", max_tokens=100_000)
    with Client(daemon.path, timeout=5) as other:
        other.abort(stream.request_id)
    deltas = list(stream)
    assert deltas[-1].finish_reason == "abort" and deltas[-1].usage is not None


def test_timeout_aborts_the_request(daemon):
    with Client(daemon.path, timeout=0.1) as slow:
        with pytest.raises(ClientTimeout):
            slow.generate("FOREVER", max_tokens=100_000)  # not streamed: nothing comes for ages
        submitted = daemon.last_submit()
        daemon.wait_for(lambda: submitted in daemon.aborted())
        assert slow.generate("on time").text == "on time"


def test_the_client_package_imports_neither_torch_nor_the_daemon():
    code = ("import sys, llmd_client, llmd_client.llmctl\n"
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'xgrammar', 'llmd')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unsupported_protocol_version_is_a_protocol_error(daemon):
    daemon.reject_version = True
    try:
        with pytest.raises(ProtocolError) as info:
            Client(daemon.path).status()
        assert info.value.code == "unsupported_version"
    finally:
        daemon.reject_version = False


def test_status_and_metrics(client):
    status = client.status()
    assert status.model == "fake-model" and status.kv_blocks_total == 512
    assert client.metrics() == METRICS_TEXT


# -- the asyncio client -----------------------------------------------------------------------

def test_async_concurrent_requests_share_one_connection(daemon):
    prompts = [f"prompt {i} " + "word " * i for i in range(8)]

    async def main():
        async with AsyncClient(daemon.path) as llm:
            async def streamed(p):
                return "".join([d.text async for d in llm.stream(p, max_tokens=50)])
            results = await asyncio.gather(*(llm.generate(p, max_tokens=50) for p in prompts),
                                           *(streamed(p) for p in prompts), llm.status(), llm.metrics())
            return results

    results = run_async(main())
    expected = [" ".join(p.split()) for p in prompts]
    assert [r.text.strip() for r in results[:8]] == expected
    assert [t.strip() for t in results[8:16]] == expected
    assert results[16].model == "fake-model" and results[17] == METRICS_TEXT
    submits = [(c, m) for c, m in daemon.received if isinstance(m, Submit) and m.prompt in prompts]
    assert len(submits) == 16 and len({c for c, _ in submits}) == 1


def test_async_break_and_cancel_send_abort(daemon):
    async def main():
        async with AsyncClient(daemon.path) as llm:
            async for _ in llm.stream("FOREVER", max_tokens=100_000):
                break
            broken = daemon.last_submit()
            streaming = asyncio.Event()

            async def consume():
                async for _ in llm.stream("FOREVER", max_tokens=100_000):
                    streaming.set()
            task = asyncio.create_task(consume())
            await streaming.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled = daemon.last_submit()
            assert (await llm.generate("after")).text == "after"
            return broken, cancelled

    broken, cancelled = run_async(main())
    assert broken != cancelled
    daemon.wait_for(lambda: {broken, cancelled} <= daemon.aborted())


def test_async_errors(daemon, short_dir):
    async def main():
        async with AsyncClient(daemon.path) as llm:
            with pytest.raises(RequestError) as info:
                await llm.generate("TOOLONG")
            assert info.value.code == "too_long"
            with pytest.raises(RequestError) as info:
                await llm.abort("req-nope")
            assert info.value.code == "unknown_id"
            with pytest.raises(ConnectionLost):
                await llm.generate("DROP")
            assert (await llm.generate("reconnected")).text == "reconnected"
        with pytest.raises(DaemonNotRunning):
            await AsyncClient(os.path.join(short_dir, "missing.sock")).status()

    run_async(main())


# -- socket discovery ---------------------------------------------------------------------------

def test_socket_discovery_order(monkeypatch, tmp_path):
    system = tmp_path / "system.sock"
    monkeypatch.setattr(socket_path_module, "SYSTEM_SOCKET", str(system))
    monkeypatch.setenv("LLMD_SOCKET", "/env/llmd.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert socket_path_module.default_socket_path("/explicit.sock") == "/explicit.sock"
    assert socket_path_module.default_socket_path() == "/env/llmd.sock"
    monkeypatch.delenv("LLMD_SOCKET")
    assert socket_path_module.default_socket_path() == "/run/user/1000/llmd.sock"
    system.touch()
    assert socket_path_module.default_socket_path() == str(system)
    system.unlink()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert socket_path_module.default_socket_path() == str(system)
    assert Client().socket_path == str(system)
    assert llmd_client.default_socket_path is socket_path_module.default_socket_path


def test_daemon_not_running_names_the_path_and_how_to_start(short_dir):
    missing = os.path.join(short_dir, "missing.sock")
    with pytest.raises(DaemonNotRunning) as info:
        Client(missing).generate("x")
    message = str(info.value)
    assert missing in message and "llmd serve" in message and "systemctl start llmd" in message
    assert info.value.code == "daemon_not_running"

    stale = os.path.join(short_dir, "stale.sock")  # a socket file nobody listens on
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    with pytest.raises(DaemonNotRunning, match="nothing listening"):
        Client(stale).status()
