"""The asyncio client: one connection, one reader task that hands each frame to the
request (by its connection-local id) or the reply waiting for it, so any number of
generate/stream calls may run concurrently on one AsyncClient.

    async with AsyncClient() as llm:
        results = await asyncio.gather(*(llm.generate(p, max_tokens=32) for p in prompts))
        async for delta in llm.stream("Once upon a time", max_tokens=64):
            print(delta.text, end="", flush=True)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Unpack, overload

from llmd_client.errors import ConnectionLost, LlmdError, ProtocolError
from llmd_client.framing import FrameError, MsgpackCodec
from llmd_client.protocol import (Accepted, ChatMessage, Embed, Error, Hello, Load, Metrics, MetricsReply, Models,
                                  ModelsReply, ModelStatus, Output, ServerMessage, Sleep, Status, StatusReply, Submit,
                                  Unload, Wake, Welcome)
from llmd_client.request_args import EmbedInput, RequestArgs, build_embeds, build_submit
from llmd_client.results import Delta, Embedding, Result, ResultBuilder, embedding_from
from llmd_client.routing import PendingReply, Router, reply_error
from llmd_client.socket_path import connect_error, default_socket_path
from llmd_client.streaming import RequestStream

_RECV_BYTES = 1 << 16
_Item = Accepted | Output | Error | LlmdError


class _PendingFuture(PendingReply):
    """Resolved through a future; a cancelled caller's reply is dropped."""

    __slots__ = ("future",)

    def __init__(self, expect: type, future: asyncio.Future[Any]) -> None:
        super().__init__(expect)
        self.future = future

    def resolve(self, reply: Any) -> None:
        if not self.future.done():
            self.future.set_result(reply)


