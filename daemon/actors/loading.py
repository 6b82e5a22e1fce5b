"""While the model loads: the protocol socket already accepts, and this responder answers
`hello` and `status` (engine_state "loading", how far, which phase) so `llmctl status`
says "loading (42%: weights)" instead of hanging. Anything else a client sends (a
submit, an abort) is held, unanswered, and the connection is handed to the intake with
those frames once the model is ready: requests sent during the load wait, as they did
in the listen backlog."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import msgspec
import psutil

from llmd.load_progress import LoadProgress
from llmd_client.framing import FrameError, JsonLinesCodec, MsgpackCodec
from llmd_client.protocol import (PROTOCOL_VERSION, ClientMessage, Error, Hello, Status, StatusReply, Welcome)

logger = logging.getLogger("llmd.loading")


class _Held:
    __slots__ = ("reader", "writer", "codec", "frames", "task")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec: MsgpackCodec | JsonLinesCodec | None = None
        self.frames: list[bytes] = []  # read, not yet answered: the intake answers them
        self.task: asyncio.Task | None = None


class LoadingResponder:
    def __init__(self, sock: socket.socket, progress: LoadProgress, *, model: str, server_version: str,
                 listen_backlog: int = 4096) -> None:
        # A duplicate of the listening socket: closing this server must leave the real one open.
        self._sock = sock.dup()
        self._sock.setblocking(False)
        self.progress = progress
        self.model = model
        self.server_version = server_version
        self.listen_backlog = listen_backlog
        self.started = time.monotonic()
        self._connections: list[_Held] = []
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._on_connection, sock=self._sock, limit=1 << 16,
                                                       backlog=self.listen_backlog)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = _Held(reader, writer)
        held.task = asyncio.current_task()
        self._connections.append(held)
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve(held)

    async def _serve(self, held: _Held) -> None:
        """Answer hello/status until a frame that needs the engine arrives, then wait."""
        data = await held.reader.read(1)
        if not data:
            return self._drop(held)
        held.codec = (JsonLinesCodec if data == b"{" else MsgpackCodec)(ClientMessage)
        while data:
            try:
                frames = held.codec.feed(data)
            except FrameError:
                held.frames.append(b"")  # the intake reports it; the stream is lost anyway
                return
            for i, body in enumerate(frames):
                if not self._answer(held, body):
                    held.frames = frames[i:]
                    return  # hold the rest for the intake
            await held.writer.drain()
            data = await held.reader.read(1 << 16)
        self._drop(held)

    def _answer(self, held: _Held, body: bytes) -> bool:
        try:
            message = held.codec.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return False
        match message:
            case Hello(protocol_version=version) if version == PROTOCOL_VERSION:  # others: the intake refuses
                reply: object = Welcome(protocol_version=PROTOCOL_VERSION, server_version=self.server_version,
                                        model=self.model)
            case Status():
                reply = self.status()
            case _:
                return False
        held.writer.write(held.codec.encode(reply))
        return True

    def _drop(self, held: _Held) -> None:
        if held in self._connections:
            self._connections.remove(held)
        held.writer.close()

    def status(self) -> StatusReply:
        return StatusReply(
            model=self.model, server_version=self.server_version, uptime_s=time.monotonic() - self.started,
            device="", dtype="", num_running=0, num_waiting=0, requests=[], kv_blocks_total=0, kv_blocks_used=0,
            kv_usage=0.0, prefix_cache_hit_rate=0.0, generation_tokens_per_s=0.0, prompt_tokens_total=0,
            generation_tokens_total=0, requests_finished_total=0, rss_bytes=psutil.Process().memory_info().rss,
            cpu_percent=0.0, engine_state="loading", load_progress=self.progress.fraction,
            load_phase=self.progress.phase)

    async def hand_over(self, adopt) -> None:
        """Stop accepting (new clients wait in the backlog for the intake) and give every
        connection, with the frames it holds, to `adopt(reader, writer, codec, frames)`."""
        if self._server is not None:
            self._server.close()
        for held in list(self._connections):
            if held.task is not None and held.task is not asyncio.current_task():
                held.task.cancel()  # it waits on a read: nothing read is lost
                with contextlib.suppress(asyncio.CancelledError):
                    await held.task
        handed, self._connections = self._connections, []
        for held in handed:
            if held.writer.is_closing():
                continue
            asyncio.ensure_future(adopt(held.reader, held.writer, held.codec, held.frames))

    def close(self, error: Error | None = None) -> None:
        """The load failed or the daemon stops: tell the waiting clients, close them."""
        if self._server is not None:
            self._server.close()
        for held in self._connections:
            if error is not None and held.codec is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    held.writer.write(held.codec.encode(error))
            held.writer.close()
        self._connections = []
