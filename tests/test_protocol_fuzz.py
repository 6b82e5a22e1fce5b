"""Property-based fuzzing of the socket protocol against the real daemon: hundreds of
malformed, mistyped and out-of-range messages (JSON lines and msgpack). For every one:
an `error` (or a valid reply), never a traceback, never the planted value echoed, no
KV block held afterwards, and the daemon still serves."""
from __future__ import annotations

import json
import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_util import Daemon, RawConn
from llmd_client.protocol import SamplingParams
from llmd_tools.make_model import fixture_path

MARKER = "QZXV-PLANTED-9931"
TYPES = ["submit", "abort", "status", "metrics", "hello", "nonsense", MARKER]
FIELDS = ["id", "prompt", "messages", "token_ids", "sampling", "stream", "priority", "cache_salt", "protocol_version",
          MARKER]
SAMPLING_FIELDS = list(SamplingParams.__struct_fields__) + [MARKER]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.just(MARKER),
                    st.just(MARKER * 50))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
sampling = st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=4)
messages = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES)},
    optional={name: (sampling if name == "sampling" else values) for name in FIELDS})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path_factory.mktemp("fuzz") / "llmd.sock").wait_ready()
    yield d
    assert d.stop() == 0, d.stderr()


def exchange(conn: RawConn, message: dict) -> list[dict]:
    """Send one message and read what comes back for it until a final reply: an error,
    a non-request reply, or (for an accepted request) its last output."""
    conn.send(message)
    replies = [conn.recv()]
    if replies[0]["type"] == "accepted":
        ident = replies[0]["id"]
        conn.send({"type": "abort", "id": ident})  # long random requests would only cost time
        replies += conn.until_final(ident)
    return replies


def check(replies: list[dict]) -> None:
    for reply in replies:
        text = json.dumps(reply)
        assert MARKER not in text, reply
        assert "Traceback" not in text


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(message=messages, json_mode=st.booleans())
def test_random_messages_get_clear_answers(daemon, message, json_mode):
    try:
        (msgspec.json if json_mode else msgspec.msgpack).encode(message)
    except (OverflowError, msgspec.EncodeError):
        return  # not representable in JSON: nothing a client could send
    with RawConn(daemon.sock, json_mode=json_mode) as conn:
        replies = exchange(conn, message)
        check(replies)
        if replies[0].get("code") != "unsupported_version":  # the one error that ends a connection
            check(exchange(conn, {"type": "status"}))  # the connection is still usable


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=200))
def test_random_bytes_never_crash(daemon, data):
    with RawConn(daemon.sock) as conn:
        frame = data if data[:1] == b"{" else struct.pack(">I", len(data)) + data
        conn.send_raw(frame + (b"\n" if data[:1] == b"{" else b""))
        conn.sock.settimeout(5)
        try:
            reply = conn.recv()
        except (ConnectionError, TimeoutError, msgspec.DecodeError, json.JSONDecodeError):
            return  # a frame it cannot read may end the connection; that is allowed
        check([reply])


def test_after_the_fuzzing_nothing_leaked(daemon):
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "submit", "id": "ok", "prompt": "still alive?", "sampling": {"max_tokens": 3}})
        assert conn.until_final("ok")[-1]["usage"]["completion_tokens"] == 3
        conn.send({"type": "status"})
        status = conn.recv()
    assert status["kv_blocks_used"] == 0 and status["num_running"] == status["num_waiting"] == 0
    log = daemon.stderr()
    assert "Traceback" not in log and MARKER not in log
