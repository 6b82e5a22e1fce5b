"""Error messages that are safe to send back to a client: the text of a validation
error keeps the field names, paths and types msgspec puts in it and drops every value
(which may be the client's own input, or another user's), bounded in length."""
from __future__ import annotations

import re

from llmd_client.protocol import SamplingParams

_QUOTED_VALUE = re.compile(r"'[^']*'|\"[^\"]*\"")
_BACKTICKED = re.compile(r"`([^`]*)`")
# What msgspec puts in backticks: field names, `$.paths` and type names (`int | null`).
_NAME = re.compile(r"[$A-Za-z_][A-Za-z0-9_.$\[\] |,]{0,63}")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(.*?)`( - at `\$[A-Za-z0-9_.\[\]]*`)?$", re.S)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def safe_message(exc: BaseException, limit: int = 300) -> str:
    """An error's text without any (possibly user-supplied) values, bounded. msgspec
    names fields, paths and types in backticks and quotes values: names are kept (a name
    that is not a plain identifier or path could be anything, and is dropped too)."""
    text = str(exc)
    unknown = _UNKNOWN_FIELD.match(text)
    if unknown:  # the field's name is the client's: keep it only when it is a plain name
        name = unknown.group(1) if _IDENTIFIER.fullmatch(unknown.group(1)) else "<value>"
        return f"Object contains unknown field `{name}`{unknown.group(2) or ''}"[:limit]
    text = _QUOTED_VALUE.sub("<value>", text)
    text = _BACKTICKED.sub(lambda m: m.group(0) if _NAME.fullmatch(m.group(1)) else "<value>", text)
    return text[:limit]


def frame_error_message(exc: BaseException) -> str:
    """A readable reason for a frame that does not decode as a message."""
    text = safe_message(exc)
    unknown = _UNKNOWN_FIELD.match(text)
    if unknown and unknown.group(1) in SamplingParams.__struct_fields__ and not unknown.group(2):
        return f"unknown field `{unknown.group(1)}`: sampling fields go in `sampling`"
    return text
