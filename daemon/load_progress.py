"""Where loading the model stands: the phase and how far through it, for `llmctl status`
("loading (42%: weights)") and for the person watching the daemon start: a progress bar
(tqdm) when stderr is a terminal, a log line per quarter otherwise.

Phases share the whole by weight: reading the weights is most of a load."""
from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger("llmd.load")

class LoadCancelled(Exception):
    """The daemon stopped while the model loaded: the load gave up at its next step."""


PHASES = {"tokenizer": 0.05, "workers": 0.05, "weights": 0.75, "kv cache": 0.05, "cuda graphs": 0.10}


class LoadProgress:
    """Thread-safe: the model thread advances it, the event loop reads it (and may cancel
    the load: the next phase or tensor then raises LoadCancelled, and worker processes
    still loading are killed, see llmd.gpu.worker.mp_executor)."""

    def __init__(self, show_bar: bool | None = None) -> None:
        self._lock = threading.Lock()
        self.cancelled = threading.Event()
        self.phase = "starting"
        self._done_weight = 0.0  # of finished phases
        self._phase_fraction = 0.0
        self._show_bar = sys.stderr.isatty() if show_bar is None else show_bar
        self._bar = None
        self._logged_quarter = -1

    @property
    def fraction(self) -> float:
        with self._lock:
            return min(1.0, self._done_weight + PHASES.get(self.phase, 0.0) * self._phase_fraction)

    def cancel(self) -> None:
        self.cancelled.set()

    def check(self) -> None:
        if self.cancelled.is_set():
            self._close_bar()
            raise LoadCancelled("the daemon stopped while the model loaded")

    def begin(self, phase: str, total: int | None = None) -> None:
        self.check()
        with self._lock:
            self._done_weight += PHASES.get(self.phase, 0.0)  # the phase that ends
            self.phase, self._phase_fraction, self._logged_quarter = phase, 0.0, -1
        self._close_bar()
        if self._show_bar and total:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=f"llmd: {phase}", unit="tensor", leave=False, file=sys.stderr)
        logger.info("loading: %s", phase)

    def advance(self, done: int, total: int) -> None:
        self.check()
        with self._lock:
            self._phase_fraction = done / total if total else 1.0
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
        quarter = int(4 * done / total) if total else 4
        if not self._show_bar and quarter > self._logged_quarter and quarter in (1, 2, 3):
            self._logged_quarter = quarter
            logger.info("loading: %s %d%% (%d of %d)", self.phase, 25 * quarter, done, total)

    def track(self, phase: str, items: Iterable[T], total: int) -> Iterator[T]:
        """Yield `items`, counting them as `phase`'s progress out of `total`."""
        self.begin(phase, total)
        for done, item in enumerate(items, 1):
            yield item
            self.advance(done, total)

    def finish(self) -> None:
        self._close_bar()
        with self._lock:
            self.phase, self._done_weight, self._phase_fraction = "done", 1.0, 0.0

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
