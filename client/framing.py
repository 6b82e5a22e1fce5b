"""Frame codecs for the socket protocol: 4-byte big-endian length + msgpack, or
newline-delimited JSON (chosen by the peer's first byte being `{`)."""
from __future__ import annotations

import struct
from typing import Any

import msgspec

from llmd_client.protocol import MAX_FRAME_BYTES

_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The byte stream cannot be framed (oversized frame); the connection must close."""


class _Codec:
    """Encoder, typed decoder and receive buffer; subclasses define the framing."""

    json: bool
    _format: Any  # msgspec.msgpack or msgspec.json

    def __init__(self, decode_type: Any, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._encoder = self._format.Encoder()
        self._decoder = self._format.Decoder(decode_type)
        self._buffer = bytearray()
        self.max_frame = max_frame

    def decode(self, body: bytes) -> Any:
        return self._decoder.decode(body)

    @property
    def pending(self) -> int:
        return len(self._buffer)


class MsgpackCodec(_Codec):
    json = False
    _format = msgspec.msgpack

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
