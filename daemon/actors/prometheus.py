"""The metrics actor's state (metrics.py) as Prometheus metric families, for the
/metrics face and `llmctl metrics`."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from llmd.actors.model_figures import ModelFigures


FINISH_REASONS = ("stop", "length", "abort", "error")  # always exposed, 0 until seen


class PrometheusCollector:
    """The metrics actor's state as Prometheus metric families, read at scrape time.

    A collector rather than prometheus_client's Counter and Histogram objects: the actor
    already keeps every total and histogram (the `status` reply reads them too); several
    figures arrive from the scheduler as running totals (prefix-cache, preemption and
    speculative-decoding counts), which a Counter could only mirror by incrementing
    deltas; and running versus waiting is derived from the last step. Scrapes run on the
    actor's own task, between messages, so each one sees a consistent state."""

    def __init__(self, actor) -> None:
        """`actor`: the MetricsActor (not imported: it imports this module)."""
        self.actor = actor

    def collect(self) -> Iterator[Metric]:
        # Every model the daemon may serve has its series, loaded or not (zero until used).
        names = sorted({v.name for v in self.actor.views()} | set(self.actor.figures))
        models = [self.actor.model(name) for name in names]
        yield from self._models(models)
        yield from self._gauges(models)
        yield from self._counters(models)
        yield from self._histograms(models)
        yield from self._spec_decode(models)

    def _models(self, models: list[ModelFigures]) -> Iterator[Metric]:
        """Which models are loaded, what they hold (or would), how often they came and went."""
        views = self.actor.views()
        loaded = GaugeMetricFamily("llmd:model_loaded", "1 while the model is loaded (serving), else 0.",
                                   labels=["model_name"])
        memory = GaugeMetricFamily("llmd:model_memory_bytes",
                                   "Bytes the model holds while loaded (weights and KV pool), else its estimate.",
                                   labels=["model_name"])
        sleep = GaugeMetricFamily("llmd:model_sleep_level",
                                  "1 or 2 while the model is asleep (level 1: weights kept in host memory; "
                                  "2: dropped), else 0.", labels=["model_name"])
        for view in views:
            loaded.add_metric([view.name], 1.0 if view.state == "serving" else 0.0)
            memory.add_metric([view.name], view.memory_bytes)
            sleep.add_metric([view.name], float(view.sleep_level or 0) if view.state == "asleep" else 0.0)
        yield loaded
        yield memory
        yield sleep
        yield _counter_all("model_loads", "Times the model was loaded.", {m.name: m.loads for m in models})
        yield _counter_all("model_unloads", "Times the model was unloaded.", {m.name: m.unloads for m in models})
        yield _counter_all("model_sleeps", "Times the model was put to sleep.", {m.name: m.sleeps for m in models})
        yield _counter_all("model_wakes", "Times the model was woken from sleep.", {m.name: m.wakes for m in models})

    def _gauges(self, models: list[ModelFigures]) -> Iterator[Metric]:
        actor = self.actor
        running = actor.running_by_model()
        yield _gauge_all("num_requests_running", "Requests in the running batch.",
                         {m.name: running.get(m.name, 0) for m in models})
        yield _gauge_all("num_requests_waiting", "Requests waiting to be scheduled.",
                         {m.name: actor.num_admitted(m.name) - running.get(m.name, 0) for m in models})
        yield _gauge_all("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
                         {m.name: m.kv_usage() for m in models})
        on_gpu = [m for m in models if m.device_memory_bytes is not None]
        if on_gpu:
            family = GaugeMetricFamily("llmd:gpu_memory_reserved_bytes",
                                       "Device memory held by the model's torch allocator (rank 0).",
                                       labels=["model_name", "device"])
            for m in on_gpu:
                family.add_metric([m.name, m.device], m.device_memory_bytes)
            yield family
        with_memory = [m for m in models if m.memory is not None]
        if with_memory:
            family = GaugeMetricFamily("llmd:model_weights_bytes",
                                       "The model's weights (every rank), by how they are kept: a GGUF type "
                                       "(packed), a dtype (dense), onednn (CPU linears' reordered copies).",
                                       labels=["model_name", "storage"])
            for m in with_memory:
                memory = m.memory()
                for storage, n in (memory.weights if memory is not None else {}).items():
                    family.add_metric([m.name, storage], n)
            yield family

    def _counters(self, models: list[ModelFigures]) -> Iterator[Metric]:
        def of_step(field: str) -> dict[str, float]:
            return {m.name: m.engine_total(field) for m in models}

        yield _counter_all("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           of_step("prefix_queries"))
        yield _counter_all("prefix_cache_hits", "Prompt tokens served from the prefix cache.", of_step("prefix_hits"))
        yield _counter_all("num_preemptions", "Requests preempted for lack of KV blocks.",
                           of_step("num_preemptions_total"))
        yield _counter_all("prompt_tokens", "Prompt tokens of finished requests.",
                           {m.name: m.totals.prompt_tokens for m in models})
        yield _counter_all("generation_tokens", "Generated tokens of finished requests.",
                           {m.name: m.totals.generation_tokens for m in models})
        family = CounterMetricFamily("llmd:request_success", "Finished requests by finish reason.",
                                     labels=["model_name", "finished_reason"])
        for m in models:
            for reason, count in ({reason: 0 for reason in FINISH_REASONS} | dict(m.totals.finished)).items():
                family.add_metric([m.name, reason], count)
        yield family
        yield _counter_all("scheduled_prefill_tokens",
                           "Tokens computed in prefill rows (prompt chunks; recomputation after preemption too).",
                           {m.name: m.totals.prefill_tokens for m in models})
        yield _counter_all("scheduled_decode_tokens",
                           "Tokens computed in decode rows (the new token, plus drafts being verified).",
                           {m.name: m.totals.decode_tokens for m in models})

    def _histograms(self, models: list[ModelFigures]) -> Iterator[Metric]:
        if not models:
            return
        for i, histogram in enumerate(models[0].histograms):
            family = HistogramMetricFamily(f"llmd:{histogram.name}", histogram.help_text, labels=["model_name"])
            for m in models:
                h = m.histograms[i]
                family.add_metric([m.name], h.cumulative_buckets(), h.sum)
            yield family

    def _spec_decode(self, models: list[ModelFigures]) -> Iterator[Metric]:
        totals = {m.name: m.spec_total() for m in models}
        speculating = {name: spec for name, spec in totals.items() if spec is not None}
        if not speculating:  # speculative decoding is off: no such families, as in vLLM
            return
        yield _counter_all("spec_decode_num_drafts", "Steps that verified drafts.",
                           {name: spec.num_drafts for name, spec in speculating.items()})
        yield _counter_all("spec_decode_num_draft_tokens", "Draft tokens verified.",
                           {name: spec.num_draft_tokens for name, spec in speculating.items()})
        yield _counter_all("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                           {name: spec.num_accepted_tokens for name, spec in speculating.items()})
        family = CounterMetricFamily("llmd:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted drafts by position (0 = first).", labels=["model_name", "position"])
        for name, spec in speculating.items():
            for i, n in enumerate(spec.accepted_per_position):
                family.add_metric([name, str(i)], n)
        yield family


def _gauge_all(name: str, text: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    """A gauge family `llmd:<name>` with one sample per model."""
    family = GaugeMetricFamily(f"llmd:{name}", text, labels=["model_name"])
    for model, value in values.items():
        family.add_metric([model], value)
    return family


def _counter_all(name: str, text: str, values: Mapping[str, float]) -> CounterMetricFamily:
    """A counter family `llmd:<name>` (sampled as `llmd:<name>_total`), one sample per model."""
    family = CounterMetricFamily(f"llmd:{name}", text, labels=["model_name"])
    for model, value in values.items():
        family.add_metric([model], value)
    return family
