"""Ollama's `keep_alive`: how long its server keeps a model loaded after a request (a
number of seconds or a Go duration such as "5m" or "1h30m"; negative: for ever; 0:
unload at once). llmd checks it (a bad value is a 400 naming it) and records the expiry
it asks for, which /api/ps reports; llmd cannot unload its model yet, so nothing acts on
it. A request without keep_alive asks for llmd's own default: the model stays loaded."""
from __future__ import annotations

import math
import re
import time
from datetime import datetime, timezone

from llmd.http.errors import ApiError

FOREVER = math.inf
# Go's time.ParseDuration units, in seconds.
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
MAX_DURATION_S = (2**63 - 1) / 1e9  # Go's time.Duration is int64 nanoseconds
# How /api/ps writes "never" (any far-future time parses in Ollama's clients).
NEVER_TEXT = "9999-12-31T23:59:59Z"


def parse_keep_alive(value: str | int | float) -> float:
    """Seconds to keep the model after a request (FOREVER for a negative value or one
    past Go's longest duration, as Ollama reads keep_alive); a string that is neither a
    number nor a Go duration is a 400 naming keep_alive (and not echoing it)."""
    if isinstance(value, bool):
        raise _invalid()
    if isinstance(value, str):
        value = value.strip()
        seconds = float(value) if _NUMBER.fullmatch(value) else _go_duration(value)
    else:
        seconds = float(value)
    return FOREVER if seconds < 0 or seconds >= MAX_DURATION_S else seconds


def _go_duration(text: str) -> float:
    """Go's time.ParseDuration: an optional sign, then number-unit pairs ("1h30m",
    "1.5s", "300ms"); "0" alone needs no unit."""
    sign = -1.0 if text[:1] == "-" else 1.0
    body = text[1:] if text[:1] in ("-", "+") else text
    if body == "0":
        return 0.0
    if not body:
        raise _invalid()
    pos, seconds = 0, 0.0
    while pos < len(body):
        match = _PART.match(body, pos)
        if match is None:
            raise _invalid()
        seconds += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    return sign * seconds


def _invalid() -> ApiError:
    return ApiError(400, 'keep_alive must be a number of seconds or a duration such as "5m" or "1h30m" '
                         '(negative: keep the model loaded)', param="keep_alive")


class KeepAlive:
    """When the model would be unloaded, as the last request's keep_alive asks (from
    that request's end). Reported, not acted on: llmd cannot unload its model yet."""

    def __init__(self) -> None:
        self.expires_at = FOREVER  # Unix time

    def record(self, seconds: float | None) -> None:
        """A request ended that asked for `seconds` (None: it did not say: llmd's default, for ever)."""
        self.expires_at = FOREVER if seconds is None or seconds == FOREVER else time.time() + seconds

    def expires_at_text(self) -> str:
        if self.expires_at == FOREVER:
            return NEVER_TEXT
        return datetime.fromtimestamp(self.expires_at, timezone.utc).isoformat().replace("+00:00", "Z")
