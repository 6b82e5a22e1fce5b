"""Ollama's `keep_alive` on the HTTP faces: how long the model stays loaded after a
request (a number of seconds or a Go duration such as "5m"; negative: for ever; 0:
unload once this reply is done). A bad value is a 400 naming keep_alive, not echoing
it. The model pool (llmd.pool) acts on it; /api/ps shows the expiry as Ollama writes it."""
from __future__ import annotations

from datetime import datetime, timezone

from llmd.http.errors import ApiError
from llmd_client.durations import FOREVER, parse_duration

__all__ = ["FOREVER", "NEVER_TEXT", "expires_at_text", "parse_keep_alive"]

# How /api/ps writes "never" (any far-future time parses in Ollama's clients).
NEVER_TEXT = "9999-12-31T23:59:59Z"


def parse_keep_alive(value: str | int | float | None) -> float | None:
    """Seconds to keep the model after the request (FOREVER: for ever; None: the request
    did not say, so the model's own keep_alive applies)."""
    if value is None:
        return None
    try:
        return parse_duration(value, "keep_alive")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="keep_alive") from None


def expires_at_text(expires_at: float | None) -> str:
    """A Unix time as Ollama's /api/ps writes it; None (never) as the far future."""
    if expires_at is None or expires_at == FOREVER:
        return NEVER_TEXT
    return datetime.fromtimestamp(expires_at, timezone.utc).isoformat().replace("+00:00", "Z")

