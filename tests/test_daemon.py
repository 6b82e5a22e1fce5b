"""End to end: the real `llmd serve` subprocess on a temporary socket, driven with raw
frames. Streamed text == non-streamed text == the offline engine; bad input gets a
clear Error and the daemon keeps serving; closing a connection aborts its requests and
frees their blocks; SIGTERM drains."""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_util import Daemon, RawConn
from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path

PROMPTS = ["def parse(path):", "import os\nimport sys\n", "中文と日本語 🎉", "class Config:"]


@pytest.fixture(scope="module")
def model() -> str:
    return str(fixture_path("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    d = Daemon(model, tmp_path_factory.mktemp("sock") / "llmd.sock").wait_ready()
    yield d
    assert d.stop() == 0, d.stderr()


def submit(conn: RawConn, ident: str, prompt: str, stream: bool = True, **sampling) -> list[dict]:
    conn.send({"type": "submit", "id": ident, "prompt": prompt, "stream": stream, "sampling": sampling})
    return conn.until_final(ident)


def text_of(messages: list[dict], index: int = 0) -> str:
    return "".join(m.get("text", "") for m in messages if m["type"] == "output" and m.get("index", 0) == index)


def status(path: str) -> dict:
    with RawConn(path) as conn:
        conn.send({"type": "status"})
        return conn.recv()


def wait_idle(path: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = status(path)
        if (s["num_running"], s["num_waiting"], s["kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def test_streamed_equals_unstreamed_equals_offline_engine(daemon, model):
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    offline = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    with RawConn(daemon.sock) as conn:
        for i, prompt in enumerate(PROMPTS):
            streamed = submit(conn, f"s{i}", prompt, temperature=0, max_tokens=24, ignore_eos=True)
            whole = submit(conn, f"w{i}", prompt, stream=False, temperature=0, max_tokens=24, ignore_eos=True)
            assert streamed[0]["type"] == "accepted" and whole[0]["type"] == "accepted"
            assert len(streamed) > 3  # really streamed
            assert len([m for m in whole if m["type"] == "output"]) == 1
            assert text_of(streamed) == text_of(whole) == offline[i].text
            tokens = [t for m in streamed if m["type"] == "output" for t in m.get("token_ids", [])]
            assert tokens == offline[i].token_ids
            final = streamed[-1]
            assert final["finish_reason"] == "length"
            assert final["usage"]["completion_tokens"] == 24


def test_json_lines_mode_same_schema(daemon):
    with RawConn(daemon.sock, json_mode=True) as conn:
        conn.send({"type": "hello", "protocol_version": 1})
        assert conn.recv()["type"] == "welcome"
        out = submit(conn, "j", "hello", temperature=0, max_tokens=5)
        assert out[-1]["usage"]["completion_tokens"] == 5


def test_many_requests_multiplex_on_one_connection(daemon):
    with RawConn(daemon.sock) as conn:
        for i in range(8):
            conn.send({"type": "submit", "id": f"m{i}", "prompt": PROMPTS[i % 4],
                       "sampling": {"temperature": 0, "max_tokens": 10, "ignore_eos": True}})
        finished = set()
        while len(finished) < 8:
            m = conn.recv()
            if m.get("usage"):
                finished.add(m["id"])
    assert finished == {f"m{i}" for i in range(8)}


def test_64_concurrent_streaming_connections(daemon):
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with RawConn(daemon.sock) as conn:
                out = submit(conn, "x", PROMPTS[i % 4], temperature=0.8, seed=i, max_tokens=16, ignore_eos=True)
                assert out[-1]["usage"]["completion_tokens"] == 16
                results[i] = text_of(out)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert len(results) == 64
    assert wait_idle(daemon.sock)["kv_blocks_used"] == 0


def _assert_serves(path: str) -> None:
    with RawConn(path) as conn:
        out = submit(conn, "ok", "still alive?", temperature=0, max_tokens=3)
        assert out[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("payload, code", [
    ({"type": "nonsense"}, "bad_request"),
    ({"type": "submit", "prompt": "x", "sampling": {"top_p": 7}}, "invalid_params"),
    ({"type": "submit", "prompt": "x", "sampling": {"temperature": -1}}, "invalid_params"),
    ({"type": "submit", "prompt": "x", "sampling": {"no_such_field": 1}}, "invalid_params"),
    ({"type": "submit", "prompt": ""}, "invalid_params"),
    ({"type": "submit", "prompt": "word " * 400}, "invalid_params"),
    ({"type": "submit", "token_ids": [1, 10**9]}, "invalid_params"),
    ({"type": "submit"}, "bad_request"),
    ({"type": "submit", "prompt": "a", "token_ids": [1]}, "bad_request"),
    ({"type": "abort", "id": "nope"}, "unknown_id"),
    ({"type": "hello", "protocol_version": 99}, "unsupported_version"),
])
def test_bad_messages_get_clear_errors(daemon, payload, code):
    with RawConn(daemon.sock) as conn:
        conn.send(payload)
        reply = conn.recv()
        assert reply["type"] == "error" and reply["code"] == code, reply
        assert "Traceback" not in reply["message"] and len(reply["message"]) < 400
    _assert_serves(daemon.sock)


@pytest.mark.parametrize("payload, expected", [
    ({"type": "submit", "prompt": "hi", "max_tokens": 3}, "unknown field `max_tokens`: sampling fields go in `sampling`"),
    ({"prompt": "hi"}, "unknown or missing message type"),
    ({"type": "submit", "prompt": "hi", "sampling": {"maxtokens": 3}}, "unknown field `maxtokens` - at `$.sampling`"),
    ({"type": "submit", "prompt": "hi", "sampling": {"max_tokens": "many"}}, "got `str` - at `$.sampling.max_tokens`"),
    ({"type": "submit", "prompt": "hi", "a`SECRET`b": 1}, "unknown field `<value>`"),
])
def test_error_messages_name_the_field_not_the_value(daemon, payload, expected):
    with RawConn(daemon.sock, json_mode=True) as conn:
        conn.send(payload)
        reply = conn.recv()
    assert reply["type"] == "error" and expected in reply["message"], reply
    assert "many" not in reply["message"] and "SECRET" not in reply["message"]


def test_garbage_frame_then_connection_still_usable(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send_raw(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
        reply = conn.recv()
        assert reply["code"] == "bad_frame"
        out = submit(conn, "after", "hello", temperature=0, max_tokens=2)
        assert out[-1]["usage"]["completion_tokens"] == 2


def test_invalid_utf8_in_json_mode(daemon):
    with RawConn(daemon.sock, json_mode=True) as conn:
        conn.send_raw(b'{"type": "submit", "prompt": "\xff\xfe"}\n')
        assert conn.recv()["code"] == "bad_frame"
        out = submit(conn, "after", "hello", temperature=0, max_tokens=2)
        assert out[-1]["usage"]["completion_tokens"] == 2


def test_oversized_and_truncated_frames(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send_raw(struct.pack(">I", 1 << 30))
        assert conn.recv()["code"] == "bad_frame"
        with pytest.raises(ConnectionError):
            conn.recv()  # the stream cannot be resynchronised: closed
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(daemon.sock)
    raw.sendall(struct.pack(">I", 100) + b"\x81\xa4type")  # then hang up mid-frame
    raw.close()
    _assert_serves(daemon.sock)


def test_user_input_never_echoed(daemon):
    marker = "ZQXJ-SECRET-7781"
    with RawConn(daemon.sock) as conn:
        for payload in ({"type": marker}, {"type": "submit", "prompt": "x", "sampling": {"stop": {marker: 1}}},
                        {"type": "submit", "prompt": "x", "sampling": {marker: 1}},
                        {"type": "abort", "id": marker}):
            conn.send(payload)
            reply = conn.recv()
            assert reply["type"] == "error" and marker not in reply["message"] and marker not in str(reply.get("id", ""))[:0]
    assert marker not in daemon.stderr()


ASYNC = pytest.mark.parametrize("extra", [(), ("--async-scheduling",)], ids=["sync", "async"])


@ASYNC
def test_closing_connection_aborts_prefill_and_decode(model, tmp_path, extra):
    # A tiny step budget turns a long prompt into many prefill chunks.
    d = Daemon(model, tmp_path / "s.sock", "--max-num-batched-tokens", "8", *extra).wait_ready()
    try:
        with RawConn(d.sock) as conn:  # closed right after acceptance: during prefill
            conn.send({"type": "submit", "id": "p", "token_ids": [5] * 200,
                       "sampling": {"max_tokens": 50, "ignore_eos": True}})
            assert conn.recv()["type"] == "accepted"
        with RawConn(d.sock) as conn:  # closed after a few streamed tokens: during decode
            conn.send({"type": "submit", "id": "d", "prompt": "hi",
                       "sampling": {"max_tokens": 200, "ignore_eos": True}})
            seen = 0
            while seen < 3:
                seen += conn.recv()["type"] == "output"
        s = wait_idle(d.sock)
        assert (s["num_running"], s["num_waiting"], s["kv_blocks_used"]) == (0, 0, 0)

        def aborted() -> list[float]:
            with RawConn(d.sock) as conn:
                conn.send({"type": "metrics"})
                text = conn.recv()["text"]
            return [s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "llmd:request_success_total" and s.labels["finished_reason"] == "abort"]

        # A request's end reaches the metrics from the detokenizer, after the scheduler that
        # status reads has let it go: on a loaded machine the count may lag the idle status.
        deadline = time.monotonic() + 10
        while (counted := aborted()) != [2.0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counted == [2.0]
        _assert_serves(d.sock)
    finally:
        assert d.stop() == 0, d.stderr()


def test_abort_by_id_gets_final_message(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "long", "prompt": "hi", "sampling": {"max_tokens": 200, "ignore_eos": True}})
        assert conn.recv()["type"] == "accepted"
        conn.send({"type": "abort", "id": "long"})
        final = conn.until_final("long")[-1]
        assert final["finish_reason"] == "abort"
        assert final["usage"]["completion_tokens"] < 200
    assert wait_idle(daemon.sock)["kv_blocks_used"] == 0


@ASYNC
def test_sigterm_drains_running_requests(model, tmp_path, extra):
    d = Daemon(model, tmp_path / "s.sock", *extra).wait_ready()
    with RawConn(d.sock) as conn:
        conn.send({"type": "submit", "id": "a", "prompt": "hi", "sampling": {"max_tokens": 60, "ignore_eos": True}})
        assert conn.recv()["type"] == "accepted"
        d.proc.send_signal(signal.SIGTERM)
        final = conn.until_final("a")[-1]
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 60
    assert d.proc.wait(30) == 0
    assert not os.path.exists(d.sock)


def test_new_clients_during_drain_are_told_it_is_shutting_down(model, tmp_path):
    d = Daemon(model, tmp_path / "s.sock", "--drain-timeout-s", "60", "--max-model-len", "1024").wait_ready()
    with RawConn(d.sock) as conn:  # long enough to outlast the late client even on a fast machine
        conn.send({"type": "submit", "id": "a", "prompt": "hi", "sampling": {"max_tokens": 1000, "ignore_eos": True}})
        assert conn.recv()["type"] == "accepted"
        conn.recv()  # running
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with RawConn(d.sock) as late:  # still connects: told why, not "not running"
            late.send({"type": "submit", "id": "b", "prompt": "hi"})
            reply = late.recv()
            assert reply["code"] == "shutting_down", reply
        assert conn.until_final("a")[-1]["finish_reason"] == "length"
    assert d.proc.wait(30) == 0


def test_odd_inputs_get_the_right_answer(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "x" * (1 << 20), "prompt": "hi"})
        reply = conn.recv()
        assert reply["code"] == "bad_request" and "id" not in reply and len(reply["message"]) < 100
        # Per-sample seeds wrap instead of overflowing.
        conn.send({"type": "submit", "id": "s", "prompt": "hi", "stream": False,
                   "sampling": {"n": 4, "seed": 2**63 - 1, "max_tokens": 2}})
        replies = conn.until_final("s")
        assert replies[0]["type"] == "accepted" and replies[-1]["usage"]["completion_tokens"] == 8
        # A prompt that cannot fit is refused before it is tokenized.
        started = time.monotonic()
        conn.send({"type": "submit", "id": "big", "prompt": "word " * (1 << 20)})
        reply = conn.recv()
        assert reply["code"] == "invalid_params" and "too long" in reply["message"]
        assert time.monotonic() - started < 2.0


@ASYNC
def test_sigterm_aborts_what_outlasts_the_drain_timeout(model, tmp_path, extra):
    # The tiny model makes 1000 tokens in ~0.8 s at batch 1 (C++ layers on a Zen 4 core).
    d = Daemon(model, tmp_path / "s.sock", "--drain-timeout-s", "0.2", "--max-model-len", "1024", *extra).wait_ready()
    with RawConn(d.sock) as conn:
        conn.send({"type": "submit", "id": "a", "prompt": "hi",
                   "sampling": {"max_tokens": 1000, "ignore_eos": True}})
        assert conn.recv()["type"] == "accepted"
        conn.recv()
        d.proc.send_signal(signal.SIGTERM)
        final = conn.until_final("a")[-1]
        assert final["finish_reason"] == "abort"
    assert d.proc.wait(30) == 0


def test_requests_during_model_load_wait_not_refused(model, tmp_path):
    path = tmp_path / "s.sock"
    d = Daemon(model, path)
    deadline = time.monotonic() + 30
    while not path.exists():  # the socket exists before the model is loaded
        assert time.monotonic() < deadline and d.proc.poll() is None, d.stderr()
        time.sleep(0.01)
    try:
        with RawConn(str(path), timeout=60) as conn:
            out = submit(conn, "early", "hello", temperature=0, max_tokens=3)
            assert out[-1]["usage"]["completion_tokens"] == 3
    finally:
        assert d.stop() == 0


def test_second_daemon_refuses_live_socket(model, daemon):
    proc = subprocess.run([sys.executable, "-m", "llmd.cli", "serve", "--model", model, "--socket", daemon.sock],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "already listening" in proc.stderr and "Traceback" not in proc.stderr


def test_status_answers_while_a_long_prefill_runs(tmp_path):
    """Ordering, not timing: a status asked after a long prompt was accepted comes back
    before that prompt's first token (the step runs off the event loop)."""
    d = Daemon(str(fixture_path("small-llama")), tmp_path / "s.sock", "--max-model-len", "2048",
               "--max-num-batched-tokens", "2048").wait_ready()
    try:
        with RawConn(d.sock) as long_conn, RawConn(d.sock) as status_conn:
            long_conn.send({"type": "submit", "id": "big", "token_ids": [7] * 1900,
                            "sampling": {"max_tokens": 1}})
            assert long_conn.recv()["type"] == "accepted"
            status_conn.send({"type": "status"})
            reply = status_conn.recv()
            assert reply["type"] == "status_reply"
            long_conn.sock.setblocking(False)
            try:
                pending = long_conn.sock.recv(1)
            except BlockingIOError:
                pending = b""
            assert pending == b"", "the prefill finished before status was answered"
            long_conn.sock.setblocking(True)
            assert long_conn.until_final("big")[-1]["usage"]["completion_tokens"] == 1
    finally:
        assert d.stop() == 0, d.stderr()


def test_status_during_the_load_says_how_far(tmp_path):
    """The socket answers status while the model loads: engine_state "loading" with the
    phase and a fraction that only grows; a request sent meanwhile is served after."""
    from llmd_client.llmctl import format_status
    from llmd_client.protocol import StatusReply

    path = tmp_path / "s.sock"
    d = Daemon(str(fixture_path("small-llama")), path)
    seen = []
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert time.monotonic() < deadline and d.proc.poll() is None
            time.sleep(0.01)
        old_client = RawConn(str(path))  # an unknown protocol version is refused, not welcomed
        old_client.send({"type": "hello", "protocol_version": 99})
        with RawConn(str(path)) as waiting:
            waiting.send({"type": "submit", "id": "early", "prompt": "hi", "sampling": {"max_tokens": 3}})
            while True:
                with RawConn(str(path)) as conn:
                    conn.send({"type": "status"})
                    reply = conn.recv()
                seen.append((reply["engine_state"], reply.get("load_progress"), reply.get("load_phase")))
                if reply["engine_state"] != "loading":
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert waiting.until_final("early")[-1]["usage"]["completion_tokens"] == 3
        with old_client:
            assert old_client.recv()["code"] == "unsupported_version"
        loading = [s for s in seen if s[0] == "loading"]
        assert loading and seen[-1][0] == "serving"
        fractions = [f for _, f, _ in loading]
        assert fractions == sorted(fractions) and 0.0 <= fractions[0] and fractions[-1] <= 1.0
        shown = format_status(msgspec.convert({**reply, "engine_state": "loading", "load_progress": 0.42,
                                               "load_phase": "weights"}, StatusReply))
        assert "loading (42%: weights)" in shown
    finally:
        assert d.stop() == 0, d.stderr()
