"""What the blocking Stream and the asyncio AsyncStream share: one request's ids, when
its stream has ended, and the rule that closing a stream before its end aborts it."""
from __future__ import annotations

from typing import Any

from llmd_client.protocol import Accepted, Output
from llmd_client.results import Delta, delta_from, is_last
from llmd_client.routing import Router


class RequestStream:
    """The state of one streamed request on a client's connection (`id`: its local id).
    `request_id` and `prompt_tokens` are set once the daemon accepted it; the subclasses
    do the waiting (blocking or awaited)."""

    def __init__(self, client: Router[Any, Any], id: str) -> None:
        self.request_id: str | None = None
        self.prompt_tokens: int | None = None
        self._client = client
        self._id = id
        self._started = False
        self._done = False

    def _accept(self, accepted: Accepted) -> None:
        self._started = True
        self.request_id = accepted.request_id
        self.prompt_tokens = accepted.prompt_tokens

    def _delta(self, output: Output) -> Delta:
        """The Delta for the request's next Output; the last one ends the stream."""
        if is_last(output):
            self._done = True
        return delta_from(output)

    def close(self) -> None:
        """Abort the request if it is still running (no await needed)."""
        if not self._done:
            self._done = True
            if self._started:
                self._client._abandon(self._id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
