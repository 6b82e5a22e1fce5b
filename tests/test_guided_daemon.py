"""Guided decoding through the daemon: the protocol fields, the Python client, llmctl's
flags; bad specs refused at intake without echoing them; a grammar that compiles too
slowly fails alone while other requests stream on."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from daemon_util import Daemon, RawConn
from llmd_client import Client, GuidedDecodingParams, RequestError
from llmd_tools.make_model import fixture_path
from test_guided import ARITHMETIC, PERSON, SLOW_SCHEMA, arithmetic_valid

LLMCTL = str(Path(sys.executable).parent / "llmctl")  # CI does not activate the venv


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path_factory.mktemp("sock") / "llmd.sock",
               "--guided-decoding-compile-timeout-s", "0.3").wait_ready()
    yield d
    assert d.stop() == 0, d.stderr()


def llmctl(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LLMCTL, "--socket", daemon.sock, "submit", *args], capture_output=True,
                          text=True, timeout=60)


def test_client_json_schema_and_dict_form(daemon):
    with Client(socket=daemon.sock) as client:
        result = client.generate("A person:", max_tokens=200, temperature=0.8, seed=3,
                                 guided=GuidedDecodingParams(json_schema=PERSON))
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), PERSON)
        streamed = list(client.stream("A person:", max_tokens=200, temperature=0.8, seed=3,
                                      guided={"json_schema": json.dumps(PERSON)}))
        assert "".join(d.text for d in streamed) == result.text


def test_raw_json_lines_submit_with_a_choice(daemon):
    with RawConn(daemon.sock, json_mode=True) as conn:
        conn.send({"type": "submit", "id": "c", "prompt": "Pick:", "stream": False,
                   "sampling": {"temperature": 1.0, "seed": 5, "guided": {"choice": ["left", "right"]}}})
        replies = [conn.recv(), conn.recv()]
    assert replies[0]["type"] == "accepted"
    assert replies[1]["text"] in ("left", "right") and replies[1]["finish_reason"] == "stop"


def test_bad_specs_are_refused_at_intake_without_echo(daemon):
    marker = "zqx_marker_rule"
    with Client(socket=daemon.sock) as client:
        for guided, expected in [
            ({"grammar": f"root ::= {marker}"}, "guided.grammar is invalid: EBNF parser error at line 1"),
            ({"grammar": "root ::= root"}, "guided.grammar can never complete"),
            ({"regex": f"({marker}"}, "guided.regex is invalid: Regex parsing error"),
            ({"json_schema": {"type": marker}}, "guided.json_schema is invalid"),
        ]:
            with pytest.raises(RequestError) as err:
                client.generate("x", max_tokens=4, guided=guided)
            assert err.value.code == "invalid_params"
            assert expected in err.value.message
            assert marker not in err.value.message
        with pytest.raises(ValueError, match="needs exactly one of"):  # the client checks first
            client.generate("x", guided={"choice": ["a"], "regex": "b"})
        assert client.generate("still serving", max_tokens=3).usage.completion_tokens == 3
    with RawConn(daemon.sock) as conn:  # and so does the daemon
        conn.send({"type": "submit", "prompt": "x", "sampling": {"guided": {"choice": ["a"], "regex": "b"}}})
        reply = conn.recv()
    assert reply["type"] == "error" and reply["code"] == "invalid_params"
    assert "needs exactly one of" in reply["message"]
    assert marker not in daemon.stderr()


def test_slow_grammar_fails_alone_while_others_stream(daemon):
    with Client(socket=daemon.sock) as client:
        outcome = {}

        def slow():
            with Client(socket=daemon.sock) as other:
                outcome["slow"] = other.generate("x", max_tokens=8, guided={"json_schema": SLOW_SCHEMA})

        thread = threading.Thread(target=slow)
        thread.start()
        pieces = list(client.stream("meanwhile", max_tokens=60, temperature=0, ignore_eos=True))
        thread.join(30)
        assert not thread.is_alive()
        assert pieces[-1].finish_reason == "length" and pieces[-1].usage.completion_tokens == 60
        failed = outcome["slow"]
        assert failed.finish_reason == "error"
        assert "did not compile within 0.3 s" in failed.error
        deadline = time.monotonic() + 10
        while (status := client.status()).num_running + status.num_waiting and time.monotonic() < deadline:
            time.sleep(0.02)
        assert status.kv_blocks_used == 0


def test_llmctl_guided_flags(daemon, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    grammar = tmp_path / "arith.ebnf"
    grammar.write_text(ARITHMETIC)
    done = llmctl(daemon, "--json-schema", str(schema), "--max-tokens", "200", "--seed", "1", "--no-stream", "Who?")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), PERSON)
    done = llmctl(daemon, "--choice", "red,green,blue", "--temperature", "1.2", "--seed", "4", "--no-stream", "Color:")
    assert done.returncode == 0 and done.stdout.strip() in ("red", "green", "blue")
    done = llmctl(daemon, "--regex", "[0-9]{2}-[a-z]{3}", "--no-stream", "Code:")
    assert done.returncode == 0 and re.fullmatch("[0-9]{2}-[a-z]{3}", done.stdout.strip())
    done = llmctl(daemon, "--grammar", str(grammar), "--max-tokens", "64", "--temperature", "0", "--stream", "1+")
    assert done.returncode == 0 and arithmetic_valid(done.stdout.strip())
    done = llmctl(daemon, "--json-schema", str(schema), "--whitespace", "pretty", "--max-tokens", "250",
                  "--seed", "2", "--json", "Who?")
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["finish_reason"] == "stop"
    assert result["text"].startswith('{\n  "name": ')
    jsonschema.validate(json.loads(result["text"]), PERSON)
    done = llmctl(daemon, "--json-object", "--max-tokens", "250", "--temperature", "0", "--json", "{")
    result = json.loads(done.stdout)
    assert result["text"].startswith("{")
    if result["finish_reason"] == "stop":
        assert done.returncode == 0 and isinstance(json.loads(result["text"]), dict)
    else:  # a random model may not close the object within max_tokens: exit 5, and a warning
        assert done.returncode == 5 and "cut short" in done.stderr
    refused = llmctl(daemon, "--regex", "a(b", "x")
    assert refused.returncode == 1 and "Regex parsing error" in refused.stderr
    both = llmctl(daemon, "--regex", "a", "--choice", "a,b", "x")
    assert both.returncode == 2 and "at most one of" in both.stderr
