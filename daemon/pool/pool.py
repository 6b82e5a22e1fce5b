"""The model pool: the models a daemon serves, loaded on demand and unloaded when idle.

A request for a model takes a `Lease` on it (`acquire`): at once when it serves, else
after its load, which the first request starts (later ones wait on the same load). A
lease pins the model: while any is held the model is busy and never unloaded. When the
last one goes the model is idle, and unloaded after its keep_alive (the last request's,
else the model's own; 0: at once; for ever: never). A model that does not fit the
budget (budget.py) makes room by evicting idle models, least recently used first; busy
victims take no new leases and go once idle; the loads wanting room wait in turn, first
come first served. A model that cannot fit even alone, or fails to load, fails the
requests waiting for it (ModelUnavailable) and is tried afresh by the next one.

A request that stops waiting (its client went away) lets go; a load already running
goes on (the model then idles out by its keep_alive), one not yet started is dropped.
Loading and unloading themselves are the `loader` and the loaded model's `stop` (see
loaded_model.py); the pool only decides, so it is tested with stand-ins."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from llmd.load_progress import LoadProgress
from llmd.pool.budget import MemoryBudget, Resident, place
from llmd.pool.registry import ModelRegistry, ModelSpec
from llmd.pool.sleep_control import SleepControl
from llmd.pool.slot import (Lease, ModelSlot, ModelUnavailable, SlotState, SlotView, describe_failure, retrieve,
                            wake)
from llmd_client.durations import FOREVER

logger = logging.getLogger("llmd.pool")
Loader = Callable[[ModelSpec, LoadProgress], Awaitable[Any]]  # -> a LoadedModel (loaded_model.py)
Estimator = Callable[[ModelSpec], Awaitable[dict[str, int]]]


class ModelPool(SleepControl):
    def __init__(self, registry: ModelRegistry, budget: MemoryBudget, *, loader: Loader, estimator: Estimator,
                 on_failed: Callable[[Any, str], None] | None = None) -> None:
        """`loader(spec, progress)` loads a model; `estimator(spec)` says what it will
        hold per device; `on_failed(model, reason)` ends the requests of a model whose
        engine failed while serving (set by the server once the intake exists)."""
        self.registry, self.budget = registry, budget
        self._loader, self._estimator = loader, estimator
        self.on_failed = on_failed
        self.slots: dict[str, ModelSlot] = {spec.name: ModelSlot(spec) for spec in registry.listed()}
        self._queue: list[ModelSlot] = []  # loads waiting for room, first come first served
        self._tasks: set[asyncio.Task] = set()
        self.closing = False
        self.fatal = asyncio.Event()  # the only model's engine died: the daemon exits (one-model daemons)
        self.fatal_reason = ""

    # -- what requests ask ----------------------------------------------------------------
    def resolve(self, requested: str | None) -> ModelSpec:
        """The model `requested` names (raises UnknownModel)."""
        return self.registry.resolve(requested)

    def slot(self, spec: ModelSpec) -> ModelSlot:
        slot = self.slots.get(spec.name)
        if slot is None:
            slot = self.slots[spec.name] = ModelSlot(spec)
        return slot

    def serving_now(self, spec: ModelSpec) -> bool:
        """A lease on it would be granted without waiting."""
        slot = self.slots.get(spec.name)
        return slot is not None and slot.state is SlotState.SERVING and not slot.draining

    async def acquire(self, spec: ModelSpec, keep_alive: float | None = None) -> Lease:
        """A lease on the model, once it serves (loading it first when needed). Raises
        ModelUnavailable when it cannot be made to serve."""
        slot = self.slot(spec)
        slot.waiting += 1
        try:
            while True:
                if self.closing:
                    raise ModelUnavailable("the daemon is shutting down", code="shutting_down")
                if slot.state is SlotState.SERVING and not slot.draining:
                    return self._pin(slot, keep_alive)
                if slot.ready is None:
                    slot.ready = asyncio.get_running_loop().create_future()
                    slot.ready.add_done_callback(retrieve)
                ready = slot.ready
                if slot.state in (SlotState.UNLOADED, SlotState.FAILED):
                    self._enqueue(slot)
                elif slot.state is SlotState.ASLEEP:
                    self._enqueue_wake(slot)
                await asyncio.shield(ready)
        finally:
            slot.waiting -= 1
            self._after_waiter_left(slot)

    async def load(self, spec: ModelSpec, keep_alive: float | None = None) -> ModelSlot:
        """Load a model (if it is not loaded) and keep it for `keep_alive` from now."""
        lease = await self.acquire(spec, keep_alive)
        lease.release()
        return lease.slot

    async def unload(self, spec: ModelSpec) -> ModelSlot:
        """Unload a model once its requests are done (new ones wait, and load it again
        after), or at once when it is asleep; returns when it is unloaded."""
        slot = self.slot(spec)
        while slot.state is not SlotState.UNLOADED and slot.state is not SlotState.FAILED:
            changed = slot.changed
            if slot.state is SlotState.SERVING:
                slot.unload_when_idle = True
                if slot.idle:
                    self._start_unload(slot)
            elif slot.state is SlotState.ASLEEP:
                self._start_unload(slot)  # requests waiting for its wake load it again after
            elif slot.state is SlotState.QUEUED and slot.waiting == 0:
                self._dequeue(slot)
                continue
            await changed.wait()
        return slot

    def snapshot(self) -> list[SlotView]:
        return [slot.view() for slot in self.slots.values()]

    def loaded(self) -> list[Any]:
        return [s.model for s in self.slots.values() if s.model is not None]

    # -- pins and idleness ------------------------------------------------------------------
    def _pin(self, slot: ModelSlot, keep_alive: float | None) -> Lease:
        slot.pins += 1
        slot.idle_since = None
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        if self._queue:
            self._rebalance()  # a load waiting for room may now ask this one to go once done
        return Lease(slot, keep_alive, self._release)

    def _release(self, lease: Lease) -> None:
        slot = lease.slot
        if lease.generation != slot.generation:
            return  # the model it pinned was torn down since
        slot.pins -= 1
        slot.keep_alive_s = lease.keep_alive if lease.keep_alive is not None else slot.spec.keep_alive_s
        slot.last_used, slot.last_used_wall = time.monotonic(), time.time()
        self._check_idle(slot)

    def _after_waiter_left(self, slot: ModelSlot) -> None:
        if slot.waiting == 0 and slot.state is SlotState.QUEUED:
            self._dequeue(slot)  # nobody wants it any more: a load not started is dropped
        elif slot.waiting == 0 and slot.state is SlotState.ASLEEP and slot in self._queue:
            self._queue.remove(slot)  # a wake not started: it sleeps on
            self._rebalance()
        self._check_idle(slot)

    def _check_idle(self, slot: ModelSlot) -> None:
        """A model whose last user left: unloaded now (draining, asked to) or put to
        sleep (asked to), else at the end of its keep_alive (0: now) unloaded or put to
        sleep as its idle_action says; a load waiting for room may now evict it. A model
        chosen to make room goes as soon as its requests are done, whoever waits for it
        (they wait their turn to load it again)."""
        if slot.state is SlotState.SERVING and slot.pins == 0 and slot.draining:
            self._start_unload(slot)
            self._rebalance()
            return
        if not slot.idle:
            return
        slot.idle_since = time.monotonic()
        if slot.unload_when_idle:
            self._start_unload(slot)
        elif slot.sleep_when_idle is not None:
            self._start_sleep(slot, slot.sleep_when_idle)
        elif slot.keep_alive_s <= 0:
            self._idle_action(slot)
        elif slot.keep_alive_s != FOREVER and slot.timer is None:
            slot.timer = asyncio.get_running_loop().call_later(slot.keep_alive_s, self._expire, slot)
        self._rebalance()

    def _expire(self, slot: ModelSlot) -> None:
        slot.timer = None
        if slot.idle:
            logger.info("%s idle for its keep_alive (%.0f s)", slot.name, slot.keep_alive_s)
            self._idle_action(slot)

    def _idle_action(self, slot: ModelSlot) -> None:
        """keep_alive ended: unload the model, or put it to sleep (its idle_action)."""
        if slot.spec.idle_action == "sleep":
            self._start_sleep(slot, slot.spec.sleep_level)
        else:
            self._start_unload(slot)

    # -- loads wanting room ----------------------------------------------------------------
    def _enqueue(self, slot: ModelSlot) -> None:
        slot.error = None
        slot.set_state(SlotState.QUEUED)
        self._queue.append(slot)
        if not self.budget.bytes_per_device:
            slot.need = slot.need or {}  # only counted, not weighed: no estimate needed
        if slot.need is None and not slot.estimating:
            slot.estimating = True
            self._spawn(self._estimate(slot))
        self._rebalance()

    def _dequeue(self, slot: ModelSlot) -> None:
        if slot in self._queue:
            self._queue.remove(slot)
        slot.set_state(SlotState.UNLOADED)
        self._forget_if_ad_hoc(slot)
        self._rebalance()

    async def _estimate(self, slot: ModelSlot) -> None:
        try:
            slot.need = await self._estimator(slot.spec)
        except Exception as exc:  # the files cannot say: the load would fail too
            logger.error("cannot estimate the memory of %s: %s", slot.name, exc)
            slot.need = None
            if slot.state is SlotState.QUEUED:
                self._queue.remove(slot)
                self._fail_attempt(slot, f"its files cannot be read: {describe_failure(exc)}")
        finally:
            slot.estimating = False
        self._rebalance()

    def _rebalance(self) -> None:
        """Start the loads that fit, in turn; for the first that does not, evict what
        makes room (idle models now, busy ones once idle) and let the rest wait."""
        if self.closing:
            return
        victims_when_idle: set[str] = set()
        for slot in list(self._queue):
            waking = slot.state is SlotState.ASLEEP
            need = slot.awake_need if waking else slot.need
            if need is None:
                break  # its estimate comes first: later loads wait their turn
            # A model whose waiters are about to take it (just loaded, or no longer
            # draining) is not evicted under them: once they hold it, it is busy. An
            # asleep model no request waits for may go.
            residents = [Resident(s.name, s.need or {},
                                  (s.state is SlotState.SERVING and (s.draining or s.waiting == 0))
                                  or (s.state is SlotState.ASLEEP and s.waiting == 0),
                                  s.pins > 0 or s.waiting > 0, s.last_used)
                         for s in self.slots.values() if s.resident and s is not slot]
            placement = place(need, residents, self.budget)
            if placement.never is not None:
                self._queue.remove(slot)
                if waking:  # it fitted once: only a budget changed under it gets here
                    self._spawn(self._failed_to_change(slot, "waking it", ValueError(placement.never)))
                else:
                    self._fail_attempt(slot, placement.never)
                continue
            if placement.fits:
                self._queue.remove(slot)
                self._start_wake(slot) if waking else self._start_load(slot)
                continue
            for name in placement.evict_now:
                logger.info("unloading %s (idle, least recently used) to make room for %s", name, slot.name)
                self._start_unload(self.slots[name])
            victims_when_idle.update(placement.evict_when_idle)
            break
        for slot in self.slots.values():
            draining = slot.name in victims_when_idle
            if slot.draining and not draining:
                wake(slot)  # requests waiting for it may have it again
            slot.draining = draining

    # -- loading and unloading ---------------------------------------------------------------
    def _start_load(self, slot: ModelSlot) -> None:
        slot.progress = LoadProgress(show_bar=False)
        slot.set_state(SlotState.LOADING)
        self._spawn(self._load(slot))

    async def _load(self, slot: ModelSlot) -> None:
        started = time.monotonic()
        logger.info("loading %s", slot.name)
        try:
            model = await self._loader(slot.spec, slot.progress)
        except BaseException as exc:
            reason = ("the daemon stopped while it loaded" if self.closing
                      else f"loading it failed: {describe_failure(exc)}")
            logger.error("model %s: %s", slot.name, reason)
            self._fail_attempt(slot, reason, code="shutting_down" if self.closing else "model_unavailable", cause=exc)
            self._rebalance()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        slot.model, slot.generation = model, slot.generation + 1
        slot.need, slot.measured = model.held_memory(), True
        slot.awake_need = slot.need
        slot.progress, slot.error = None, None
        slot.last_used, slot.last_used_wall = time.monotonic(), time.time()
        slot.keep_alive_s = slot.spec.keep_alive_s
        slot.set_state(SlotState.SERVING)
        model.start(self._on_model_failed)
        logger.info("%s serves (loaded in %.1f s)", slot.name, time.monotonic() - started)
        wake(slot)
        self._check_idle(slot)  # loaded for no one still waiting: idle from now
        self._rebalance()

    def _fail_attempt(self, slot: ModelSlot, reason: str, code: str = "model_unavailable",
                      cause: BaseException | None = None) -> None:
        """The load (or its estimate, or its place) failed: those waiting get the reason
        (and, as its __cause__, the load's own exception)."""
        slot.error, slot.progress = reason, None
        slot.set_state(SlotState.FAILED)
        error = ModelUnavailable(f"model {slot.name}: {reason}", code=code)
        error.__cause__ = cause
        wake(slot, error)

    def _start_unload(self, slot: ModelSlot) -> None:
        if slot.state not in (SlotState.SERVING, SlotState.ASLEEP):
            return
        if slot in self._queue:  # asleep, waiting for room to wake: its waiters load it again after
            self._queue.remove(slot)
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        slot.set_state(SlotState.UNLOADING)
        self._spawn(self._unload(slot))

    async def _unload(self, slot: ModelSlot, failed: str | None = None) -> None:
        model, slot.model = slot.model, None
        slot.generation += 1
        slot.pins, slot.draining, slot.unload_when_idle, slot.idle_since = 0, False, False, None
        slot.sleep_when_idle = slot.sleep_level = None
        started = time.monotonic()
        try:
            await model.stop()
        except Exception:
            logger.exception("stopping %s failed", slot.name)
        logger.info("%s unloaded in %.2f s", slot.name, time.monotonic() - started)
        slot.error = failed
        slot.set_state(SlotState.FAILED if failed else SlotState.UNLOADED)
        if slot.waiting and not self.closing:
            self._enqueue(slot)  # requests came for it meanwhile: load it again
        else:
            self._forget_if_ad_hoc(slot)
        self._rebalance()

    def _on_model_failed(self, model: Any, reason: str, requests_ended: bool) -> None:
        """A serving model's engine died (`requests_ended`: its scheduler already gave
        every request its final message) or one of its actors did (then `on_failed`
        ends its requests): a one-model daemon exits (its service manager restarts it),
        else the model is torn down and the next request for it loads it afresh."""
        slot = next((s for s in self.slots.values() if s.model is model), None)
        if slot is None or slot.state not in (SlotState.SERVING, SlotState.ASLEEP):
            return
        if self.registry.single_model:
            self.fatal_reason = reason
            self.fatal.set()
            return
        logger.error("model %s failed: %s; it is unloaded and loads again on its next request", slot.name, reason)
        if not requests_ended and self.on_failed is not None:
            self.on_failed(model, reason)
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        if slot in self._queue:
            self._queue.remove(slot)
        slot.set_state(SlotState.UNLOADING)
        self._spawn(self._unload(slot, failed=reason))

    def _forget_if_ad_hoc(self, slot: ModelSlot) -> None:
        if slot.spec.ad_hoc and slot.state in (SlotState.UNLOADED, SlotState.FAILED) and slot.waiting == 0:
            self.slots.pop(slot.name, None)
            self.registry.forget(slot.name)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the daemon's end --------------------------------------------------------------------
    def making_progress(self, now: float) -> bool:
        """For the systemd watchdog: every loaded model's scheduler makes progress."""
        return all(model.scheduler.making_progress(now) for model in self.loaded())

    def stop_loading(self) -> None:
        """Drain: requests waiting for a model are refused, loads in progress cancelled."""
        self.closing = True
        for slot in self.slots.values():
            if slot.state is SlotState.LOADING and slot.progress is not None:
                slot.progress.cancel()
            if slot.state is SlotState.QUEUED:
                self._queue.remove(slot)
                slot.set_state(SlotState.UNLOADED)
            wake(slot, ModelUnavailable("the daemon is shutting down", code="shutting_down"))

    async def shutdown(self, load_wait_s: float = 10.0) -> None:
        """Unload every model (their actors stop, executors shut down), waiting up to
        `load_wait_s` for loads that were cancelled to give up."""
        self.stop_loading()
        loads = [t for t in self._tasks if not t.done()]
        if loads:
            done, pending = await asyncio.wait(loads, timeout=load_wait_s)
            if pending:
                logger.warning("a model load did not stop within %.0f s of the cancel", load_wait_s)
        for slot in self.slots.values():
            if slot.model is not None:
                slot.set_state(SlotState.UNLOADING)
                await self._unload(slot)

