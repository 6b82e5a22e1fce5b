"""What fits: the memory budget per device and the count of loaded models, and which
loaded models to evict to make room for another. Pure logic, decided from plain
figures (no model, no clock), so every rule is tested in milliseconds.

Rules: a model that needs more than a device's budget, even alone, never fits. Else
the loaded models that can go (serving, not loading or unloading) are taken least
recently used first, idle ones before busy ones, each only if it frees what is short
(a device over its budget, or the count); idle victims are unloaded now, busy ones stop
taking requests and are unloaded once their requests are done. When even every
evictable model is not enough (others are loading or unloading), nothing is evicted:
the load waits for the next change."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemoryBudget:
    """`bytes_per_device`: "cpu", "cuda" (each GPU) or "cuda:N" -> bytes; a device
    without an entry is not limited. `max_loaded_models`: None, no limit."""

    max_loaded_models: int | None = None
    bytes_per_device: Mapping[str, int] = field(default_factory=dict)

    def limit(self, device: str) -> int | None:
        if device in self.bytes_per_device:
            return self.bytes_per_device[device]
        if device.startswith("cuda:"):
            return self.bytes_per_device.get("cuda")
        return None


@dataclass(frozen=True)
class Resident:
    """A model holding memory now (loaded, loading or unloading)."""

    name: str
    need: Mapping[str, int]  # device -> bytes
    evictable: bool  # serving: it may be unloaded (loading and unloading ones may not)
    busy: bool  # requests running or waiting for it
    last_used: float  # when its last request ended (monotonic); older goes first


@dataclass(frozen=True)
class Placement:
    """The decision for one model to load. `fits`: load it now. Else `evict_now` (idle
    models to unload now) and `evict_when_idle` (busy ones: no new requests, unloaded
    once done) make room; with neither, it waits for the next change. `never`: why it
    cannot fit even alone (then nothing else is set)."""

    fits: bool
    evict_now: tuple[str, ...] = ()
    evict_when_idle: tuple[str, ...] = ()
    never: str | None = None


def place(need: Mapping[str, int], residents: list[Resident], budget: MemoryBudget) -> Placement:
    """Where a model needing `need` (device -> bytes) stands against `residents`."""
    never = _never_fits(need, budget)
    if never is not None:
        return Placement(fits=False, never=never)
    staying = list(residents)
    if not _shortfall(need, staying, budget):
        return Placement(fits=True)
    victims: list[Resident] = []
    for candidate in sorted((r for r in residents if r.evictable), key=lambda r: (r.busy, r.last_used)):
        short = _shortfall(need, staying, budget)
        if not short:
            break
        if "count" in short or any(candidate.need.get(device, 0) > 0 for device in short):
            victims.append(candidate)
            staying.remove(candidate)
    if _shortfall(need, staying, budget):
        return Placement(fits=False)  # not even every evictable model makes room yet: wait
    return Placement(fits=False, evict_now=tuple(v.name for v in victims if not v.busy),
                     evict_when_idle=tuple(v.name for v in victims if v.busy))


def _never_fits(need: Mapping[str, int], budget: MemoryBudget) -> str | None:
    for device, n in sorted(need.items()):
        limit = budget.limit(device)
        if limit is not None and n > limit:
            return (f"the model needs {_mib(n)} on {device} (weights and KV cache), more than the "
                    f"{_mib(limit)} of model_memory_budget_bytes there, even with no other model loaded")
    return None


def _shortfall(need: Mapping[str, int], staying: list[Resident], budget: MemoryBudget) -> set[str]:
    """What is over its limit with `staying` loaded beside the new model: devices, and
    "count" for max_loaded_models."""
    short = set()
    if budget.max_loaded_models is not None and len(staying) + 1 > budget.max_loaded_models:
        short.add("count")
    for device, n in need.items():
        limit = budget.limit(device)
        if limit is not None and n + sum(r.need.get(device, 0) for r in staying) > limit:
            short.add(device)
    return short


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
