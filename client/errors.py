"""Exceptions raised by the llmd clients. Every one has a stable `code` for programs and a
message for people; none of them needs a traceback to be understood."""
from __future__ import annotations


class LlmdError(Exception):
    """Base of every error the clients raise."""

    code = "error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class DaemonNotRunning(LlmdError):
    """Nothing listens on the socket (it is missing, or a stale file refuses connections)."""

    code = "daemon_not_running"

    def __init__(self, socket_path: str, reason: str = "no socket") -> None:
        super().__init__(
            f"llmd is not running ({reason} at {socket_path}); start it with `llmd serve` "
            "or `systemctl start llmd`, or point LLMD_SOCKET / --socket at its socket")
        self.socket_path = socket_path


class RequestError(LlmdError):
    """The daemon refused or failed a request: `code` is the daemon's (invalid_params,
    too_long, unknown_id, forbidden, overloaded, shutting_down, internal, ...)."""

    def __init__(self, code: str, message: str, id: str | None = None) -> None:
        super().__init__(message, code)
        self.id = id


class ProtocolError(LlmdError):
    """The daemon sent something this client cannot understand, or refused the client's
    protocol version (code "unsupported_version")."""

    code = "protocol_error"


class ConnectionLost(LlmdError):
    """The socket closed while a request or reply was outstanding."""

    code = "connection_lost"


class ClientTimeout(LlmdError, TimeoutError):
    """No message came from the daemon within the client's timeout."""

    code = "timeout"
