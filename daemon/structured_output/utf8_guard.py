"""Keeps guided output valid UTF-8 where xgrammar's lenient decoding would not (see
Utf8Guard): one extra mask per bitmask row, from the output's incomplete last character.
"""
from __future__ import annotations

import codecs
from collections import OrderedDict
from typing import Any


class Utf8Guard:
    """Keeps guided output valid UTF-8.

    xgrammar checks characters on a lenient UTF-8 decoding: a lead byte followed by the
    right number of continuation bytes passes even when it is an overlong form (E0 9A 9C)
    or an encoded surrogate (ED B5 BD). With byte-level tokens a model can spell those,
    and the text then decodes to U+FFFD: a JSON string longer than its maxLength, a
    choice that is not one. This guard ANDs each bitmask row with the tokens that keep
    the output's bytes a valid UTF-8 prefix (Python's strict decoder is the judge), given
    the incomplete character at the end of the output so far ("tail", 0-3 bytes)."""

    CACHE_SIZE = 1024

    def __init__(self, token_bytes: list[bytes], words_per_row: int) -> None:
        import numpy as np

        self.token_bytes = token_bytes
        self.words = words_per_row
        # After a complete character every token is judged; after an incomplete one only
        # tokens that start with a continuation byte (or have no bytes) can be valid.
        self._continuing = [i for i, b in enumerate(token_bytes) if not b or 0x80 <= b[0] < 0xC0]
        self._masks: OrderedDict[bytes, Any] = OrderedDict()
        self._np = np

    def mask(self, tail: bytes):
        """[words] int32: bit set where the token keeps `tail` + token valid UTF-8."""
        mask = self._masks.get(tail)
        if mask is not None:
            self._masks.move_to_end(tail)
            return mask
        np = self._np
        allowed = np.zeros(self.words * 32, dtype=bool)
        candidates = range(len(self.token_bytes)) if not tail else self._continuing
        for i in candidates:
            data = self.token_bytes[i]
            allowed[i] = not data or _utf8_tail(tail + data) is not None
        mask = np.packbits(allowed, bitorder="little").view("<i4")
        self._masks[tail] = mask
        if len(self._masks) > self.CACHE_SIZE:
            self._masks.popitem(last=False)
        return mask

    def advance(self, tail: bytes, token_id: int) -> bytes | None:
        """The tail after `token_id`, or None if the token would break UTF-8."""
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        return _utf8_tail(tail + data)


def _utf8_tail(data: bytes) -> bytes | None:
    """None if `data` is not a valid UTF-8 prefix; else its incomplete last character."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    return decoder.getstate()[0]
