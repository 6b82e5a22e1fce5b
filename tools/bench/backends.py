"""How `llmd bench serve` reaches the daemon: its own socket protocol (llmd_client's
AsyncClient, one connection multiplexing every request) or the OpenAI API over HTTP
(aiohttp, streamed /v1/completions, over the HTTP Unix socket or a TCP base URL), so
both faces can be measured in one run on the same workload.

A backend streams one request as `Delta`s: the tokens each arrival carried and, last,
the usage. Leaving the stream early cancels the request (the socket client sends an
abort; the HTTP client closes its connection, which the daemon takes as one)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmd_client import AsyncClient
from llmd_client.errors import LlmdError
from llmd_tools.bench import workloads

BACKENDS = ("socket", "openai")


class BackendError(Exception):
    """A request failed (the message says how)."""


@dataclass
class Delta:
    num_tokens: int
    completion_tokens: int | None = None  # set on the last delta, with cached_tokens
    cached_tokens: int = 0


@dataclass
class Described:
    model: str
    device: str
    dtype: str
    where: str


class SocketBackend:
    name = "socket"

    def __init__(self, socket: str | None) -> None:
        self.client = AsyncClient(socket)

    async def __aenter__(self) -> SocketBackend:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(*exc)

    async def describe(self) -> Described:
        status = await self.client.status()
        return Described(status.model, status.device, status.dtype, self.client.socket_path)

    async def stream(self, req: workloads.Req) -> AsyncIterator[Delta]:
        stream = self.client.stream(token_ids=req.prompt, max_tokens=req.output_len, temperature=0, ignore_eos=True)
        try:
            async for delta in stream:
                if delta.usage is not None:
                    yield Delta(len(delta.token_ids), delta.usage.completion_tokens, delta.usage.cached_tokens)
                elif delta.token_ids:
                    yield Delta(len(delta.token_ids))
        except LlmdError as exc:
            raise BackendError(f"{type(exc).__name__}: {exc}") from None
        finally:
            await stream.aclose()  # cancels the request unless it ended


class OpenAIBackend:
    """Streamed POST /v1/completions with token-id prompts. Each server-sent event is one
    engine step's output; its token count is 1 (the final usage gives the exact total)."""

    name = "openai"

    def __init__(self, base_url: str | None, http_socket: str | None, api_key: str | None) -> None:
        self.base_url = (base_url or "http://localhost/v1").rstrip("/")
        self.http_socket = http_socket if base_url is None else None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = None

    async def __aenter__(self) -> OpenAIBackend:
        import aiohttp

        connector = aiohttp.UnixConnector(path=self.http_socket, limit=0) if self.http_socket else \
            aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(connector=connector, headers=self.headers,
                                             timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def describe(self) -> Described:
        import aiohttp

        try:
            async with self.session.get(f"{self.base_url}/models") as response:
                body = await response.json()
                if response.status != 200:
                    raise BackendError(f"GET /models: HTTP {response.status}: {body.get('error', {}).get('message')}")
        except aiohttp.ClientError as exc:
            raise BackendError(f"cannot reach {self.where}: {exc}") from None
        return Described(body["data"][0]["id"], "?", "?", self.where)

    @property
    def where(self) -> str:
        return f"{self.base_url} via {self.http_socket}" if self.http_socket else self.base_url

    async def stream(self, req: workloads.Req) -> AsyncIterator[Delta]:
        import aiohttp

        body = {"model": None, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.session.post(f"{self.base_url}/completions", json=body) as response:
                if response.status != 200:
                    raise BackendError(f"HTTP {response.status}: {(await response.text())[:200]}")
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise BackendError(event["error"].get("message", "error event"))
                    if event.get("usage"):
                        usage = event["usage"]
                        yield Delta(0, usage["completion_tokens"],
                                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                    elif event["choices"]:
                        yield Delta(1)
        except aiohttp.ClientError as exc:
            raise BackendError(f"{type(exc).__name__}: {exc}") from None


def make_backend(name: str, *, socket: str | None, base_url: str | None, http_socket: str | None,
                 api_key: str | None):
    if name == "socket":
        return SocketBackend(socket)
    if name == "openai":
        if base_url is None and http_socket is None:
            from llmd_client.socket_path import default_socket_path, http_socket_path
            http_socket = http_socket_path(default_socket_path(socket))
        return OpenAIBackend(base_url, http_socket, api_key)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
