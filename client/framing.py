"""Frame codecs for the socket protocol: 4-byte big-endian length + msgpack, or
newline-delimited JSON (chosen by the peer's first byte being `{`); and the nesting
limit the daemon holds what its peers send to (frames, and HTTP JSON bodies)."""
from __future__ import annotations

import struct
from typing import Any

import msgspec

from llmd_client.protocol import MAX_FRAME_BYTES

_HEADER = struct.Struct(">I")

# Arrays and objects (maps) may nest this deep in one message. msgspec decodes nested
# containers recursively and stops only at Python's recursion limit (RecursionError, at
# about 1,000 levels less the caller's stack); a real request nests a few levels, a
# guided-decoding JSON schema at most about 130 (its own limit is 64 schema levels, so
# it is refused there with the more precise message), and what is decoded is walked
# again later.
MAX_NESTING_DEPTH = 256
# Bytes that may start a msgpack array or map (fixmap, fixarray, array16/32, map16/32).
_NOT_MSGPACK_CONTAINER = bytes(b for b in range(256) if not (0x80 <= b <= 0x9f or 0xdc <= b <= 0xdf))


class FrameError(Exception):
    """The byte stream cannot be framed (oversized frame); the connection must close."""


class NestingError(msgspec.DecodeError):
    """A message nests arrays or objects deeper than MAX_NESTING_DEPTH. The frame itself
    is intact: the connection can answer it and go on."""

    def __init__(self, limit: int = MAX_NESTING_DEPTH) -> None:
        super().__init__(f"message nests arrays or objects more than {limit} levels deep")
        self.limit = limit


def json_too_deep(body: bytes, limit: int = MAX_NESTING_DEPTH) -> bool:
    """Whether JSON text nests arrays/objects more than `limit` levels deep. Cheap: a
    body with no more than `limit` opening brackets (nearly every request) is only
    counted; otherwise the brackets outside strings are summed up in numpy (an 8 MiB
    body in about 0.1 s). Text that is not JSON may answer either way: its
    decoder reports it."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    import numpy as np  # here: a client that never meets such a body never imports it

    # Without its escaped backslashes and quotes (backslashes pair up from the left),
    # every quote left opens or closes a string.
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    inside = np.bitwise_xor.accumulate((text == ord('"')).view(np.uint8)).view(bool)
    steps = ((text == ord("[")) | (text == ord("{"))).view(np.int8) - \
        ((text == ord("]")) | (text == ord("}"))).view(np.int8)
    steps[inside] = 0
    return int(np.cumsum(steps, dtype=np.int32).max()) > limit


def _msgpack_too_deep(body: bytes, message: Any, limit: int) -> bool:
    """The same limit for a decoded msgpack message: a frame with no more than `limit`
    bytes that could open a container cannot nest deeper; otherwise the message, as
    JSON (the same nesting), is measured."""
    if len(body.translate(None, _NOT_MSGPACK_CONTAINER)) <= limit:
        return False
    try:
        text = msgspec.json.encode(message)
    except (TypeError, ValueError, msgspec.MsgspecError):  # msgpack-only values (extension types)
        return False
    return json_too_deep(text, limit)


def decode_json(body: bytes, decoder: Any, limit: int | None = MAX_NESTING_DEPTH) -> Any:
    """`decoder.decode(body)` for JSON text, refusing nesting past `limit` (NestingError,
    a msgspec.DecodeError) before decoding, and turning the decoder's own recursion
    limit into the same error."""
    if limit is not None and json_too_deep(body, limit):
        raise NestingError(limit)
    try:
        return decoder.decode(body)
    except RecursionError:
        raise NestingError(limit or MAX_NESTING_DEPTH) from None


class _Codec:
    """Encoder, typed decoder and receive buffer; subclasses define the framing."""

    json: bool
    _format: Any  # msgspec.msgpack or msgspec.json

    def __init__(self, decode_type: Any, max_frame: int = MAX_FRAME_BYTES, max_depth: int | None = None) -> None:
        """`max_depth`: the nesting limit (the daemon sets MAX_NESTING_DEPTH for what its
        peers send); None leaves only the decoder's own recursion limit, reported as
        NestingError too."""
        self._encoder = self._format.Encoder()
        self._decoder = self._format.Decoder(decode_type)
        self._buffer = bytearray()
        self.max_frame = max_frame
        self.max_depth = max_depth

    def decode(self, body: bytes) -> Any:
        """One frame's message. Raises msgspec's DecodeError/ValidationError, or
        NestingError (a DecodeError) for nesting past max_depth."""
        return decode_json(body, self._decoder, self.max_depth)

    @property
    def pending(self) -> int:
        return len(self._buffer)


class MsgpackCodec(_Codec):
    json = False
    _format = msgspec.msgpack

    def decode(self, body: bytes) -> Any:
        try:
            message = self._decoder.decode(body)
        except RecursionError:
            raise NestingError(self.max_depth or MAX_NESTING_DEPTH) from None
        if self.max_depth is not None and _msgpack_too_deep(body, message, self.max_depth):
            raise NestingError(self.max_depth)
        return message

    def encode(self, message: Any) -> bytes:
        body = self._encoder.encode(message)
        return _HEADER.pack(len(body)) + body

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the complete frame bodies. Raises FrameError for a
        frame over the size limit (its length is known before its body arrives)."""
        self._buffer += data
        frames = []
        while len(self._buffer) >= 4:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > self.max_frame:
                raise FrameError(f"frame of {size} bytes exceeds the limit of {self.max_frame}")
            if len(self._buffer) < 4 + size:
                break
            frames.append(bytes(self._buffer[4:4 + size]))
            del self._buffer[:4 + size]
        return frames


class JsonLinesCodec(_Codec):
    json = True
    _format = msgspec.json

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message) + b"\n"

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > self.max_frame:
                    raise FrameError(f"line exceeds the limit of {self.max_frame} bytes")
                break
            line = bytes(self._buffer[:end])
            del self._buffer[:end + 1]
            if line.strip():
                frames.append(line)
        return frames
