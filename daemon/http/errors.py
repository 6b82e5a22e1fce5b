"""HTTP errors as values: an `ApiError` carries the status, a message for people, the
offending parameter and a stable code; each API writes it in its own error shape."""
from __future__ import annotations

from llmd_client.protocol import Error, SamplingParams

# Fields an intake or validation message may start with.
_FIELDS = frozenset(SamplingParams.__struct_fields__) | {"prompt", "messages", "cache_salt", "token_ids", "tools",
                                                          "dimensions"}

# The intake's stable error codes and the HTTP status each one means.
_STATUS = {"bad_request": 400, "invalid_params": 400, "too_long": 400, "forbidden": 403, "unknown_id": 404,
           "overloaded": 503, "shutting_down": 503, "internal": 500}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        """OpenAI's error type for this status."""
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"


def from_intake(error: Error, params: dict[str, str] | None = None) -> ApiError:
    """An intake Error as an ApiError. Its message starts with the field it concerns
    ("top_p must be in (0, 1]"); `params` renames internal fields to the API's names."""
    return ApiError(_STATUS.get(error.code, 400), error.message, param=param_of(error.message, params),
                    code=error.code)


def from_value_error(exc: ValueError, params: dict[str, str] | None = None) -> ApiError:
    message = str(exc)
    return ApiError(400, message, param=param_of(message, params), code="invalid_params")


def param_of(message: str, params: dict[str, str] | None = None) -> str | None:
    word = message.split(" ", 1)[0].split(".", 1)[0]
    if word not in _FIELDS:
        return None
    return (params or {}).get(word, word)
