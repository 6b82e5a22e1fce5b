"""One protocol connection, from its first byte to its close: the framing it speaks
(msgpack frames, or JSON lines when the first byte is `{`), its messages decoded and
dispatched, its requests (a closed connection aborts them all) and its idle timeout.
The table of open connections and their limits is actors/connection_limits.py."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Protocol

import msgspec

from llmd.actors.connection_limits import CLOSE_TIMEOUT_S
from llmd.actors.error_text import frame_error_message, safe_message
from llmd.actors.peer_credentials import peer_ids
from llmd.actors.request_sink import RequestSink
from llmd.input_processor import PreparedRequest
from llmd_client.framing import MAX_NESTING_DEPTH, FrameError, JsonLinesCodec, MsgpackCodec, NestingError
from llmd_client.protocol import (MAX_ID_CHARS, PROTOCOL_VERSION, Abort, Accepted, ClientMessage, Embed, Error,
                                  Hello, Load, Metrics, MetricsReply, Models, ModelsReply, Sleep, Status, Submit,
                                  Unload, Wake, Welcome)

logger = logging.getLogger("llmd.intake")
MAX_CLIENT_ID_CHARS = MAX_ID_CHARS


class ConnectionOwner(Protocol):
    """What a connection asks of the intake that accepted it."""

    registry: dict[str, tuple[RequestSink, int, object]]
    connections: OpenConnections
    welcome: Welcome
    idle_timeout_s: float

    def is_admin(self, uid: int, gid: int) -> bool: ...

    async def admit(self, submit: Submit | Embed, uid: int, sink: RequestSink) -> Error | PreparedRequest: ...

    def must_wait(self, submit: Submit | Embed) -> bool: ...

    def abort(self, request_ids: list[str]) -> None: ...

    async def query(self, kind: str, uid: int, admin: bool) -> object: ...

    async def load_model(self, requested: str | None, keep_alive: float | str | None) -> ModelsReply | Error: ...

    async def unload_model(self, requested: str) -> ModelsReply | Error: ...

    async def sleep_model(self, requested: str | None, level: int) -> ModelsReply | Error: ...

    async def wake_model(self, requested: str | None) -> ModelsReply | Error: ...


class ConnectionSink(RequestSink):
    """A request submitted on a protocol connection, under the connection's id for it."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection, client_id: str, stream: bool) -> None:
        super().__init__(client_id, stream)
        self.conn = conn

    @property
    def connection(self) -> object:
        return self.conn

    def send(self, message: object) -> None:
        self.conn.send(message)

    @property
    def wanted(self) -> bool:
        return not self.conn.closed

    def finished(self) -> None:
        self.conn.requests.pop(self.client_id, None)
        super().finished()


def codec_for(first: bytes, **options) -> MsgpackCodec | JsonLinesCodec:
    """The codec of a peer whose first byte is `first`: JSON lines start with `{`."""
    return (JsonLinesCodec if first == b"{" else MsgpackCodec)(ClientMessage, **options)


async def read_or_idle(reader: asyncio.StreamReader, size: int, idle_timeout_s: float | None) -> bytes:
    """The next bytes; b"" at the peer's end or after `idle_timeout_s` of silence (None:
    no limit)."""
    if idle_timeout_s is None:
        return await reader.read(size)
    try:
        return await asyncio.wait_for(reader.read(size), idle_timeout_s)
    except TimeoutError:
        return b""


async def tell_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: Error) -> None:
    """Send `error` in the peer's framing (known from its first byte, awaited 2 s at
    most), for a peer that cannot stay; the caller closes."""
    try:
        first = await asyncio.wait_for(reader.read(1), 2.0)
        if first:
            writer.write(codec_for(first).encode(error))
            await asyncio.wait_for(writer.drain(), 2.0)
    except (TimeoutError, ConnectionError):
        pass


