"""From an HTTP handler to the engine and back: `Generation` admits one HTTP request's
engine requests (one per prompt) through the intake and yields their outputs as they
stream in, merged; leaving it early (the client went away, a write failed, the handler
was cancelled) aborts whatever is still running, so its KV blocks return at once."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from llmd.actors.request_sink import RequestSink
from llmd.http.context import MODEL_LEASE
from llmd.http.errors import ApiError, from_intake
from llmd.input_processor import PreparedRequest
from llmd_client.protocol import Embed, Error, Output, Submit


class HttpSink(RequestSink):
    """Puts a request's outputs, tagged with its slot, on the generation's queue."""

    __slots__ = ("queue", "slot")

    def __init__(self, queue: asyncio.Queue, slot: int) -> None:
        super().__init__(client_id=str(slot), stream=True)
        self.queue = queue
        self.slot = slot

    def send(self, message: object) -> None:
        self.queue.put_nowait((self.slot, message))


@dataclass
class Admitted:
    """One admitted engine request: its slot (the prompt's index) and what the intake made of it."""

    slot: int
    request_id: str
    prepared: PreparedRequest


class Generation:
    """`async with Generation(request) as gen:` then `await gen.admit(submits)` and
    `async for slot, output in gen`: the request's engine requests, on the model its
    handler took (llmd.http.context.served_model), for the client's uid. The iteration
    ends when every request has sent its last output (the one carrying usage). `view`,
    when given, is what the handler sees of each output; `first_token_at` holds when
    each slot's first token came (monotonic)."""

    def __init__(self, request: web.Request, *, params: dict[str, str] | None = None,
                 strict_max_tokens: bool = True, num_ctx: int | None = None,
                 view: Callable[[Output], Output] | None = None) -> None:
        self.intake = request.app["intake"]
        self.uid = request["uid"]
        self.lease = request.get(MODEL_LEASE)
        self.params = params
        self.strict_max_tokens = strict_max_tokens
        self.num_ctx = num_ctx
        self.view = view
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        self.admitted: list[Admitted] = []
        self.first_token_at: dict[int, float] = {}
        self._open: set[int] = set()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        unfinished = [a.request_id for a in self.admitted if a.slot in self._open]
        if unfinished:
            self.intake.abort(unfinished)
        self._open.clear()

    async def admit(self, submits: list[Submit | Embed]) -> list[Admitted]:
        """Admit every submit or none: an error (an ApiError naming the parameter) aborts
        those already admitted."""
        for slot, submit in enumerate(submits):
            sink = HttpSink(self.queue, slot)
            result = await self.intake.admit(submit, self.uid, sink, strict_max_tokens=self.strict_max_tokens,
                                             num_ctx=self.num_ctx, lease=self.lease)
            if isinstance(result, Error):
                raise from_intake(result, self.params)
            self.admitted.append(Admitted(slot, sink.request_id, result))
            self._open.add(slot)
        return self.admitted

    async def __aiter__(self) -> AsyncIterator[tuple[int, Output]]:
        while self._open:
            slot, message = await self.queue.get()
            if not isinstance(message, Output):
                continue
            if message.token_ids and slot not in self.first_token_at:
                self.first_token_at[slot] = time.monotonic()
            if message.usage is not None:
                self._open.discard(slot)
            yield slot, message if self.view is None else self.view(message)

    async def collect(self) -> dict[int, dict[int, Output]]:
        """The whole result: per slot, per sample index, one Output holding all its text,
        token ids and logprobs, its finish reason, and (on one of them) the usage; an
        embedding request's one Output as it came."""
        merged: dict[int, dict[int, Output]] = {}
        async for slot, out in self:
            samples = merged.setdefault(slot, {})
            into = samples.get(out.index)
            if into is None:
                samples[out.index] = Output(id=out.id, index=out.index, text=out.text, token_ids=list(out.token_ids),
                                            logprobs=list(out.logprobs) if out.logprobs is not None else None,
                                            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                                            error=out.error, usage=out.usage, prompt_logprobs=out.prompt_logprobs,
                                            embedding=out.embedding)
                continue
            into.text += out.text
            into.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                into.logprobs = (into.logprobs or []) + list(out.logprobs)
            for name in ("finish_reason", "stop_reason", "error", "usage", "prompt_logprobs", "embedding"):
                if getattr(out, name) is not None:
                    setattr(into, name, getattr(out, name))
        return merged


def engine_error(out: Output, guided_param: str = "response_format") -> ApiError | None:
    """A request the engine failed (a worker crash, a grammar that did not compile) as a
    server-side error for the HTTP client (or a bad request naming the API's
    `guided_param`, for a grammar); None if it did not."""
    if out.finish_reason != "error":
        return None
    message = out.error or "the request failed in the engine"
    status = 400 if message.startswith("guided") else 500
    return ApiError(status, message, param=guided_param if status == 400 else None, code="engine_error")


def raise_for_error(out: Output, guided_param: str = "response_format") -> None:
    error = engine_error(out, guided_param)
    if error is not None:
        raise error
