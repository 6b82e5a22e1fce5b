"""When to restart a failed worker, and when to stop trying: restarts back off
exponentially with the failures in a sliding window, and too many failures in that
window mean the engine is dead (the daemon exits and its service manager decides what
next). Pure logic, no clock of its own: callers pass time.monotonic()."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    backoff_s: float = 1.0  # before the first restart in a window; doubles with each failure
    backoff_max_s: float = 30.0
    max_failures: int = 5  # this many failures within window_s: the engine is dead
    window_s: float = 600.0
    total_failures: int = 0
    _recent: collections.deque[float] = field(default_factory=collections.deque)

    def record_failure(self, now: float) -> float | None:
        """Count a failure at `now`; the delay before the next restart, or None when
        the failures in the window have reached max_failures."""
        self.total_failures += 1
        while self._recent and self._recent[0] <= now - self.window_s:
            self._recent.popleft()
        self._recent.append(now)
        if len(self._recent) >= self.max_failures:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2 ** (len(self._recent) - 1))

    @property
    def recent_failures(self) -> int:
        return len(self._recent)

    def describe_window(self) -> str:
        return f"{len(self._recent)} worker failures within {self.window_s:g} s"
