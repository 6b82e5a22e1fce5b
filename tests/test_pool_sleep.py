"""Sleep and wake in the model pool (issue 29), with stand-in models (no engine, no
torch): `sleep` waits for the model's requests, a request for an asleep model wakes it
(one wake for all its waiters, no new load), idle_action "sleep" puts a model to sleep
at keep_alive's end at its sleep_level, an asleep model counts only what it still holds
against the budget (so another model fits beside it) and is evicted first when its wake
needs room, a sleep deepens from level 1 to 2, an unloaded model is left as it is, and a
failed wake fails its waiters and tears the model down for the next request to load."""
from __future__ import annotations

import asyncio

import pytest

from llmd.pool.budget import MemoryBudget
from llmd.pool.slot import ModelUnavailable, SlotState
from test_model_pool import MIB, FakeModel, Harness, run


class SleepyModel(FakeModel):
    """A stand-in that sleeps: level 1 keeps half its memory (its weights), level 2 none."""

    wake_fails = False

    def __init__(self, spec, size: int) -> None:
        super().__init__(spec, size)
        self.level: int | None = None
        self.calls: list[str] = []

    def held_memory(self) -> dict[str, int]:
        return {None: {"cpu": self.size}, 1: {"cpu": self.size // 2}, 2: {}}[self.level]

    async def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")
        await asyncio.sleep(0.005)
        self.level = level

    async def wake_up(self) -> None:
        self.calls.append("wake")
        await asyncio.sleep(0.005)
        if self.wake_fails:
            raise RuntimeError("worker 0 failed: out of memory")
        self.level = None


def harness(budget: MemoryBudget = MemoryBudget(), **tables) -> Harness:
    return Harness(budget, model_class=SleepyModel, extra_tables=tables)


def test_a_sleeping_model_wakes_for_its_next_request_without_a_new_load():
    async def scenario():
        h = harness()
        (await h.pool.acquire(h.spec("b"))).release()
        slot = await h.pool.sleep(h.spec("b"), 1)
        model = slot.model
        assert slot.state is SlotState.ASLEEP and model.calls == ["sleep 1"] and slot.need == {"cpu": 50 * MIB}
        view = next(v for v in h.pool.snapshot() if v.name == "b")
        assert view.state == "asleep" and view.sleep_level == 1 and view.memory_bytes == 50 * MIB
        leases = await asyncio.gather(*(h.pool.acquire(h.spec("b")) for _ in range(3)))
        assert h.log == [("load", "b")] and model.calls == ["sleep 1", "wake"]  # one wake for all three
        assert all(lease.valid and lease.model is model for lease in leases) and slot.need == {"cpu": 100 * MIB}
        assert slot.sleep_level is None and h.pool.serving_now(h.spec("b"))
        for lease in leases:
            lease.release()
    run(scenario())


def test_sleep_waits_for_the_models_requests():
    async def scenario():
        h = harness()
        lease = await h.pool.acquire(h.spec("b"))
        asleep = asyncio.ensure_future(h.pool.sleep(h.spec("b"), 2))
        await h.settle()
        assert not asleep.done() and h.state("b") is SlotState.SERVING and lease.valid
        lease.release()
        slot = await asleep
        assert slot.state is SlotState.ASLEEP and slot.sleep_level == 2 and slot.need == {}
    run(scenario())


def test_idle_action_sleep_puts_the_model_to_sleep_at_keep_alives_end():
    async def scenario():
        h = harness(d={"path": "/m/d", "keep_alive": "50ms", "idle_action": "sleep", "sleep_level": 2})
        h.sizes["d"] = 100
        (await h.pool.acquire(h.spec("d"))).release()
        assert h.state("d") is SlotState.SERVING
        assert next(v for v in h.pool.snapshot() if v.name == "d").idle_action == "sleep"
        await h.settle(0.15)
        slot = h.pool.slots["d"]
        assert slot.state is SlotState.ASLEEP and slot.sleep_level == 2 and slot.model.calls == ["sleep 2"]
        (await h.pool.acquire(h.spec("d"), keep_alive=0)).release()  # keep_alive 0: back to sleep at once
        await h.settle()
        assert slot.state is SlotState.ASLEEP and slot.model.calls == ["sleep 2", "wake", "sleep 2"]
        assert h.log == [("load", "d")]
    run(scenario())


def test_an_asleep_model_counts_what_it_still_holds_and_goes_first_when_room_is_needed():
    async def scenario():
        h = harness(MemoryBudget(bytes_per_device={"cpu": 250 * MIB}), d={"path": "/m/d"})
        h.sizes.update(c=60, d=120)
        for name in ("a", "b"):
            (await h.pool.acquire(h.spec(name))).release()
        await h.pool.sleep(h.spec("b"), 1)  # b holds 50: c (60) fits beside a (100) and b
        lease = await h.pool.acquire(h.spec("c"), keep_alive=float("inf"))
        assert [h.state(n) for n in "abc"] == [SlotState.SERVING, SlotState.ASLEEP, SlotState.SERVING]
        woken = await h.pool.acquire(h.spec("b"))  # awake b needs 100: a (idle) goes, c is busy
        assert h.state("a") is SlotState.UNLOADED and h.state("b") is SlotState.SERVING
        woken.release()
        lease.release()
        await h.pool.sleep(h.spec("b"), 1)
        await h.pool.sleep(h.spec("c"), 2)  # b 50 + c 0: a loads again beside them
        (await h.pool.acquire(h.spec("a"))).release()
        assert [h.state(n) for n in "abc"] == [SlotState.SERVING, SlotState.ASLEEP, SlotState.ASLEEP]
        (await h.pool.acquire(h.spec("d"))).release()  # 120: b (asleep, least recently used) is unloaded
        assert [h.state(n) for n in "abcd"] == [SlotState.SERVING, SlotState.UNLOADED, SlotState.ASLEEP,
                                                 SlotState.SERVING]
    run(scenario())


def test_sleep_deepens_leaves_an_unloaded_model_be_and_an_asleep_model_unloads():
    async def scenario():
        h = harness()
        assert (await h.pool.sleep(h.spec("b"), 1)).state is SlotState.UNLOADED and h.log == []
        (await h.pool.acquire(h.spec("b"))).release()
        slot = await h.pool.sleep(h.spec("b"), 1)
        model = slot.model
        await h.pool.sleep(h.spec("b"), 1)  # already there
        await h.pool.sleep(h.spec("b"), 2)
        assert model.calls == ["sleep 1", "sleep 2"] and slot.sleep_level == 2 and slot.need == {}
        await h.pool.sleep(h.spec("b"), 1)  # shallower than it is: stays at 2
        assert model.calls == ["sleep 1", "sleep 2"]
        await h.pool.unload(h.spec("b"))
        assert slot.state is SlotState.UNLOADED and model.stopped and slot.sleep_level is None
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            await h.pool.sleep(h.spec("b"), 3)
    run(scenario())


def test_a_failed_wake_fails_its_waiters_and_the_next_request_loads_afresh():
    async def scenario():
        h = harness()
        (await h.pool.acquire(h.spec("b"))).release()
        slot = await h.pool.sleep(h.spec("b"), 2)
        first = slot.model
        first.wake_fails = True
        with pytest.raises(ModelUnavailable, match="model b: waking it failed: worker 0 failed: out of memory"):
            await h.pool.acquire(h.spec("b"))
        await h.settle()
        assert slot.state is SlotState.FAILED and first.stopped and "waking it failed" in slot.error
        lease = await h.pool.acquire(h.spec("b"))
        assert lease.model is not first and h.log == [("load", "b")] * 2
        lease.release()
    run(scenario())
