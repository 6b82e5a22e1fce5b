"""Sleep and wake in the model pool: a loaded model put to sleep keeps its engine and
worker processes but frees its KV cache, and keeps its weights in host memory (level 1)
or drops them (level 2); its next request wakes it. The pool (pool.py) mixes this in;
here are the transitions SERVING -> SLEEPING -> ASLEEP -> WAKING -> SERVING.

Sleep waits for the model's requests: `sleep` (llmctl sleep) marks the model and it goes
to sleep once idle (requests that come meanwhile still run, as for unload); keep_alive's
end does it to an idle model whose idle_action is "sleep". A request for a sleeping or
asleep model waits, and wakes it: a wake is placed under the memory budget as a load is
(the model's awake figures against the others; asleep models, idle, are evicted first
come least recently used). The budget counts what an asleep model still holds: at level
1 its weights, in host memory ("cpu"), at level 2 nothing. A sleep or wake that fails
(a worker died) tears the model down as a failed engine is: its waiters get the reason
and the next request loads it afresh."""
from __future__ import annotations

import asyncio
import logging
import time

from llmd.pool.registry import ModelSpec
from llmd.pool.slot import ModelSlot, ModelUnavailable, SlotState, describe_failure, wake

logger = logging.getLogger("llmd.pool")


class SleepControl:
    """ModelPool's sleep and wake (see the module docstring): a mixin, its methods use
    the pool's slots, queue and transitions (_spawn, _rebalance, _check_idle, _unload)."""

    async def sleep(self, spec: ModelSpec, level: int) -> ModelSlot:
        """Put a model to sleep at `level` once its requests are done; returns when it is
        asleep (at that level or deeper), or at once when it is not loaded. A model
        asleep at level 1 asked for level 2 drops its weights too."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        slot = self.slot(spec)
        slept = slot.sleeps
        while True:
            state = slot.state
            if state in (SlotState.UNLOADED, SlotState.FAILED):
                return slot
            # Asleep deep enough: now, or since the call (a request may be waking it already).
            slept_since = slot.sleeps > slept or state is SlotState.ASLEEP
            if slept_since and slot.sleep_level is not None and slot.sleep_level >= level:
                return slot
            changed = slot.changed
            if state is SlotState.ASLEEP and slot not in self._queue:
                self._start_sleep(slot, level)  # deeper
            elif state is SlotState.SERVING:
                slot.sleep_when_idle = max(level, slot.sleep_when_idle or 0)
                if slot.idle:
                    self._start_sleep(slot, slot.sleep_when_idle)
            await changed.wait()

    def _start_sleep(self, slot: ModelSlot, level: int) -> None:
        if slot.state not in (SlotState.SERVING, SlotState.ASLEEP):
            return
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        if slot.state is SlotState.SERVING:
            slot.awake_need = slot.need
        slot.sleep_when_idle, slot.idle_since = None, None
        slot.sleep_level = level
        slot.set_state(SlotState.SLEEPING)
        self._spawn(self._sleep(slot, level))

    async def _sleep(self, slot: ModelSlot, level: int) -> None:
        started = time.monotonic()
        try:
            await slot.model.sleep(level)
        except BaseException as exc:
            await self._failed_to_change(slot, "going to sleep", exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        slot.need, slot.measured = slot.model.held_memory(), True
        slot.sleeps += 1
        logger.info("%s asleep at level %d in %.2f s", slot.name, level, time.monotonic() - started)
        slot.set_state(SlotState.ASLEEP)
        if slot.waiting and not self.closing:
            self._enqueue_wake(slot)  # requests came meanwhile
        self._rebalance()

    def _enqueue_wake(self, slot: ModelSlot) -> None:
        """Wait for room to wake (placed as a load is, with its awake figures)."""
        if slot not in self._queue:
            self._queue.append(slot)
        self._rebalance()

    def _start_wake(self, slot: ModelSlot) -> None:
        slot.set_state(SlotState.WAKING)
        self._spawn(self._wake(slot))

    async def _wake(self, slot: ModelSlot) -> None:
        started = time.monotonic()
        try:
            await slot.model.wake_up()
        except BaseException as exc:
            await self._failed_to_change(slot, "waking it", exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        slot.need, slot.measured = slot.model.held_memory(), True
        slot.sleep_level = None
        slot.keep_alive_s = slot.spec.keep_alive_s
        slot.last_used, slot.last_used_wall = time.monotonic(), time.time()
        logger.info("%s awake in %.2f s", slot.name, time.monotonic() - started)
        slot.set_state(SlotState.SERVING)
        wake(slot)
        self._check_idle(slot)  # woken for no one still waiting: idle from now
        self._rebalance()

    async def _failed_to_change(self, slot: ModelSlot, doing: str, exc: BaseException) -> None:
        """A sleep or wake failed: those waiting get the reason; the model is torn down
        (the next request loads it afresh)."""
        reason = "the daemon stopped" if self.closing else f"{doing} failed: {describe_failure(exc)}"
        logger.error("model %s: %s", slot.name, reason)
        wake(slot, ModelUnavailable(f"model {slot.name}: {reason}",
                                    code="shutting_down" if self.closing else "model_unavailable"))
        if slot in self._queue:
            self._queue.remove(slot)
        slot.set_state(SlotState.UNLOADING)
        await self._unload(slot, failed=reason)

