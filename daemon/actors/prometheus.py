"""The metrics actor's state (metrics.py) as Prometheus metric families, for the
/metrics face and `llmctl metrics`."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


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
        yield from self._gauges()
        yield from self._counters()
        yield from self._histograms()
        yield from self._spec_decode()

    def _gauges(self) -> Iterator[Metric]:
        actor, model = self.actor, self.actor.model
        running = actor.num_running()
        yield _gauge("num_requests_running", "Requests in the running batch.", model, running)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", model, len(actor.requests) - running)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", model, actor.kv_usage())
        if actor.device_memory_bytes is not None:
            family = GaugeMetricFamily("llmd:gpu_memory_reserved_bytes",
                                       "Device memory held by the model's torch allocator (rank 0).",
                                       labels=["model_name", "device"])
            family.add_metric([model, actor.device], actor.device_memory_bytes)
            yield family
        if actor.memory is not None:
            family = GaugeMetricFamily("llmd:model_weights_bytes",
                                       "The model's weights (every rank), by how they are kept: a GGUF type "
                                       "(packed), a dtype (dense), onednn (CPU linears' reordered copies).",
                                       labels=["model_name", "storage"])
            for storage, n in actor.memory().weights.items():
                family.add_metric([model, storage], n)
            yield family

    def _counters(self) -> Iterator[Metric]:
        actor, model = self.actor, self.actor.model
        step, totals = actor.last_step, actor.totals
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", model,
                       step.prefix_queries if step else 0)
        yield _counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", model,
                       step.prefix_hits if step else 0)
        yield _counter("num_preemptions", "Requests preempted for lack of KV blocks.", model,
                       step.num_preemptions_total if step else 0)
        yield _counter("prompt_tokens", "Prompt tokens of finished requests.", model, totals.prompt_tokens)
        yield _counter("generation_tokens", "Generated tokens of finished requests.", model, totals.generation_tokens)
        finished = {reason: 0 for reason in FINISH_REASONS} | dict(totals.finished)
        yield _counter_by("request_success", "Finished requests by finish reason.", model, "finished_reason",
                          finished)
        yield _counter("scheduled_prefill_tokens",
                       "Tokens computed in prefill rows (prompt chunks; recomputation after preemption too).",
                       model, totals.prefill_tokens)
        yield _counter("scheduled_decode_tokens",
                       "Tokens computed in decode rows (the new token, plus drafts being verified).",
                       model, totals.decode_tokens)

    def _histograms(self) -> Iterator[Metric]:
        for histogram in self.actor.histograms:
            family = HistogramMetricFamily(f"llmd:{histogram.name}", histogram.help_text, labels=["model_name"])
            family.add_metric([self.actor.model], histogram.cumulative_buckets(), histogram.sum)
            yield family

    def _spec_decode(self) -> Iterator[Metric]:
        spec, model = self.actor.spec, self.actor.model
        if spec is None:  # speculative decoding is off: no such families, as in vLLM
            return
        yield _counter("spec_decode_num_drafts", "Steps that verified drafts.", model, spec.num_drafts)
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens verified.", model, spec.num_draft_tokens)
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", model, spec.num_accepted_tokens)
        yield _counter_by("spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position (0 = first).",
                          model, "position", {str(i): n for i, n in enumerate(spec.accepted_per_position)})


def _gauge(name: str, text: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"llmd:{name}", text, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, text: str, model: str, value: float) -> CounterMetricFamily:
    """A counter family `llmd:<name>`, sampled as `llmd:<name>_total`."""
    family = CounterMetricFamily(f"llmd:{name}", text, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter_by(name: str, text: str, model: str, label: str, counts: Mapping[str, float]) -> CounterMetricFamily:
    """A counter family with one sample per value of `label`."""
    family = CounterMetricFamily(f"llmd:{name}", text, labels=["model_name", label])
    for key, count in counts.items():
        family.add_metric([model, key], count)
    return family
