"""docs/protocol.md against the protocol itself: every message and field of
client/protocol.py and every error code the intake sends is named there, every line of
its example exchange decodes as the Structs (or is refused, where the doc shows an
error), and the example clients in docs/examples/ (Node.js; bash with socat and jq)
stream exactly the text the Python client returns for the same greedy request from a
real daemon."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import get_args

import msgspec
import pytest

from daemon_util import Daemon, RawConn
from llmd_client import Client
from llmd_client.protocol import (ChatMessage, ClientMessage, Error, GuidedDecodingParams, MemoryInfo, ModelStatus,
                                  PoolingParams, RequestInfo, SamplingParams, ServerMessage, SpecDecodeInfo,
                                  TokenLogprob, Usage)
from llmd_tools.make_model import fixture_path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "protocol.md"
NODE_CLIENT = REPO / "docs" / "examples" / "llmd-client.mjs"
SHELL_CLIENT = REPO / "docs" / "examples" / "llmd-submit.sh"
MESSAGES = get_args(ClientMessage) + get_args(ServerMessage)
NESTED = (SamplingParams, GuidedDecodingParams, PoolingParams, ChatMessage, Usage, TokenLogprob, RequestInfo,
          SpecDecodeInfo, MemoryInfo, ModelStatus)
PROMPTS = ["def fib(n):", "中文と日本語 🎉"]  # the second streams characters split across tokens
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path_factory.mktemp("sock") / "llmd.sock").wait_ready()
    yield d
    assert d.stop() == 0, d.stderr()


def python_client_text(daemon: Daemon, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    with Client(socket=daemon.sock) as client:
        return client.generate(prompt, max_tokens=max_tokens, temperature=0).text


# -- the document ------------------------------------------------------------------------

def test_doc_names_every_message_field_and_error_code():
    doc = DOC.read_text()
    missing = [f"message {m.__name__} (`{m.__struct_config__.tag}`)" for m in MESSAGES
               if f"`{m.__struct_config__.tag}` ({m.__name__})" not in doc]
    missing += [f"struct {s.__name__}" for s in NESTED if s.__name__ not in doc]
    missing += [f"field {s.__name__}.{name}" for s in MESSAGES + NESTED for name in s.__struct_fields__
                if f"`{name}`" not in doc]
    intake = (REPO / "daemon" / "actors" / "intake.py").read_text()
    codes = set(re.findall(r'code="([a-z_]+)"', intake))
    codes |= set(re.findall(r"[a-z_]+", Error.__doc__.split("(", 1)[1].split(")", 1)[0]))
    errors_table = doc.split("| code | meaning |", 1)[1].split("\n\n", 1)[0]
    missing += [f"error code {c}" for c in sorted(codes) if f"| `{c}` |" not in errors_table]
    assert not missing, "docs/protocol.md does not mention: " + ", ".join(missing)


def exchange_lines() -> list[str]:
    block = DOC.read_text().split("## An example exchange", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def test_example_exchange_decodes_as_the_protocol():
    """Client lines decode as ClientMessage (or are refused where the doc answers with a
    validation error); daemon lines decode as ServerMessage."""
    lines = exchange_lines()
    assert len(lines) > 20 and all(line[:2] in ("> ", "< ") for line in lines)
    client = msgspec.json.Decoder(ClientMessage)
    server = msgspec.json.Decoder(ServerMessage)
    seen = set()
    for i, line in enumerate(lines):
        body = line[2:].encode()
        if line.startswith("< "):
            seen.add(type(server.decode(body)).__name__)
            continue
        reply = msgspec.json.decode(lines[i + 1][2:]) if i + 1 < len(lines) else {}
        if reply.get("type") == "error" and reply["code"] in ("bad_request", "invalid_params"):
            with pytest.raises(msgspec.ValidationError):
                client.decode(body)
        else:
            seen.add(type(client.decode(body)).__name__)
    assert seen == {m.__name__ for m in MESSAGES}  # the exchange shows every message


# -- the Node.js example -----------------------------------------------------------------

needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="node is not on PATH")


def node(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(NODE_CLIENT), *args], capture_output=True, encoding="utf-8", timeout=120,
                          **kwargs)


@needs_node
@pytest.mark.parametrize("prompt", PROMPTS)
def test_node_client_streams_what_the_python_client_returns(daemon, prompt):
    expected = python_client_text(daemon, prompt)
    out = node("--socket", daemon.sock, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", prompt)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


@needs_node
def test_node_client_exit_codes(daemon, tmp_path):
    refused = node("--socket", daemon.sock, "--max-tokens", "0", "hi")
    assert refused.returncode == 1 and "invalid_params" in refused.stderr and "max_tokens" in refused.stderr
    absent = node("--socket", str(tmp_path / "none.sock"), "hi")
    assert absent.returncode == 3 and "ENOENT" in absent.stderr
    # Greedy from this prompt runs the whole 240 tokens on the fixture: time to abort it
    # from another connection by its server request id, as `llmctl abort` does.
    proc = subprocess.Popen(["node", str(NODE_CLIENT), "--socket", daemon.sock, "--max-tokens", "240",
                             "--temperature", "0", "Once upon a time"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8")
    try:
        request_id = wait_running(daemon)
        with RawConn(daemon.sock) as conn:
            conn.send({"type": "abort", "id": request_id})
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 4, stderr
    assert python_client_text(daemon, "Once upon a time", 240).startswith(stdout.rstrip("\n"))


def wait_running(daemon: Daemon, timeout: float = 30.0) -> str:
    """The server id of the one request in flight, once it has produced a token."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with RawConn(daemon.sock) as conn:
            conn.send({"type": "status"})
            requests = conn.recv()["requests"]
        if requests and requests[0]["completion_tokens"] > 0:
            return requests[0]["request_id"]
        time.sleep(0.05)
    raise TimeoutError("the Node client's request never ran")


# -- the shell example -------------------------------------------------------------------

@pytest.mark.skipif(not all(map(shutil.which, ("bash", "socat", "jq"))), reason="needs bash, socat and jq")
def test_shell_client_streams_what_the_python_client_returns(daemon):
    prompt = PROMPTS[1]
    expected = python_client_text(daemon, prompt)
    out = subprocess.run(["bash", str(SHELL_CLIENT), prompt, str(MAX_TOKENS)], capture_output=True,
                         encoding="utf-8", timeout=120, env={**os.environ, "LLMD_SOCKET": daemon.sock})
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    refused = subprocess.run(["bash", str(SHELL_CLIENT), prompt, "0"], capture_output=True, encoding="utf-8",
                             timeout=60, env={**os.environ, "LLMD_SOCKET": daemon.sock})
    assert refused.returncode == 1 and "invalid_params" in refused.stderr
