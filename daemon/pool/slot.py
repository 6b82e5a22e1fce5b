"""One model's place in the pool: its state, who uses it (`Lease`s) and who waits for
it, when it goes, and what it holds. The pool (pool.py) changes these; `SlotView` is the
copy the metrics actor reads for `llmctl status` and `llmctl ps`. No torch, no engine."""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from llmd.load_progress import LoadProgress
from llmd.pool.registry import ModelSpec
from llmd_client.durations import FOREVER


class SlotState(enum.Enum):
    UNLOADED = "unloaded"
    QUEUED = "queued"  # wanted: waiting for room (or for its estimate)
    LOADING = "loading"
    SERVING = "serving"
    UNLOADING = "unloading"
    SLEEPING = "sleeping"  # going to sleep (requests wait, then wake it)
    ASLEEP = "asleep"  # loaded, its KV cache freed and its weights in host memory (level 1) or dropped (2)
    WAKING = "waking"  # requests wait
    FAILED = "failed"  # the last load failed, or its engine died: the next request loads it afresh


class ModelUnavailable(RuntimeError):
    """A model could not be made to serve: its load failed, it cannot fit, it failed
    while serving, or the daemon is stopping. `code` is the protocol's error code."""

    def __init__(self, message: str, code: str = "model_unavailable") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SlotView:
    """A model as `llmctl status` and `llmctl ps` show it (the pool's side of it)."""

    name: str
    aliases: tuple[str, ...] = ()
    path: str = ""
    default: bool = False
    task: str = "generate"
    state: str = "unloaded"
    load_progress: float | None = None
    load_phase: str | None = None
    memory_bytes: int = 0  # what the budget counts: held while loaded, else estimated (0: not yet)
    memory_estimated: bool = True
    waiting: int = 0  # requests waiting for it to serve
    keep_alive_s: float = FOREVER
    expires_at: float | None = None  # Unix time it goes, when idle with a finite keep_alive
    last_used: float | None = None  # Unix time
    error: str | None = None
    sleep_level: int | None = None  # while sleeping or asleep: 1 or 2
    idle_action: str = "unload"  # what keep_alive's end does: "unload" or "sleep"


@dataclass(eq=False)
class ModelSlot:
    spec: ModelSpec
    state: SlotState = SlotState.UNLOADED
    model: Any = None  # the LoadedModel while serving
    progress: LoadProgress | None = None  # while loading
    pins: int = 0  # requests (and HTTP handlers) using the loaded model
    waiting: int = 0  # acquirers waiting for it to serve
    generation: int = 0  # bumped at each load and forced teardown: older pins are void
    draining: bool = False  # chosen to make room: no new pins, unloaded once idle
    unload_when_idle: bool = False  # asked to unload (llmctl unload, keep_alive 0)
    sleep_when_idle: int | None = None  # asked to sleep at this level (llmctl sleep) once its requests are done
    sleep_level: int | None = None  # while sleeping or asleep: the level
    sleeps: int = 0  # sleeps completed (what a `sleep` call waits to see grow)
    awake_need: dict[str, int] | None = None  # device -> bytes it holds awake (`need` holds the asleep figures)
    keep_alive_s: float = FOREVER  # how long it stays once idle (the last request's, else the spec's)
    idle_since: float | None = None  # monotonic, while loaded and idle
    last_used_wall: float | None = None
    timer: asyncio.TimerHandle | None = None
    ready: asyncio.Future | None = None  # waiters' wake-up: resolved when it serves, failed with the attempt
    error: str | None = None
    need: dict[str, int] | None = None  # device -> bytes: estimated, then held once loaded
    measured: bool = False  # `need` is what the loaded model held (not an estimate)
    estimating: bool = False
    last_used: float = field(default=0.0)  # monotonic, for least-recently-used eviction
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set at every state change

    def __post_init__(self) -> None:
        self.keep_alive_s = self.spec.keep_alive_s

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def idle(self) -> bool:
        return self.state is SlotState.SERVING and self.pins == 0 and self.waiting == 0

    @property
    def resident(self) -> bool:
        """Holding (or about to hold) memory."""
        return self.state in (SlotState.LOADING, SlotState.SERVING, SlotState.UNLOADING, SlotState.SLEEPING,
                              SlotState.ASLEEP, SlotState.WAKING)

    def set_state(self, state: SlotState) -> None:
        self.state = state
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def view(self) -> SlotView:
        progress = self.progress if self.state is SlotState.LOADING else None
        expires = None
        if self.state is SlotState.SERVING and self.keep_alive_s != FOREVER:
            since = self.idle_since if self.idle_since is not None else time.monotonic()
            expires = time.time() + max(0.0, since + self.keep_alive_s - time.monotonic())
        return SlotView(name=self.name, aliases=self.spec.aliases, path=self.spec.path, default=self.spec.default,
                        task=self.spec.engine.task,
                        state=self.state.value if self.state is not SlotState.QUEUED else "loading",
                        load_progress=progress.fraction if progress else (0.0 if self.state is SlotState.QUEUED
                                                                            else None),
                        load_phase=progress.phase if progress else ("queued" if self.state is SlotState.QUEUED
                                                                     else None),
                        memory_bytes=sum((self.need or {}).values()), memory_estimated=not self.measured,
                        waiting=self.waiting, keep_alive_s=self.keep_alive_s, expires_at=expires,
                        last_used=self.last_used_wall, error=self.error, sleep_level=self.sleep_level,
                        idle_action=self.spec.idle_action)


class Lease:
    """A pin on a serving model: `model` is its LoadedModel. `share()` takes another
    pin for the same holder's request; `release()` (idempotent) lets go, keeping the
    model for `keep_alive` (seconds; None: the model's own) once it is idle."""

    __slots__ = ("slot", "model", "generation", "keep_alive", "_on_release", "_held")

    def __init__(self, slot: ModelSlot, keep_alive: float | None, on_release: Callable[[Lease], None]) -> None:
        self.slot, self.keep_alive, self._on_release = slot, keep_alive, on_release
        self.model = slot.model  # the one pinned (a model loaded again later is another)
        self.generation = slot.generation
        self._held = True

    @property
    def valid(self) -> bool:
        """The pinned model still serves (not failed and torn down since)."""
        return self._held and self.generation == self.slot.generation and self.slot.state is SlotState.SERVING

    def share(self) -> Lease:
        self.slot.pins += 1
        return Lease(self.slot, self.keep_alive, self._on_release)

    def release(self) -> None:
        if self._held:
            self._held = False
            self._on_release(self)


def wake(slot: ModelSlot, error: BaseException | None = None) -> None:
    """Wake those waiting for the slot: to look again, or with the attempt's error."""
    ready, slot.ready = slot.ready, None
    if ready is not None and not ready.done():
        if error is None:
            ready.set_result(None)
        else:
            ready.set_exception(error)


def retrieve(future: asyncio.Future) -> None:
    """A waiters' future's done-callback: its error is read, so one nobody waited for
    is not logged as lost."""
    if not future.cancelled():
        future.exception()


def describe_failure(exc: BaseException) -> str:
    """A load's (or sleep's, or wake's) failure for people: the error's own message
    (ValueError, OSError name the setting or file), else its type."""
    if isinstance(exc, (ValueError, OSError, RuntimeError)) and str(exc):
        return str(exc).splitlines()[0][:500]
    return type(exc).__name__
