"""While the model loads: the protocol socket already accepts, and this responder answers
`hello` and `status` (engine_state "loading", how far, which phase) so `llmctl status`
says "loading (42%: weights)" instead of hanging. Anything else a client sends (a
submit, an abort) is held, unanswered, and the connection is handed to the intake with
those frames once the model is ready: requests sent during the load wait, as they did
in the listen backlog; connections that only said hello or asked for status are handed
over too, and go on.

The serving limits hold while loading: the connection limits in all and per user, the
idle timeout of a connection with nothing held, and a held connection is still read,
so a client that goes away frees its descriptor and its frames at once (its frames held
until the load ended, 3,000 such clients held 3,021 descriptors). Past HELD_BYTES of
held frames a connection is no longer read until the hand-over."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Protocol

import msgspec
import psutil

from llmd.actors.connection import codec_for, read_or_idle, tell_peer
from llmd.actors.connection_limits import OpenConnections
from llmd.actors.peer_credentials import peer_ids
from llmd_client.framing import MAX_NESTING_DEPTH, FrameError, JsonLinesCodec, MsgpackCodec
from llmd_client.protocol import (MAX_FRAME_BYTES, PROTOCOL_VERSION, Error, Hello, Status,
                                  StatusReply, Welcome)

logger = logging.getLogger("llmd.loading")
HELD_BYTES = 2 * MAX_FRAME_BYTES  # frames one connection may have waiting for the intake


class Progress(Protocol):
    """How far the load is (llmd.load_progress.LoadProgress, or the pool's view of it)."""

    @property
    def fraction(self) -> float: ...

    @property
    def phase(self) -> str: ...


class _Held:
    __slots__ = ("reader", "writer", "codec", "frames", "task", "uid")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec: MsgpackCodec | JsonLinesCodec | None = None
        self.frames: list[bytes] = []  # read, not yet answered: the intake answers them
        self.task: asyncio.Task | None = None
        self.uid = peer_ids(writer.get_extra_info("socket"))[0]


class LoadingResponder:
    def __init__(self, sock: socket.socket, progress: Progress, *, model: str, server_version: str,
                 listen_backlog: int = 4096, max_connections: int = 4096, max_connections_per_user: int = 256,
                 idle_timeout_s: float = 600.0) -> None:
        # A duplicate of the listening socket: closing this server must leave the real one open.
        self._sock = sock.dup()
        self._sock.setblocking(False)
        self.progress = progress
        self.model = model
        self.server_version = server_version
        self.listen_backlog = listen_backlog
        self.started = time.monotonic()
        self._connections: list[_Held] = []
        self._open = OpenConnections(max_connections, max_connections_per_user)
        self._adopt = None  # the intake's adopt, once the hand-over has begun
        self.idle_timeout_s = idle_timeout_s
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._on_connection, sock=self._sock, limit=1 << 16,
                                                       backlog=self.listen_backlog)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._adopt is not None:  # accepted as the hand-over began: the intake serves it alone
            await self._adopt(reader, writer)
            return
        held = _Held(reader, writer)
        refusal = self._open.refusal(held.uid)
        if refusal is not None:
            await self._refuse(held, refusal)
            return
        held.task = asyncio.current_task()
        self._open.add(held)
        self._connections.append(held)
        try:
            await self._serve(held)
        except asyncio.CancelledError:
            pass  # the hand-over: the connection goes on with the intake
        except (ConnectionError, OSError):  # the client went away mid-write
            self._drop(held)

    async def _read(self, held: _Held, size: int) -> bytes:
        """The next bytes; b"" at the end, or after the idle timeout with nothing held."""
        return await read_or_idle(held.reader, size, None if held.frames else self.idle_timeout_s)

    async def _serve(self, held: _Held) -> None:
        """Answer hello/status until a frame that needs the engine arrives; from then on
        hold what arrives for the intake, reading on to see the client go."""
        data = await self._read(held, 1)
        if not data:
            return self._drop(held)
        held.codec = codec_for(data, max_depth=MAX_NESTING_DEPTH)
        while data:
            try:
                frames = held.codec.feed(data)
            except FrameError:
                held.frames.append(b"")  # the intake reports it; the stream is lost anyway
                return
            for i, body in enumerate(frames):
                if held.frames or not self._answer(held, body):
                    held.frames += frames[i:]  # held, in order, for the intake
                    break
            await held.writer.drain()
            if sum(map(len, held.frames)) > HELD_BYTES:
                await asyncio.Event().wait()  # read no more: the hand-over cancels this wait
            data = await self._read(held, 1 << 16)
        self._drop(held)

    async def _refuse(self, held: _Held, error: Error) -> None:
        """Tell the peer (in its framing) that it cannot stay, then close."""
        try:
            await tell_peer(held.reader, held.writer, error)
        finally:
            held.writer.close()

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
        if not held.writer.is_closing():  # closed by close() (a failed load) after this frame was read
            held.writer.write(held.codec.encode(reply))
        return True

    def _drop(self, held: _Held) -> None:
        if held in self._connections:
            self._connections.remove(held)
        self._open.discard(held)
        held.frames = []
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
        self._adopt = adopt
        if self._server is not None:
            self._server.close()
        # Until no task of ours reads any more: a connection whose task began during these
        # awaits is cancelled too (handed over uncancelled, it had two readers: "read()
        # called while another coroutine is already waiting").
        while live := [h for h in self._connections if h.task is not None and not h.task.done()
                       and h.task is not asyncio.current_task()]:
            for held in live:
                held.task.cancel()  # it waits on a read: nothing read is lost
            await asyncio.gather(*(held.task for held in live), return_exceptions=True)
        handed, self._connections = self._connections, []
        for held in handed:
            self._open.discard(held)
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
            if held.writer.transport.get_write_buffer_size():
                # Replies backed up unread: a graceful close would wait for this client to
                # read them, its task's read with it, and the daemon's exit on that task.
                held.writer.transport.abort()
            else:
                held.writer.close()
        self._connections = []
