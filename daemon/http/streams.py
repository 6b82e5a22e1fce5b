"""Streamed HTTP bodies: server-sent events as the OpenAI SDKs parse them (`data: JSON`
blocks, then `data: [DONE]`; the Responses API's named events), and newline-delimited
JSON as Ollama's clients read it."""
from __future__ import annotations

import msgspec
from aiohttp import web

_json = msgspec.json.Encoder()


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


class EventStream:
    """text/event-stream: each event one `data:` line and a blank line."""

    content_type = "text/event-stream"

    def __init__(self) -> None:
        self.response = web.StreamResponse(headers={"Content-Type": self.content_type, "Cache-Control": "no-cache",
                                                    "X-Accel-Buffering": "no"})

    async def open(self, request: web.Request) -> None:
        await self.response.prepare(request)

    def frame(self, body: object) -> bytes:
        return b"data: " + _json.encode(body) + b"\n\n"

    async def send(self, body: object) -> None:
        await self.response.write(self.frame(body))

    async def close(self, done_marker: bool = True) -> web.StreamResponse:
        if done_marker:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


class NdjsonStream(EventStream):
    """application/x-ndjson: one JSON object a line (Ollama's streaming)."""

    content_type = "application/x-ndjson"

    def frame(self, body: object) -> bytes:
        return _json.encode(body) + b"\n"

    async def close(self, done_marker: bool = False) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


class TypedEventStream(EventStream):
    """The Responses API's events: each named by its body's `type` (`event:` line) and
    numbered in order (`sequence_number`); the stream ends with no [DONE]."""

    def __init__(self) -> None:
        super().__init__()
        self.sequence_number = 0

    def frame(self, body: dict) -> bytes:
        body = {**body, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + body["type"].encode() + b"\n" + super().frame(body)

    async def close(self, done_marker: bool = False) -> web.StreamResponse:
        return await super().close(done_marker)
