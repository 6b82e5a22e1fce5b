"""The HTTP faces against what a web page, a hostile peer and broken input can send:
requests shaped as browsers send them (cross-origin text/plain and form POSTs, CORS
preflights, DNS rebinding's foreign Host) are refused before anything runs, unless the
origin is allowed; deeply nested JSON (HTTP bodies, socket JSON lines and msgpack
frames) gets a clear error and the connection goes on; a bad API key is a 401 whatever
its bytes; a malformed request is a 400 that repeats nothing and logs one line.

One real daemon (TCP port without a key, the README's setup for Ollama clients) serves
the module; the API-key tests use the HTTP app alone, on a loopback port, with no model."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import random
import socket
import struct
import subprocess
import threading
import types
from pathlib import Path

import msgspec
import pytest

from daemon_util import Daemon, RawConn
from test_http_api import UnixHTTPConnection, free_port
from llmd_tools.make_model import fixture_path

ALLOWED = "https://ok.example"
EVIL = "https://attacker.example"
CHROME = {"User-Agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0 "
                        "Safari/537.36", "Accept": "*/*", "Accept-Language": "en-US,en;q=0.9"}


def request(target: int | str, method: str, path: str, headers: dict[str, str], body: bytes | str | None = None,
            ) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request with exactly these headers (Host included: none is added), on a TCP
    port of 127.0.0.1 or on a Unix socket path."""
    conn = http.client.HTTPConnection("127.0.0.1", target, timeout=30) if isinstance(target, int) \
        else UnixHTTPConnection(target)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        data = body.encode() if isinstance(body, str) else body
        for name, value in headers.items():
            conn.putheader(name, value)
        if data is not None:
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def raw(port: int, data: bytes) -> bytes:
    """Bytes in, the whole answer out (the server closes after a malformed request)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path_factory.mktemp("hard") / "llmd.sock", "--http-port",
               str(port), "--no-http-require-api-key", "--http-allowed-origins", f"{ALLOWED},chrome-extension://*")
    try:
        d.wait_ready()
    except BaseException:
        d.stop()
        raise
    d.port = port
    d.http_sock = d.sock.removesuffix(".sock") + "-http.sock"
    d.model = Path(str(fixture_path("tiny-llama"))).name
    yield d
    assert d.stop() == 0, d.stderr()
    assert "Traceback" not in d.stderr(), d.stderr()


def engine_counts(daemon) -> tuple[int, int]:
    """(requests admitted to the engine so far, prompt tokens so far)."""
    with RawConn(daemon.sock) as conn:
        conn.send({"type": "status"})
        status = conn.recv()
    return status["requests_finished_total"] + status["num_running"] + status["num_waiting"], \
        status["prompt_tokens_total"]


def generate_body(daemon, prompt: str = "def fibonacci(n):") -> str:
    return json.dumps({"model": daemon.model, "prompt": prompt, "raw": True, "stream": False,
                       "options": {"temperature": 0, "num_predict": 2}})


# -- row 7: web pages -------------------------------------------------------------------

def test_a_page_on_another_origin_cannot_run_a_generation(daemon):
    """What `fetch(url, {method: "POST", body: JSON.stringify(...)})` (text/plain, no
    preflight) and an auto-submitted <form> send from https://attacker.example."""
    before = engine_counts(daemon)
    host = f"127.0.0.1:{daemon.port}"
    fetch = {**CHROME, "Host": host, "Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8",
             "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "empty",
             "Referer": EVIL + "/"}
    form = {**fetch, "Content-Type": "application/x-www-form-urlencoded", "Sec-Fetch-Mode": "navigate",
            "Sec-Fetch-Dest": "document"}
    chat = json.dumps({"model": daemon.model, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    for headers, path, body in [(fetch, "/api/generate", generate_body(daemon)), (fetch, "/api/chat", chat),
                                (fetch, "/v1/completions", '{"prompt": "hi", "max_tokens": 2}'),
                                (form, "/api/generate", generate_body(daemon)),
                                ({**fetch, "Origin": "null"}, "/api/generate", generate_body(daemon))]:
        status, reply_headers, reply = request(daemon.port, "POST", path, headers, body)
        assert status == 403, (path, reply)
        assert "Access-Control-Allow-Origin" not in reply_headers
        assert b"attacker" not in reply and b"origin" in reply
    # A cross-origin GET (readable only with CORS headers, which it does not get) too.
    status, reply_headers, reply = request(daemon.port, "GET", "/api/tags", {**CHROME, "Host": host, "Origin": EVIL})
    assert status == 403 and daemon.model.encode() not in reply
    assert engine_counts(daemon) == before  # nothing was admitted, nothing tokenized


def test_dns_rebinding_cannot_read_or_run(daemon):
    """After rebinding, attacker.example resolves to 127.0.0.1: the page is same-origin,
    its GETs carry no Origin at all, and Host names the attacker's domain."""
    before = engine_counts(daemon)
    for host in (f"attacker.example:{daemon.port}", "attacker.example", f"localhost.attacker.example:{daemon.port}",
                 f"127.0.0.1.nip.io:{daemon.port}"):
        status, _, reply = request(daemon.port, "GET", "/api/tags", {**CHROME, "Host": host})
        assert status == 403 and daemon.model.encode() not in reply, host
        assert b"attacker" not in reply and b"Host" in reply
        status, _, reply = request(daemon.port, "POST", "/api/generate",
                                   {**CHROME, "Host": host, "Origin": f"http://{host}",
                                    "Content-Type": "application/json", "Sec-Fetch-Site": "same-origin"},
                                   generate_body(daemon))
        assert status == 403, host
        status, _, _ = request(daemon.port, "GET", "/health", {"Host": host})
        assert status == 403
    assert engine_counts(daemon) == before
    # Loopback names and addresses, with or without a port, are this machine.
    for host in (f"localhost:{daemon.port}", "localhost", "LOCALHOST.", f"127.0.0.1:{daemon.port}", "127.9.8.7",
                 f"[::1]:{daemon.port}", "[::1]", f"app.localhost:{daemon.port}"):
        status, _, reply = request(daemon.port, "GET", "/api/tags", {"Host": host})
        assert status == 200 and daemon.model.encode() in reply, host
    # The host of an allowed http(s) origin may be the Host (a proxy that keeps it).
    assert request(daemon.port, "GET", "/api/version", {"Host": "ok.example"})[0] == 200


def test_the_unix_socket_serves_any_host(daemon):
    """No browser can open a Unix socket; a client there may send any Host."""
    for host in ("attacker.example", "localhost", "whatever:1234"):
        status, _, reply = request(daemon.http_sock, "POST", "/api/generate",
                                   {"Host": host, "Content-Type": "application/json"}, generate_body(daemon))
        assert status == 200 and json.loads(reply)["done"], host


def test_cors_preflight_is_answered_for_allowed_origins_only(daemon):
    host = f"127.0.0.1:{daemon.port}"
    asked = "authorization,content-type,x-stainless-os"
    for origin in (ALLOWED, "http://localhost:5173", "http://127.0.0.1:3000", "chrome-extension://abcdef",
                   "vscode-webview://1234"):
        status, headers, body = request(daemon.port, "OPTIONS", "/v1/chat/completions",
                                        {**CHROME, "Host": host, "Origin": origin,
                                         "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": asked,
                                         "Sec-Fetch-Mode": "cors", "Sec-Fetch-Site": "cross-site"})
        assert status == 204 and body == b"", origin
        assert headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == asked
        assert "Origin" in headers["Vary"]
    # Chrome's Private Network Access preflight, from an allowed public page.
    status, headers, _ = request(daemon.port, "OPTIONS", "/api/chat",
                                 {**CHROME, "Host": host, "Origin": ALLOWED, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Private-Network": "true"})
    assert status == 204 and headers["Access-Control-Allow-Private-Network"] == "true"
    for origin in (EVIL, "http://localhost.attacker.example", "null", "https://ok.example.attacker.example"):
        status, headers, _ = request(daemon.port, "OPTIONS", "/v1/chat/completions",
                                     {**CHROME, "Host": host, "Origin": origin,
                                      "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "content-type"})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers, origin
    # After its preflight, the allowed page's request runs, and it may read the answer.
    status, headers, reply = request(daemon.port, "POST", "/api/generate",
                                     {**CHROME, "Host": host, "Origin": ALLOWED, "Content-Type": "application/json",
                                      "Sec-Fetch-Mode": "cors", "Sec-Fetch-Site": "cross-site"},
                                     generate_body(daemon))
    assert status == 200 and json.loads(reply)["done"]
    assert headers["Access-Control-Allow-Origin"] == ALLOWED
    # Streamed answers carry it too (their headers go out before the handler returns).
    status, headers, reply = request(daemon.port, "POST", "/v1/completions",
                                     {"Host": host, "Origin": "http://localhost:5173",
                                      "Content-Type": "application/json"},
                                     '{"prompt": "hi", "max_tokens": 2, "stream": true}')
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
    assert reply.rstrip().endswith(b"data: [DONE]")


def test_json_endpoints_take_json_from_browsers_and_curl_d_from_the_shell(daemon):
    host = f"127.0.0.1:{daemon.port}"
    before = engine_counts(daemon)
    # An allowed page that posts text/plain (no preflight) still cannot run anything.
    status, headers, reply = request(daemon.port, "POST", "/api/generate",
                                     {**CHROME, "Host": host, "Origin": "http://localhost:3000",
                                      "Content-Type": "text/plain;charset=UTF-8"}, generate_body(daemon))
    assert status == 415 and "application/json" in json.loads(reply)["error"]
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:3000"  # the page may read why
    for extra in ({"Content-Type": "text/plain"}, {"Content-Type": "multipart/form-data; boundary=x"},
                  {"Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Site": "same-origin"},
                  {"Content-Type": "application/x-www-form-urlencoded", "Sec-Fetch-Mode": "navigate"}):
        status, _, reply = request(daemon.port, "POST", "/v1/completions", {"Host": host, **extra},
                                   '{"prompt": "hi", "max_tokens": 2}')
        assert status == 415 and json.loads(reply)["error"]["code"] == "unsupported_media_type", extra
    assert engine_counts(daemon) == before
    # curl -d (form type, no Origin) as in Ollama's docs; a script's body with no type.
    out = subprocess.run(["curl", "-sS", f"http://localhost:{daemon.port}/api/generate", "-d", generate_body(daemon)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["done"], out.stdout + out.stderr
    status, _, reply = request(daemon.port, "POST", "/api/generate", {"Host": host}, generate_body(daemon))
    assert status == 200 and json.loads(reply)["done"]
    status, _, reply = request(daemon.port, "POST", "/api/generate",
                               {"Host": host, "Content-Type": "application/json; charset=utf-8"}, generate_body(daemon))
    assert status == 200


# -- row 8: nesting, keys, malformed requests -------------------------------------------

@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_http_bodies_get_a_clear_400(daemon, depth):
    host = {"Host": f"127.0.0.1:{daemon.port}", "Content-Type": "application/json"}
    schema = '{"type": "object", "properties": {"a": ' + nested(depth) + "}}"
    status, _, reply = request(daemon.port, "POST", "/v1/chat/completions", host,
                               '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                               '"response_format": {"type": "json_schema", "json_schema": {"schema": ' + schema + "}}}")
    error = json.loads(reply)["error"]
    assert status == 400 and "levels deep" in error["message"] and error["type"] == "invalid_request_error"
    status, _, reply = request(daemon.http_sock, "POST", "/api/chat", {"Host": "localhost",
                                                                        "Content-Type": "application/json"},
                               '{"model": "m", "messages": [], "format": {"a": ' + nested(depth) + "}}")
    assert status == 400 and "levels deep" in json.loads(reply)["error"]
    # Deep but within the limit is fine, and the daemon serves on.
    status, _, reply = request(daemon.port, "POST", "/v1/completions", host,
                               '{"prompt": "hi", "max_tokens": 2, "user": "x", "tools": ' + nested(100) + "}")
    assert status == 200, reply
    assert "Traceback" not in daemon.stderr()


@pytest.mark.parametrize("json_mode", [True, False], ids=["json-lines", "msgpack"])
def test_deeply_nested_socket_frames_get_an_error_and_the_connection_goes_on(daemon, json_mode):
    for depth in (300, 1000, 100_000):
        with RawConn(daemon.sock, json_mode=json_mode) as conn:
            guided_schema = '{"a": ' + nested(depth) + "}"
            if json_mode:
                conn.send_raw(b'{"type": "submit", "id": "deep", "prompt": "hi", "sampling": {"guided": '
                              b'{"json_schema": ' + guided_schema.encode() + b"}}}\n")
            else:  # the same message as msgpack: nested fixarrays in a map
                body = (b"\x84\xa4type\xa6submit\xa2id\xa4deep\xa6prompt\xa2hi\xa8sampling\x81\xa6guided"
                        b"\x81\xabjson_schema\x81\xa1a" + b"\x91" * (depth - 1) + b"\x90")
                conn.send_raw(struct.pack(">I", len(body)) + body)
            error = conn.recv()
            assert error["type"] == "error" and error["code"] == "bad_frame", error
            assert "more than 256 levels deep" in error["message"]
            conn.send({"type": "status"})  # the same connection, served on
            assert conn.recv()["type"] == "status_reply"
    assert "Traceback" not in daemon.stderr()


def test_malformed_requests_get_a_400_that_repeats_nothing_and_one_log_line(daemon):
    marker = b"<script>alert(1)</script>"
    before = daemon.stderr().count("malformed HTTP request")
    for data in (b"GET /v1/models" + marker + b"\x01 HTTP/1.1\r\nHost: localhost\r\n\r\n",
                 b"G<T /" + marker + b" HTTP/1.1\r\nHost: localhost\r\n\r\n",
                 b"GET / HTTP/1.1\r\nHost: localhost\r\nX-" + marker + b": 1\r\n\r\n",
                 b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Long: " + marker * 400 + b"\r\n\r\n",
                 b"GET /" + marker * 400 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n",
                 b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1" + marker + b"\r\n\r\n",
                 b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + marker + b"\r\n\r\n") * 3:
        answer = raw(daemon.port, data)
        assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:200]
        assert marker not in answer and b"script" not in answer and b"alert" not in answer
    log = daemon.stderr()
    assert log.count("malformed HTTP request") - before <= 1  # 21 of them within seconds: one line
    assert "Traceback" not in log and marker.decode() not in log
    assert request(daemon.port, "GET", "/api/version", {"Host": "localhost"})[0] == 200  # and it serves on


# -- API keys, on the HTTP app alone ----------------------------------------------------

KEY = "k3y-" + "7" * 28


class _Metrics:
    def send(self, query) -> None:
        query.reply.set_result((True, "ok") if query.kind == "health" else "llmd:up 1\n")


@pytest.fixture(scope="module")
def keyed_app():
    """The HTTP app with one API key on a loopback port, in a thread's event loop."""
    from llmd.actors.http_intake import HttpIntakeActor
    from llmd.daemon_config import DaemonConfig

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    intake = types.SimpleNamespace(config=DaemonConfig(), draining=False)
    models = types.SimpleNamespace(registry=types.SimpleNamespace(listed=lambda: []), slots={})  # no model: an empty list
    actor = HttpIntakeActor([sock], intake, _Metrics(), models, api_keys=[KEY, "clé-ünïcode"])
    task = loop.create_task(actor.run())

    def serve() -> None:
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                threading.Event().wait(0.05)
        yield port
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        loop.close()
        sock.close()


def test_any_bad_api_key_is_a_401(keyed_app):
    base = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    assert raw(keyed_app, base + b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert raw(keyed_app, base + b"Authorization: Bearer " + "clé-ünïcode".encode() + b"\r\n\r\n").startswith(
        b"HTTP/1.1 200")  # a UTF-8 key, as its bytes
    for header in (b"Bearer " + "kéy-ünïcode".encode(), b"Bearer \xff\xfe\xfd-not-utf8", b"Bearer \xe9t\xe9",
                   b"Bearer ", b"Bearer", b"", b"Basic " + KEY.encode(), b"Bearer " + KEY.encode() + b"x",
                   b"Bearer " + b"A" * 5000, b"Bearer " + KEY.encode() * 200):
        answer = raw(keyed_app, base + b"Authorization: " + header + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401"), (header[:40], answer[:300])
        assert b"invalid_api_key" in answer and b"\xff" not in answer
    answer = raw(keyed_app, base + b"\r\n")  # no header at all
    assert answer.startswith(b"HTTP/1.1 401")
    # Past the parser's header limit (8 KiB) it is a malformed request: 400, no echo.
    answer = raw(keyed_app, base + b"Authorization: Bearer " + b"Q" * 9000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 400") and b"QQQQ" not in answer


def test_the_sleep_routes_need_the_key_too(keyed_app):
    """vLLM's sleep-mode routes change what the daemon holds: a TCP client without the
    key is refused before they run (the stand-in pool here has no sleep to call)."""
    for line in (b"POST /sleep?level=1 HTTP/1.1", b"POST /wake_up HTTP/1.1", b"GET /is_sleeping HTTP/1.1"):
        answer = raw(keyed_app, line + b"\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer, (line, answer[:200])


def test_a_preflight_needs_no_key_but_the_request_does(keyed_app):
    preflight = (b"OPTIONS /v1/models HTTP/1.1\r\nHost: localhost\r\nOrigin: http://localhost:8080\r\n"
                 b"Access-Control-Request-Method: GET\r\nAccess-Control-Request-Headers: authorization\r\n"
                 b"Connection: close\r\n\r\n")
    assert raw(keyed_app, preflight).startswith(b"HTTP/1.1 204")
    answer = raw(keyed_app, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nOrigin: http://localhost:8080\r\n"
                            b"Connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401") and b"Access-Control-Allow-Origin: http://localhost:8080" in answer


# -- the pieces alone ----------------------------------------------------------------------

def test_browser_guard_hosts_and_origins():
    from llmd.http.guard import BrowserGuard

    guard = BrowserGuard(["https://*.corp.example", "https://ui.lan:8443/", "moz-extension://*"], "llm.lan")
    for host in ("localhost", "localhost:1", "Localhost.", "a.b.localhost:80", "127.0.0.1", "127.255.0.3:9",
                 "[::1]", "[::1]:11434", "10.1.2.3:80", "[fe80::1]", "0.0.0.0:1", "llm.lan:8000", "x.corp.example",
                 "ui.lan", None, ""):
        assert guard.host_allowed(host), host
    for host in ("attacker.example", "localhost.attacker.example", "127.0.0.1.nip.io", "corp.example.evil",
                 "llm.lan.evil", "::1", "[::1", "[::1]x", "localhost:http", "a b", "éxample", "moz-extension",
                 "x@localhost"):
        assert not guard.host_allowed(host), host
    for origin in ("http://localhost", "http://localhost:3000", "https://127.0.0.1:8443", "http://0.0.0.0:1",
                   "http://[::1]:5173", "app://obsidian.md", "file://", "tauri://localhost", "vscode-webview://x",
                   "vscode-file://vscode-app", "https://a.corp.example", "https://ui.lan:8443",
                   "moz-extension://1234", "HTTP://LOCALHOST:3000"):
        assert guard.origin_allowed(origin), origin
    for origin in ("null", "http://attacker.example", "http://localhost.attacker.example", "https://ui.lan",
                   "https://corp.example", "http://127.0.0.2", "chrome-extension://x", "http://localhost3000"):
        assert not guard.origin_allowed(origin), origin
    assert BrowserGuard(["*"]).origin_allowed("https://anything.example")
    assert BrowserGuard(["*"]).host_allowed("anything.example")


def test_nesting_limit_is_exact_and_json_aware():
    from llmd_client.framing import MAX_NESTING_DEPTH, JsonLinesCodec, MsgpackCodec, NestingError, json_too_deep
    from llmd_client.protocol import ClientMessage

    def depth(value) -> int:
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        return 0

    rng = random.Random(7)

    def tree(levels: int):
        if levels == 0 or rng.random() < 0.15:
            return rng.choice(['a"]}\\', "[[[{{{", "\\\\", 1, None, '\\"[['])
        if rng.random() < 0.5:
            return [tree(levels - 1) for _ in range(rng.randrange(1, 3))]
        return {rng.choice(["k", "[", '"{', "\\"]) + str(i): tree(levels - 1) for i in range(rng.randrange(1, 3))}

    for _ in range(500):
        value = tree(rng.randrange(1, 10))
        text, d = json.dumps(value).encode(), depth(value)
        for limit in {0, 1, max(d - 1, 0), d}:
            assert json_too_deep(text, limit) == (d > limit), (text, limit)
    # Brackets inside strings do not count, however many.
    assert not json_too_deep(json.dumps({"prompt": "[" * 10_000 + "{" * 10_000}).encode())

    def submit(levels: int) -> dict:
        value: object = {}
        for _ in range(levels - 5):  # the submit, sampling, guided and schema objects hold it
            value = [value]
        return {"type": "submit", "prompt": "x", "sampling": {"guided": {"json_schema": {"a": value}}}}

    for kind, encode in ((JsonLinesCodec, msgspec.json.encode), (MsgpackCodec, msgspec.msgpack.encode)):
        codec = kind(ClientMessage, max_depth=MAX_NESTING_DEPTH)  # as the daemon's connections decode
        assert codec.decode(encode(submit(MAX_NESTING_DEPTH))).prompt == "x"
        with pytest.raises(NestingError, match="more than 256 levels deep"):
            codec.decode(encode(submit(MAX_NESTING_DEPTH + 1)))
        # A client's codec checks nothing itself; the decoder's recursion limit still
        # ends in the same error, never a RecursionError.
        assert kind(ClientMessage).decode(encode(submit(MAX_NESTING_DEPTH + 1))).prompt == "x"
        deep = (b'{"type": "submit", "prompt": "x", "sampling": {"guided": {"json_schema": {"a": ' + b"[" * 5000
                + b"]" * 5000 + b"}}}}") if kind is JsonLinesCodec else \
            (b"\x83\xa4type\xa6submit\xa6prompt\xa1x\xa8sampling\x81\xa6guided\x81\xabjson_schema\x81\xa1a"
             + b"\x91" * 4999 + b"\x90")
        with pytest.raises(NestingError):
            kind(ClientMessage).decode(deep)
    assert isinstance(NestingError(), msgspec.DecodeError)  # callers that catch DecodeError still do


def test_malformed_log_is_one_line_per_interval(caplog):
    from llmd.http.malformed import MalformedLog

    log = MalformedLog(interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="llmd.http"):
        for _ in range(50):
            log(ValueError("GET /<script>"), "127.0.0.1")
    assert len(caplog.records) == 1 and "<script>" not in caplog.text and caplog.records[0].exc_info is None
    log._last -= 3600
    with caplog.at_level(logging.WARNING, logger="llmd.http"):
        log(ValueError("x"), None)
    assert "49 more" in caplog.records[-1].getMessage()


def test_http_allowed_origins_option(tmp_path):
    from click.testing import CliRunner

    from llmd.cli import _comma_list, serve
    from llmd.daemon_config import DaemonConfig, load_settings

    assert "--http-allowed-origins" in CliRunner().invoke(serve, ["--help"]).output
    assert _comma_list(None, None, ("https://a.example, https://b.example", "app://*")) == \
        ["https://a.example", "https://b.example", "app://*"]
    assert _comma_list(None, None, ()) is None  # not given: the TOML file's value stands
    (tmp_path / "llmd.toml").write_text('http_allowed_origins = ["https://ui.example"]\n')
    daemon, _ = load_settings(str(tmp_path / "llmd.toml"), {"http_allowed_origins": None})
    assert daemon.http_allowed_origins == ["https://ui.example"]
    assert DaemonConfig().http_allowed_origins == []