class AsyncClient(Router[asyncio.Queue[_Item], _PendingFuture]):
    """asyncio client; `socket` as for Client. Connects on first use (or `await
    connect()`, or `async with`), and again after the connection was lost. Use
    asyncio.timeout() around a call to bound it; cancelling a call aborts its request."""

    def __init__(self, socket: str | None = None) -> None:
        super().__init__()
        self.socket_path = default_socket_path(socket)
        self.welcome: Welcome | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._codec = MsgpackCodec(ServerMessage)
        self._reader_task: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        # Models, Load, Unload, Sleep and Wake all answer a ModelsReply, the last four once done:
        # one at a time, so each reply meets its own call.
        self._model_controls = asyncio.Lock()

    # -- connection ---------------------------------------------------------------------

    async def connect(self) -> Welcome:
        async with self._connect_lock:
            if self._writer is not None and self.welcome is not None:
                return self.welcome
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as exc:
                raise connect_error(self.socket_path, exc) from None
            self._writer = writer
            self._codec = MsgpackCodec(ServerMessage)
            self._reader_task = asyncio.create_task(self._read_loop(reader, writer), name="llmd-client-reader")
            try:
                reply = await self._control(Hello(client="llmd_client"), Welcome)
            except BaseException:
                await self.close()
                raise
            self.welcome = reply
            return reply

    async def close(self) -> None:
        """Close the connection; the daemon aborts every request still running on it."""
        writer, task = self._writer, self._reader_task
        self._reader_task = None
        if writer is not None:
            self._drop_connection(writer, lambda: ConnectionLost("the client was closed"))
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait([task])  # unlike awaiting it, never swallows our own cancellation
        if writer is not None:
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests -----------------------------------------------------------------------

    async def generate(self, prompt: str | None = None, **args: Unpack[RequestArgs]) -> Result:
        """Run one request to the end; arguments and errors as for Client.generate."""
        submit = build_submit(self._new_id(), prompt, args, stream=False)
        accepted = await self._submit(submit)
        builder = ResultBuilder(accepted, submit.sampling.n)
        with self._abandoned_on_error(accepted.id):
            while not builder.done:
                builder.add(await self._next_output(accepted.id))
        return builder.result()

    def stream(self, prompt: str | None = None, **args: Unpack[RequestArgs]) -> AsyncStream:
        """`async for delta in llm.stream(...)`. The request is submitted on the first
        iteration (or `await stream.start()`); leaving the loop early, cancelling the
        task, or `await stream.aclose()` aborts it. Settings are checked right here."""
        return AsyncStream(self, build_submit(self._new_id(), prompt, args, stream=True))

    async def chat(self, messages: Iterable[ChatMessage | Mapping[str, Any]], **kwargs: Any) -> Result:
        return await self.generate(messages=messages, **kwargs)

    @overload
    async def embed(self, input: str | Sequence[int], *, normalize: bool = True, dimensions: int | None = None,
                    truncate: bool = False, priority: int = 0,
                    model: str | None = None, keep_alive: float | str | None = None) -> Embedding: ...

    @overload
    async def embed(self, input: Sequence[str | Sequence[int]], *, normalize: bool = True,
                    dimensions: int | None = None, truncate: bool = False, priority: int = 0,
                    model: str | None = None, keep_alive: float | str | None = None) -> list[Embedding]: ...

    async def embed(self, input: EmbedInput, *, normalize: bool = True, dimensions: int | None = None,
                    truncate: bool = False, priority: int = 0,
                    model: str | None = None, keep_alive: float | str | None = None) -> Embedding | list[Embedding]:
        """Embeddings as Client.embed; the inputs run concurrently, and a failure (or a
        cancellation) aborts those still running."""
        embeds, single = build_embeds(self._new_id, input, normalize=normalize, dimensions=dimensions,
                                      truncate=truncate, priority=priority, model=model, keep_alive=keep_alive)
        await self._ensure_connected()
        tasks = [asyncio.ensure_future(self._embed_one(embed)) for embed in embeds]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # the first failure is raised; the others are aborted
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: asyncio would log it as never retrieved
            raise
        return results[0] if single else results

    async def _embed_one(self, embed: Embed) -> Embedding:
        accepted = await self._submit(embed)
        with self._abandoned_on_error(accepted.id):
            return embedding_from(accepted, await self._next_output(accepted.id))

    async def abort(self, request_id: str) -> None:
        """Abort a request by its server id; errors as for Client.abort."""
        await self._ensure_connected()
        if not self._abort_own(request_id):
            with self._abort_other(request_id):
                await self._control(Status(), StatusReply)

    async def status(self) -> StatusReply:
        await self._ensure_connected()
        return await self._control(Status(), StatusReply)

    async def metrics(self) -> str:
        await self._ensure_connected()
        return (await self._control(Metrics(), MetricsReply)).text

    async def models(self) -> list[ModelStatus]:
        """As Client.models."""
        await self._ensure_connected()
        async with self._model_controls:
            return (await self._control(Models(), ModelsReply)).models

    async def load(self, model: str | None = None, keep_alive: float | str | None = None) -> ModelStatus:
        """As Client.load."""
        await self._ensure_connected()
        async with self._model_controls:
            return (await self._control(Load(model=model, keep_alive=keep_alive), ModelsReply)).models[0]

    async def unload(self, model: str) -> ModelStatus:
        """As Client.unload."""
        await self._ensure_connected()
        async with self._model_controls:
            return (await self._control(Unload(model=model), ModelsReply)).models[0]

    async def sleep(self, model: str | None = None, level: int = 1) -> ModelStatus:
        """As Client.sleep."""
        await self._ensure_connected()
        async with self._model_controls:
            return (await self._control(Sleep(model=model, level=level), ModelsReply)).models[0]

    async def wake(self, model: str | None = None) -> ModelStatus:
        """As Client.wake."""
        await self._ensure_connected()
        async with self._model_controls:
            return (await self._control(Wake(model=model), ModelsReply)).models[0]

    # -- internals ----------------------------------------------------------------------

    async def _ensure_connected(self) -> None:
        if self._writer is None or self.welcome is None:
            await self.connect()

    async def _submit(self, submit: Submit | Embed) -> Accepted:
        await self._ensure_connected()
        assert submit.id is not None
        self._inboxes[submit.id] = asyncio.Queue()
        with self._abandoned_on_error(submit.id):
            self._send(submit)
            reply = await self._next_message(submit.id)
        return self._accepted(submit.id, reply)

    async def _next_output(self, id: str) -> Output:
        return self._output(id, await self._next_message(id))

    async def _next_message(self, id: str) -> Accepted | Output | Error:
        queue = self._inboxes.get(id)
        if queue is None:
            raise ConnectionLost(f"the connection to llmd at {self.socket_path} was lost")
        item = await queue.get()
        if isinstance(item, LlmdError):
            self._inboxes.pop(id, None)
            raise item
        return item

    async def _control(self, message: Hello | Status | Metrics | Models | Load | Unload | Sleep | Wake,
                       expect: type) -> Any:
        self._send(message)  # first: a send that fails leaves no future behind
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(_PendingFuture(expect, future))
        reply = await future  # a cancelled future's reply is dropped by its resolve()
        if isinstance(reply, Error):
            raise reply_error(reply)
        return reply

    def _send(self, message: Any) -> None:
        if self._writer is None or self._writer.is_closing():
            raise ConnectionLost(f"not connected to llmd at {self.socket_path}")
        self._writer.write(self._codec.encode(message))

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        codec = self._codec
        error: Callable[[], LlmdError] = lambda: ConnectionLost(
            f"llmd closed the connection ({self.socket_path})")
        try:
            while data := await reader.read(_RECV_BYTES):
                for body in codec.feed(data):
                    self._route(codec.decode(body))
        except (FrameError, ValueError) as exc:  # msgspec.DecodeError is a ValueError
            message = f"llmd sent a frame this client cannot read: {exc}"
            error = lambda: ProtocolError(message)
        except OSError as exc:
            message = f"lost the connection to llmd at {self.socket_path}: {exc}"
            error = lambda: ConnectionLost(message)
        self._drop_connection(writer, error)

    def _drop_connection(self, writer: asyncio.StreamWriter, error: Callable[[], LlmdError]) -> None:
        """Fail everything waiting on this connection with a fresh `error()` each."""
        if self._writer is not writer:
            return
        self._writer = None
        self.welcome = None
        writer.close()
        for queue in self._inboxes.values():
            queue.put_nowait(error())
        self._inboxes.clear()
        self._local_ids.clear()
        for pending in self._pending:
            if not pending.future.done():
                pending.future.set_exception(error())
        self._pending.clear()

    def _deliver(self, inbox: asyncio.Queue[_Item], message: Accepted | Output | Error) -> None:
        inbox.put_nowait(message)


class AsyncStream(RequestStream):
    """Async iterator of one request's Deltas; also an async context manager that
    aborts the request on exit if it is still running."""

    _client: AsyncClient

    def __init__(self, client: AsyncClient, submit: Submit) -> None:
        super().__init__(client, submit.id or "")
        self._submit = submit

    async def start(self) -> AsyncStream:
        """Submit the request and wait until the daemon accepted it."""
        if not self._started:
            self._started = True
            self._accept(await self._client._submit(self._submit))
        return self

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            await self.start()
            output = await self._client._next_output(self._id)
        except BaseException:
            self.close()
            raise
        return self._delta(output)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncStream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()
