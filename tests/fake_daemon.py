"""A scripted fake daemon speaking the wire protocol on a real Unix socket, for the
client tests (test_client.py, test_llmctl.py), and their fixtures.

The fake echoes the prompt back word by word (one "token" per word), so every expected
text is known independently of the client code under test. Special prompts: FOREVER
streams "tick " until max_tokens or an Abort; TOOLONG is refused; MIDERROR fails after
one delta; DROP closes the connection after accepting.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmd_client import Client
from llmd_client.framing import MsgpackCodec
from llmd_client.protocol import (Abort, Accepted, ClientMessage, Error, Hello, Metrics, MetricsReply, Output,
                                  RequestInfo, Status, StatusReply, Submit, TokenLogprob, Usage, Welcome)

METRICS_TEXT = "# TYPE llmd_requests_finished_total counter\nllmd_requests_finished_total 7\n"
LLMCTL = str(Path(sys.executable).with_name("llmctl"))


def echo_pieces(submit: Submit, index: int) -> list[str]:
    if submit.prompt is not None:
        source = submit.prompt
    elif submit.messages is not None:
        source = submit.messages[-1].content
    else:
        source = " ".join(f"t{t}" for t in submit.token_ids or [])
    pieces = re.findall(r"\S+\s*", source)
    return ([f"[{index}] "] + pieces) if submit.sampling.n > 1 else pieces


def fake_logprobs(submit: Submit, pieces: list[str]) -> list[list[TokenLogprob]] | None:
    if submit.sampling.logprobs is None or not pieces:
        return None
    return [[TokenLogprob(len(p), -0.25 * k, 1)] for k, p in enumerate(pieces)]


@dataclass
class FakeRequest:
    id: str  # the connection's id
    server_id: str
    submit: Submit
    send: Callable[[object], None]  # to the owning connection
    prompt_tokens: int
    counts: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    task: asyncio.Future | None = None

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=sum(self.counts))


class FakeDaemon:
    """An asyncio Unix-socket server on its own thread; records every message received."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.received: list[tuple[int, object]] = []  # (connection number, message)
        self.reject_version = False
        self.closed_connections = 0
        self.running: dict[str, FakeRequest] = {}  # by server id
        self.connections: set[asyncio.Task] = set()
        self._conn_numbers = itertools.count(1)
        self._request_numbers = itertools.count(1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(5)

    async def _listen(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)

    def stop(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [r.task for r in self.running.values()] + list(self.connections)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    # -- what tests look at ---------------------------------------------------------------
    def messages(self, kind: type) -> list:
        return [m for _, m in list(self.received) if isinstance(m, kind)]

    def last_submit(self) -> tuple[int, str]:
        """(connection number, connection id) of the latest Submit."""
        return next((c, m.id) for c, m in reversed(list(self.received)) if isinstance(m, Submit))

    def aborted(self) -> set[tuple[int, str]]:
        return {(c, m.id) for c, m in list(self.received) if isinstance(m, Abort)}

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "the fake daemon never saw what the test waited for"
            time.sleep(0.005)

    # -- protocol -------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = next(self._conn_numbers)
        self.connections.add(asyncio.current_task())
        codec = MsgpackCodec(ClientMessage)
        mine: dict[str, FakeRequest] = {}  # by connection id

        def send(message: object) -> None:
            if not writer.is_closing():
                writer.write(codec.encode(message))

        try:
            while data := await reader.read(65536):
                for body in codec.feed(data):
                    message = codec.decode(body)
                    self.received.append((number, message))
                    match message:
                        case Hello(protocol_version=v):
                            send(Error(code="unsupported_version", message=f"protocol {v} is not supported")
                                 if self.reject_version else
                                 Welcome(protocol_version=v, server_version="0.0-fake", model="fake-model"))
                        case Submit():
                            self._submit(message, mine, send, writer)
                        case Abort(id=id):
                            self._abort(id, mine, send)
                        case Status():
                            send(self._status())
                        case Metrics():
                            send(MetricsReply(text=METRICS_TEXT))
        except (OSError, asyncio.CancelledError):  # a cancelled handler upsets 3.11's streams
            pass
        finally:
            self.connections.discard(asyncio.current_task())
            self.closed_connections += 1
            for request in mine.values():  # a closed connection aborts its requests
                if request.task is not None:
                    request.task.cancel()
            writer.close()

    def _submit(self, submit: Submit, mine: dict, send: Callable, writer: asyncio.StreamWriter) -> None:
        id = submit.id or f"s{next(self._request_numbers)}"
        if submit.prompt == "TOOLONG":
            send(Error(id=id, code="too_long", message="prompt has 5000 tokens; the limit is 2048"))
            return
        n = submit.sampling.n
        request = FakeRequest(id=id, server_id=f"req-{next(self._request_numbers)}", submit=submit, send=send,
                              prompt_tokens=len(echo_pieces(submit, 0)), counts=[0] * n, finished=[False] * n)
        mine[id] = request
        send(Accepted(id=id, request_id=request.server_id, prompt_tokens=request.prompt_tokens))
        if submit.prompt == "DROP":
            writer.close()
            return
        request.task = asyncio.ensure_future(self._generate(request))
        self.running[request.server_id] = request
        request.task.add_done_callback(lambda _: self.running.pop(request.server_id, None))

    async def _generate(self, r: FakeRequest) -> None:
        submit = r.submit
        n, limit = submit.sampling.n, submit.sampling.max_tokens or 10**9
        forever = submit.prompt == "FOREVER"
        samples = [itertools.repeat("tick ") if forever else iter(echo_pieces(submit, i)) for i in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]
        while not all(r.finished):
            for i in range(n):
                if r.finished[i]:
                    continue
                piece = next(samples[i], None)
                finish = "stop" if piece is None else None
                if piece is not None:
                    r.counts[i] += 1
                    texts[i].append(piece)
                    finish = "length" if r.counts[i] >= limit else None
                r.finished[i] = finish is not None
                if submit.stream:
                    r.send(Output(id=r.id, index=i, text=piece or "", token_ids=[len(piece)] if piece else [],
                                  logprobs=fake_logprobs(submit, [piece] if piece else []),
                                  finish_reason=finish, usage=r.usage() if all(r.finished) else None))
            if (submit.prompt or "").startswith("MIDERROR"):
                r.send(Error(id=r.id, code="internal", message="the model runner crashed"))
                return
            if forever:
                await asyncio.sleep(0.002)
        if not submit.stream:
            for i in range(n):
                r.send(Output(id=r.id, index=i, text="".join(texts[i]), token_ids=[len(p) for p in texts[i]],
                              logprobs=fake_logprobs(submit, texts[i]),
                              finish_reason="length" if r.counts[i] >= limit else "stop",
                              usage=r.usage() if i == n - 1 else None))

    def _abort(self, id: str, mine: dict, send: Callable) -> None:
        request = mine.get(id) or self.running.get(id)
        if id == "req-forbidden":
            send(Error(id=id, code="forbidden", message="request req-forbidden belongs to another user"))
            return
        if request is None or request.server_id not in self.running:
            send(Error(id=id, code="unknown_id", message=f"no running request {id}"))
            return
        request.task.cancel()
        self.running.pop(request.server_id, None)
        unfinished = [i for i, done in enumerate(request.finished) if not done]
        for k, i in enumerate(unfinished):
            request.send(Output(id=request.id, index=i, finish_reason="abort",
                                usage=request.usage() if k == len(unfinished) - 1 else None))

    def _status(self) -> StatusReply:
        infos = [RequestInfo(request_id=r.server_id, uid=1000, state="running", age_s=1.5,
                             prompt_tokens=r.prompt_tokens, completion_tokens=sum(r.counts))
                 for r in list(self.running.values())]
        return StatusReply(model="fake-model", server_version="0.0-fake", uptime_s=3725.0, device="cpu",
                           dtype="float32", num_running=len(infos), num_waiting=2, requests=infos,
                           kv_blocks_total=512, kv_blocks_used=128, kv_usage=0.25, prefix_cache_hit_rate=0.5,
                           generation_tokens_per_s=42.5, prompt_tokens_total=100, generation_tokens_total=200,
                           requests_finished_total=7, rss_bytes=3 << 30, cpu_percent=12.0)


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_dir():
    path = tempfile.mkdtemp(prefix="llmd-t", dir="/tmp")  # Unix socket paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(short_dir):
    fake = FakeDaemon(os.path.join(short_dir, "fake.sock"))
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def client(daemon):
    with Client(daemon.path, timeout=5) as c:
        yield c


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))