class Connection:
    def __init__(self, intake: ConnectionOwner, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.intake = intake
        self.reader = reader
        self.writer = writer
        self.codec: MsgpackCodec | JsonLinesCodec | None = None
        self.requests: dict[str, RequestSink] = {}
        # Submits waiting for their model to load (admitted beside the connection's other
        # work), and Load/Unload/Sleep/Wake waits; by client id, so abort and close end them.
        self.waiting: dict[str, asyncio.Task] = {}
        self._controls: set[asyncio.Task] = set()
        self.closed = False
        self.uid, self.gid = peer_ids(writer.get_extra_info("socket"))
        self.admin = intake.is_admin(self.uid, self.gid)
        self._local_ids = itertools.count(1)

    def send(self, message: object) -> None:
        # The peer may have gone before this connection's reader noticed: drop, don't raise
        # (the reader's end-of-stream aborts the connection's requests).
        if self.closed or self.codec is None or self.writer.is_closing():
            return
        self.writer.write(self.codec.encode(message))

    async def _read(self, size: int) -> bytes:
        """The next bytes from the peer; b"" at its end, or when it stayed silent for the
        idle timeout with no request in flight (an idle connection holds a descriptor)."""
        busy = self.requests or self.waiting or self._controls
        return await read_or_idle(self.reader, size, None if busy else self.intake.idle_timeout_s)

    async def refuse(self, error: Error) -> None:
        """Tell the peer why it cannot stay (in its own framing), then close."""
        try:
            await tell_peer(self.reader, self.writer, error)
        finally:
            await self._close()

    async def serve(self, codec: MsgpackCodec | JsonLinesCodec | None = None, held: list[bytes] = ()) -> None:
        """Serve the connection to its end. `codec` and `held` (frames read but not yet
        answered) continue a connection the loading responder took while the model loaded."""
        try:
            if codec is None:
                data = await self._read(1)
                if not data:
                    return
                self.codec = codec_for(data, max_depth=MAX_NESTING_DEPTH)
            else:
                self.codec, data = codec, b""
                self.codec.max_depth = MAX_NESTING_DEPTH
            # A connection handed over from the load may hold no frame at all (it said hello
            # or asked for status, and waits to submit): it is read from, not closed.
            pending = list(held)
            while True:
                try:
                    frames = pending + self.codec.feed(data)
                    pending = []
                except FrameError as exc:
                    self.send(Error(code="bad_frame", message=safe_message(exc)))
                    return  # the stream cannot be resynchronised
                for body in frames:
                    await self._dispatch_frame(body)
                    if self.closed or self.writer.is_closing():  # frames read before a close go unanswered
                        return
                await self.writer.drain()
                data = await self._read(1 << 16)
                if not data:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            logger.exception("connection handler failed")
        finally:
            await self._close()

    async def _dispatch_frame(self, body: bytes) -> None:
        try:
            message = self.codec.decode(body)
        except NestingError as exc:  # the frame is intact: say why, and go on serving
            self.send(Error(code="bad_frame", message=str(exc)))
            return
        except msgspec.ValidationError as exc:
            text = frame_error_message(exc)
            if text.endswith("at `$.type`") or "missing required field `type`" in text:
                self.send(Error(code="bad_request", message="unknown or missing message type"))
            elif "`$.sampling" in text or "`$.pooling" in text:
                self.send(Error(code="invalid_params", message=text))
            else:
                self.send(Error(code="bad_request", message=text))
            return
        except (msgspec.DecodeError, UnicodeDecodeError):
            what = "UTF-8 JSON" if self.codec.json else "msgpack (strings must be UTF-8)"
            self.send(Error(code="bad_frame", message=f"frame is not valid {what}"))
            return
        try:
            await self._dispatch(message)
        except Exception:  # a bug must not take the connection's peer down with a traceback
            logger.exception("internal error handling a %s message", type(message).__name__)
            self.send(Error(code="internal", message="internal error; see the daemon log"))

    async def _dispatch(self, message: object) -> None:
        match message:
            case Hello(protocol_version=version):
                if version != PROTOCOL_VERSION:
                    self.send(Error(code="unsupported_version",
                                    message=f"protocol version {version} is not supported (this daemon speaks "
                                            f"{PROTOCOL_VERSION})"))
                    self.closed = True
                    return
                self.send(self.intake.welcome)
            case Submit() | Embed():
                await self._submit(message)
            case Abort(id=ident):
                self._abort(ident)
            case Status():
                self.send(await self.intake.query("status", self.uid, self.admin))
            case Metrics():
                self.send(MetricsReply(await self.intake.query("metrics", self.uid, self.admin)))
            case Models():
                self.send(await self.intake.query("models", self.uid, self.admin))
            case Load(model=model, keep_alive=keep_alive):
                self._in_background(self.intake.load_model(model, keep_alive))
            case Unload(model=model):
                self._in_background(self.intake.unload_model(model))
            case Sleep(model=model, level=level):
                self._in_background(self.intake.sleep_model(model, level))
            case Wake(model=model):
                self._in_background(self.intake.wake_model(model))

    def _in_background(self, answer) -> None:
        """A control message that may wait for a load, an unload, a sleep or a wake: answered when done,
        while the connection goes on."""
        async def run() -> None:
            try:
                self.send(await answer)
            except Exception:
                logger.exception("internal error answering a load, unload, sleep or wake")
                self.send(Error(code="internal", message="internal error; see the daemon log"))

        task = asyncio.ensure_future(run())
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    async def _submit(self, submit: Submit | Embed) -> None:
        """A request to generate (Submit) or to embed (Embed): both are admitted, answered
        with Accepted, and followed by their outputs under the connection's id."""
        if submit.id is not None and len(submit.id) > MAX_CLIENT_ID_CHARS:  # first: it is never echoed whole
            self.send(Error(code="bad_request", message=f"id must have at most {MAX_CLIENT_ID_CHARS} characters"))
            return
        client_id = submit.id if submit.id is not None else f"c{next(self._local_ids)}"
        if isinstance(submit, Submit):
            sources, names = (submit.prompt, submit.messages, submit.token_ids), "prompt, messages or token_ids"
        else:
            sources, names = (submit.prompt, submit.token_ids), "prompt or token_ids"
        if sum(x is not None for x in sources) != 1:
            self.send(Error(code="bad_request", id=client_id, message=f"exactly one of {names} is required"))
            return
        if client_id in self.requests or client_id in self.waiting:
            self.send(Error(code="bad_request", id=client_id, message="id is already in use on this connection"))
            return
        sink = ConnectionSink(self, client_id, submit.stream if isinstance(submit, Submit) else False)
        if not self.intake.must_wait(submit):
            await self._admit(submit, sink)
            return
        task = asyncio.ensure_future(self._admit(submit, sink))
        self.waiting[client_id] = task
        task.add_done_callback(lambda t: self.waiting.pop(client_id, None) if self.waiting.get(client_id) is t else None)

    async def _admit(self, submit: Submit | Embed, sink: ConnectionSink) -> None:
        try:
            result = await self.intake.admit(submit, self.uid, sink)
        except asyncio.CancelledError:
            return  # aborted or closed while its model loaded: answered by _abort, or nobody to tell
        except Exception:  # a bug must not take the connection's peer down with a traceback
            logger.exception("internal error admitting a request")
            self.send(Error(code="internal", id=sink.client_id, message="internal error; see the daemon log"))
            return
        if isinstance(result, Error):
            self.send(result)
        elif sink.wanted:
            self.requests[sink.client_id] = sink
            self.send(Accepted(id=sink.client_id, request_id=sink.request_id, prompt_tokens=len(result.token_ids)))

    def _abort(self, ident: str) -> None:
        waiting = self.waiting.get(ident)
        if waiting is not None and not waiting.done():  # never admitted: it ends here, never started
            del self.waiting[ident]
            waiting.cancel()
            self.send(Error(code="aborted", id=ident, message="aborted while its model was loading; it never started"))
            return
        sink = self.requests.get(ident)
        if sink is None:
            entry = self.intake.registry.get(ident)
            # Another user's request answers as a missing one: whether an id exists is
            # none of this user's business (an administrator may abort any request).
            if entry is None or (entry[1] != self.uid and not self.admin):
                self.send(Error(code="unknown_id", id=ident[:MAX_CLIENT_ID_CHARS],
                                message="no such request of yours in flight"))
                return
            sink = entry[0]
        self.intake.abort([sink.request_id])

    async def _close(self) -> None:
        self.closed = True
        for task in [*self.waiting.values(), *self._controls]:
            task.cancel()
        if self.requests:
            self.intake.abort([s.request_id for s in self.requests.values()])
        try:
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), CLOSE_TIMEOUT_S)
        except TimeoutError:  # the peer stopped reading after the close began
            self.writer.transport.abort()
        except (ConnectionError, OSError):
            pass
        finally:  # counted until its descriptor is closed; a daemon's stop waits for this
            self.intake.connections.discard(self)
