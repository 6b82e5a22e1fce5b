"""The model pool's decisions (issue 29), with stand-in models (no engine, no torch):
one load for many waiting requests; keep_alive (a request's, the model's, 0, for
ever); least-recently-used eviction under a budget, idle models first and busy ones
only once idle, the loads wanting room served in turn; a model that can never fit and
one that fails to load fail only their own requests, and the next request tries again;
a request that stops waiting drops a load that had not started; a model whose engine
dies is torn down and loaded again on demand (or, alone, ends the daemon)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from llmd.config import EngineConfig
from llmd.pool.budget import MemoryBudget
from llmd.pool.pool import ModelPool
from llmd.pool.registry import ModelRegistry
from llmd.pool.slot import ModelUnavailable, SlotState

MIB = 1 << 20


class FakeModel:
    """What the pool asks of a loaded model."""

    def __init__(self, spec, size: int) -> None:
        self.spec, self.name, self.size = spec, spec.name, size
        self.scheduler = SimpleNamespace(making_progress=lambda now: True)
        self.served = None
        self.on_failed = None
        self.stopped = False

    def held_memory(self) -> dict[str, int]:
        return {"cpu": self.size}

    def start(self, on_failed) -> None:
        self.on_failed = on_failed

    async def stop(self) -> None:
        await asyncio.sleep(0.005)
        self.stopped = True


class Harness:
    """A pool over models a, b, c (sizes in MiB) whose loads are logged and may fail."""

    def __init__(self, budget: MemoryBudget, *, sizes: dict[str, int] | None = None, load_s: float = 0.01,
                 tables: bool = True, keep_alive: str | None = None, extra_tables: dict | None = None,
                 model_class: type = FakeModel) -> None:
        self.sizes = sizes or {"a": 100, "b": 100, "c": 100}
        self.log: list[tuple[str, str]] = []
        self.failures: dict[str, int] = {}  # name -> loads still to fail
        self.load_s = load_s
        self.model_class = model_class
        self.failed_requests: list[str] = []
        registry = ModelRegistry.from_settings(
            EngineConfig(model="/m/a"), default_names=("a",), keep_alive=keep_alive, tool_call_parser=None,
            tables={"b": {"path": "/m/b"}, "c": {"path": "/m/c", "keep_alive": "50ms"}, **(extra_tables or {})}
            if tables else None, allow_model_paths=False)
        self.pool = ModelPool(registry, budget, loader=self.load, estimator=self.estimate,
                              on_failed=lambda model, reason: self.failed_requests.append(model.name))

    async def load(self, spec, progress):
        self.log.append(("load", spec.name))
        await asyncio.sleep(self.load_s)
        if self.failures.get(spec.name):
            self.failures[spec.name] -= 1
            raise ValueError(f"no weights in {spec.path}")
        return self.model_class(spec, self.sizes[spec.name] * MIB)

    async def estimate(self, spec):
        return {"cpu": self.sizes[spec.name] * MIB}

    def spec(self, name: str):
        return self.pool.resolve(name)

    def state(self, name: str) -> SlotState:
        return self.pool.slots[name].state

    async def settle(self, seconds: float = 0.05) -> None:
        await asyncio.sleep(seconds)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_one_load_serves_every_request_waiting_for_it():
    async def scenario():
        h = Harness(MemoryBudget())
        leases = await asyncio.gather(*(h.pool.acquire(h.spec("b")) for _ in range(5)))
        assert h.log == [("load", "b")] and h.state("b") is SlotState.SERVING
        assert h.pool.serving_now(h.spec("b")) and h.pool.slots["b"].pins == 5
        assert len({id(lease.model) for lease in leases}) == 1 and all(lease.valid for lease in leases)
        for lease in leases:
            lease.release()
            lease.release()  # idempotent
        assert h.pool.slots["b"].pins == 0
    run(scenario())


def test_keep_alive_unloads_an_idle_model_and_a_request_says_how_long():
    async def scenario():
        h = Harness(MemoryBudget())
        (await h.pool.acquire(h.spec("c"))).release()  # the table's keep_alive: 50 ms
        view = next(v for v in h.pool.snapshot() if v.name == "c")
        assert view.state == "serving" and view.keep_alive_s == 0.05 and view.expires_at is not None
        await h.settle(0.15)
        assert h.state("c") is SlotState.UNLOADED
        (await h.pool.acquire(h.spec("c"), keep_alive=float("inf"))).release()  # a request's own: for ever
        await h.settle(0.15)
        assert h.state("c") is SlotState.SERVING
        assert next(v for v in h.pool.snapshot() if v.name == "c").expires_at is None
        (await h.pool.acquire(h.spec("c"), keep_alive=0)).release()  # 0: unloaded once this reply is done
        await h.settle()
        assert h.state("c") is SlotState.UNLOADED
        assert h.log == [("load", "c")] * 2
    run(scenario())


def test_the_default_model_stays_and_tables_stay_five_minutes_unless_told():
    h = Harness(MemoryBudget())
    assert h.pool.slots["a"].keep_alive_s == float("inf") and h.pool.slots["b"].keep_alive_s == 300
    h = Harness(MemoryBudget(), keep_alive="1s")
    assert h.pool.slots["a"].keep_alive_s == 1 and h.pool.slots["b"].keep_alive_s == 1
    assert h.pool.slots["c"].keep_alive_s == 0.05


def test_a_model_that_does_not_fit_evicts_the_least_recently_used_idle_one():
    async def scenario():
        h = Harness(MemoryBudget(bytes_per_device={"cpu": 250 * MIB}))
        (await h.pool.acquire(h.spec("a"))).release()
        await h.settle(0.01)
        (await h.pool.acquire(h.spec("b"))).release()
        (await h.pool.acquire(h.spec("a"))).release()  # a is used after b: b is the older
        lease = await h.pool.acquire(h.spec("c"))
        assert h.state("b") is SlotState.UNLOADED and h.state("a") is SlotState.SERVING
        assert h.log == [("load", "a"), ("load", "b"), ("load", "c")]
        lease.release()
    run(scenario())


def test_a_busy_model_is_evicted_once_idle_and_new_requests_for_it_wait_their_turn():
    async def scenario():
        h = Harness(MemoryBudget(max_loaded_models=1))
        a = await h.pool.acquire(h.spec("a"))
        b_waiting = asyncio.ensure_future(h.pool.acquire(h.spec("b")))
        await h.settle()
        assert not b_waiting.done() and h.pool.slots["a"].draining  # a takes no new requests
        a_again = asyncio.ensure_future(h.pool.acquire(h.spec("a")))
        await h.settle()
        assert not a_again.done() and h.log == [("load", "a")]
        a.release()  # a idle: unloaded, b loads, then a waits for b's request to end
        b = await b_waiting
        assert h.log == [("load", "a"), ("load", "b")] and h.state("a") is SlotState.QUEUED  # its turn is next
        await h.settle()
        assert not a_again.done()
        b.release()
        (await a_again).release()
        assert h.log == [("load", "a"), ("load", "b"), ("load", "a")]
    run(scenario())


def test_a_request_that_stops_waiting_drops_a_load_that_had_not_started():
    async def scenario():
        h = Harness(MemoryBudget(max_loaded_models=1))
        a = await h.pool.acquire(h.spec("a"))
        b_waiting = asyncio.ensure_future(h.pool.acquire(h.spec("b")))
        await h.settle()
        b_waiting.cancel()
        await h.settle()
        assert h.state("b") is SlotState.UNLOADED and not h.pool.slots["a"].draining
        (await h.pool.acquire(h.spec("a"))).release()  # served at once again
        a.release()
        assert h.log == [("load", "a")]
    run(scenario())


def test_a_load_no_one_waits_for_any_more_finishes_and_idles_out():
    async def scenario():
        h = Harness(MemoryBudget(), load_s=0.05)
        waiting = asyncio.ensure_future(h.pool.acquire(h.spec("c")))
        await h.settle(0.01)
        waiting.cancel()
        await h.settle(0.08)
        assert h.state("c") is SlotState.SERVING and h.pool.slots["c"].pins == 0  # loaded, idle
        await h.settle(0.1)
        assert h.state("c") is SlotState.UNLOADED  # its keep_alive
    run(scenario())


def test_a_model_that_can_never_fit_is_refused_at_once_with_the_figures():
    async def scenario():
        h = Harness(MemoryBudget(bytes_per_device={"cpu": 150 * MIB}), sizes={"a": 100, "b": 200, "c": 10})
        (await h.pool.acquire(h.spec("a"))).release()
        with pytest.raises(ModelUnavailable) as info:
            await h.pool.acquire(h.spec("b"))
        assert "200 MiB on cpu" in str(info.value) and "150 MiB" in str(info.value)
        assert h.state("a") is SlotState.SERVING and h.log == [("load", "a")]  # nothing was evicted for it
        assert next(v for v in h.pool.snapshot() if v.name == "b").state == "failed"
    run(scenario())


def test_a_failed_load_fails_its_waiters_and_the_next_request_tries_again():
    async def scenario():
        h = Harness(MemoryBudget())
        h.failures["b"] = 1
        results = await asyncio.gather(*(h.pool.acquire(h.spec("b")) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ModelUnavailable) and "no weights in /m/b" in str(r) for r in results)
        assert h.log == [("load", "b")] and h.state("b") is SlotState.FAILED
        (await h.pool.acquire(h.spec("b"))).release()
        assert h.state("b") is SlotState.SERVING and h.log == [("load", "b")] * 2
    run(scenario())


def test_a_model_whose_engine_dies_is_torn_down_and_loaded_again_on_demand():
    async def scenario():
        h = Harness(MemoryBudget())
        lease = await h.pool.acquire(h.spec("b"))
        model = lease.model
        model.on_failed(model, "its scheduler actor stopped", False)
        assert h.failed_requests == ["b"]  # the intake ends its requests
        await h.settle()
        assert model.stopped and h.state("b") is SlotState.FAILED and not lease.valid
        lease.release()  # a stale pin: ignored
        assert h.pool.slots["b"].pins == 0 and not h.pool.fatal.is_set()
        (await h.pool.acquire(h.spec("b"))).release()
        assert h.state("b") is SlotState.SERVING and h.log == [("load", "b")] * 2
    run(scenario())


def test_the_only_models_death_ends_the_daemon():
    async def scenario():
        h = Harness(MemoryBudget(), tables=False)
        lease = await h.pool.acquire(h.spec("a"))
        lease.model.on_failed(lease.model, "its engine is dead", True)
        assert h.pool.fatal.is_set() and h.pool.fatal_reason == "its engine is dead"
    run(scenario())


def test_unload_waits_for_the_models_requests():
    async def scenario():
        h = Harness(MemoryBudget())
        lease = await h.pool.acquire(h.spec("a"))
        unloading = asyncio.ensure_future(h.pool.unload(h.spec("a")))
        await h.settle()
        assert not unloading.done() and h.state("a") is SlotState.SERVING
        lease.release()
        await unloading
        assert h.state("a") is SlotState.UNLOADED
        (await h.pool.acquire(h.spec("a"))).release()  # and the next request loads it again
        assert h.log == [("load", "a")] * 2
    run(scenario())


def test_stopping_refuses_the_waiters_and_unloads_everything():
    async def scenario():
        h = Harness(MemoryBudget(max_loaded_models=1))
        a = await h.pool.acquire(h.spec("a"))
        b_waiting = asyncio.ensure_future(h.pool.acquire(h.spec("b")))
        await h.settle()
        await h.pool.shutdown()
        with pytest.raises(ModelUnavailable) as info:
            await b_waiting
        assert info.value.code == "shutting_down"
        assert all(s.state is not SlotState.SERVING for s in h.pool.slots.values())
        a.release()
    run(scenario())
