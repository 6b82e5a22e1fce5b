"""`keep_alive` durations, as Ollama reads them: a number of seconds or a Go duration
("5m", "1h30m", "300ms"); negative (or past Go's longest duration) means for ever, 0
means at once. Shared by the protocol's Submit and Load, the daemon's settings and the
HTTP faces, so every door accepts the same spellings."""
from __future__ import annotations

import math
import re

FOREVER = math.inf
# Go's time.ParseDuration units, in seconds.
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
MAX_DURATION_S = (2**63 - 1) / 1e9  # Go's time.Duration is int64 nanoseconds
MAX_DURATION_CHARS = 64  # a longer text is no duration anyone writes
KEEP_ALIVE_HELP = 'must be a number of seconds or a duration such as "5m" or "1h30m" (negative: for ever)'


def parse_duration(value: str | int | float, field: str = "keep_alive") -> float:
    """Seconds (FOREVER for a negative value or one past Go's longest duration). Raises
    ValueError naming `field` (and not echoing the value) for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{field} {KEEP_ALIVE_HELP}")
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_DURATION_CHARS:
            raise ValueError(f"{field} {KEEP_ALIVE_HELP}")
        seconds = float(text) if _NUMBER.fullmatch(text) else _go_duration(text, field)
    elif isinstance(value, (int, float)):
        seconds = float(value)
    else:
        raise ValueError(f"{field} {KEEP_ALIVE_HELP}")
    if math.isnan(seconds):
        raise ValueError(f"{field} {KEEP_ALIVE_HELP}")
    return FOREVER if seconds < 0 or seconds >= MAX_DURATION_S else seconds


def _go_duration(text: str, field: str) -> float:
    """Go's time.ParseDuration: an optional sign, then number-unit pairs ("1h30m",
    "1.5s", "300ms"); "0" alone needs no unit."""
    sign = -1.0 if text[:1] == "-" else 1.0
    body = text[1:] if text[:1] in ("-", "+") else text
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"{field} {KEEP_ALIVE_HELP}")
    pos, seconds = 0, 0.0
    while pos < len(body):
        match = _PART.match(body, pos)
        if match is None:
            raise ValueError(f"{field} {KEEP_ALIVE_HELP}")
        seconds += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    return sign * seconds


def describe_duration(seconds: float) -> str:
    """A keep_alive for people: "for ever", "0 s", "90 s", "5m", "1h30m"."""
    if seconds == FOREVER:
        return "for ever"
    if seconds < 60:
        return f"{seconds:g} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
