"""A model's figures across loads, unloads, sleeps and wakes (the metrics actor, no
daemon): the counts its engine keeps as running totals (prefix-cache lookups and hits,
preemptions, speculative drafts) start again from zero in each new engine, yet the
Prometheus counters, read back with prometheus_client's own parser, only grow; the last
step's state (KV blocks in use, running requests) goes with the unloaded engine; the
sleep-level gauge, sleep and wake counters and the wake-time histogram follow the model."""
from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from llmd.actors.messages import ModelLoaded, ModelSlept, ModelUnloaded, StepStats
from llmd.actors.metrics import MetricsActor
from llmd.core.spec_decode import SpecDecodeStats
from llmd.pool.slot import SlotView


def step(queries: int, hits: int, preemptions: int, used: int, spec: SpecDecodeStats) -> StepStats:
    return StepStats(running_ids=["r1-0"] if used else [], num_waiting=0, kv_blocks_used=used, kv_blocks_total=64,
                     prefix_queries=queries, prefix_hits=hits, num_preemptions_total=preemptions, spec=spec,
                     time=1.0, duration_s=0.01, num_reqs=1, num_tokens=4, num_prefill_tokens=4, num_decode_reqs=0,
                     num_generated=1, generated={}, model="m")


def samples(actor: MetricsActor) -> dict[tuple[str, str | None], float]:
    return {(s.name, s.labels.get("position")): s.value for family in text_string_to_metric_families(actor.prometheus())
            for s in family.samples if s.labels.get("model_name") == "m"}


def test_engine_counters_add_up_across_loads_and_the_last_step_goes_with_the_engine():
    views = [SlotView(name="base", default=True, state="serving"), SlotView(name="m", state="serving")]
    actor = MetricsActor(default_model="base", server_version="0", models_view=lambda: views)

    def send(*messages):
        for message in messages:
            asyncio.run(actor.handle(message))

    loaded = ModelLoaded(model="m", device="cpu", dtype="float32", kv_blocks_total=64, load_seconds=0.5)
    send(loaded, step(10, 4, 1, 5, SpecDecodeStats(2, 6, 3, [2, 1, 0])))
    assert samples(actor)[("llmd:prefix_cache_queries_total", None)] == 10
    send(ModelUnloaded(model="m"))
    views[1] = SlotView(name="m", state="unloaded")
    figures = actor.figures["m"]
    assert figures.last_step is None and figures.kv_blocks_used() == 0 and actor.running_by_model() == {}
    views[1] = SlotView(name="m", state="serving")
    send(loaded)
    assert figures.kv_blocks_used() == 0  # nothing of the old engine's last step
    send(step(3, 1, 0, 2, SpecDecodeStats(1, 3, 2, [1, 1, 0, 0])))
    got = samples(actor)
    assert got[("llmd:prefix_cache_queries_total", None)] == 13 and got[("llmd:prefix_cache_hits_total", None)] == 5
    assert got[("llmd:num_preemptions_total", None)] == 1
    assert got[("llmd:spec_decode_num_drafts_total", None)] == 3
    assert got[("llmd:spec_decode_num_accepted_tokens_total", None)] == 5
    assert [got[("llmd:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)] == [3, 2, 0, 0]
    assert got[("llmd:model_loads_total", None)] == 2 and got[("llmd:model_unloads_total", None)] == 1
    assert actor.status(0, True).num_preemptions_total == 0  # the default model's; m's are its own

    send(ModelSlept(model="m", level=2, seconds=0.1))
    views[1] = SlotView(name="m", state="asleep", sleep_level=2)
    got = samples(actor)
    assert got[("llmd:model_sleep_level", None)] == 2 and got[("llmd:model_sleeps_total", None)] == 1
    assert actor.model_statuses()[1].state == "asleep" and actor.model_statuses()[1].sleep_level == 2
    send(ModelSlept(model="m", level=None, seconds=1.5))
    views[1] = SlotView(name="m", state="serving")
    got = samples(actor)
    assert got[("llmd:model_sleep_level", None)] == 0 and got[("llmd:model_wakes_total", None)] == 1
    assert got[("llmd:model_wake_seconds_count", None)] == 1 and got[("llmd:model_wake_seconds_sum", None)] == 1.5
    assert got[("llmd:prefix_cache_queries_total", None)] == 13  # a wake keeps the engine: no double count
