"""Where one admitted request's outputs go: the detokenizer holds a `RequestSink` per
request and neither knows nor cares whether a socket connection or an HTTP response
stands behind it."""
from __future__ import annotations

import abc
from collections.abc import Callable


class RequestSink(abc.ABC):
    """Where the detokenizer sends one request's outputs (`send`) and says that the request
    is over (`finished`). Subclasses deliver to a socket connection or an HTTP response."""

    __slots__ = ("client_id", "request_id", "stream", "finished_samples", "release")

    def __init__(self, client_id: str, stream: bool) -> None:
        self.client_id = client_id
        self.request_id = ""  # set on admission
        self.stream = stream
        self.finished_samples: set[int] = set()
        self.release: Callable[[], None] | None = None  # set on admission: gives back what it held

    @abc.abstractmethod
    def send(self, message: object) -> None:
        """Deliver one message to the request's client."""

    @property
    def wanted(self) -> bool:
        """False once the peer has gone: a request it no longer waits for is not started."""
        return True

    @property
    def connection(self) -> object | None:
        """What the per-connection request limit counts against (None: no such limit)."""
        return None

    def finished(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None
