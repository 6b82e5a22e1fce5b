"""One model's figures in the metrics actor: its latency and step histograms, token
totals, the last step's state (queues, KV blocks, prefix-cache and spec-decode counts),
its engine's state, memory and sleep level. Kept across unloads, so its counters only
grow: a reloaded model's request and token series go on, and the counts its engine
keeps (prefix-cache lookups and hits, preemptions, speculative drafts), which a new
engine starts from zero, are added to those of its earlier loads. The gauges of a model
that is not loaded read zero; the last step's state goes with the engine."""
from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.utils import floatToGoString

from llmd.actors.messages import EngineState, ModelLoaded, ModelSlept, StepStats
from llmd.core.spec_decode import SpecDecodeStats

if TYPE_CHECKING:
    from llmd.engine import ModelMemory

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Token counts per request (vLLM's 1-2-5 series) and per step (vLLM's iteration buckets).
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENGINE_COUNTERS = ("prefix_queries", "prefix_hits", "num_preemptions_total")  # StepStats' running totals
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Histogram:
    """Observations counted into buckets, exposed as the Prometheus histogram `llmd:<name>`."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative_buckets(self) -> list[tuple[str, float]]:
        """(upper bound, observations at or below it) pairs, "+Inf" last, as Prometheus
        histograms are exposed; bounds are written as prometheus_client writes them."""
        out, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append((floatToGoString(bound), cumulative))
        out.append(("+Inf", self.count))
        return out


@dataclass
class Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)
    prefill_tokens: int = 0  # tokens computed in prefill rows (recomputation after preemption too)
    decode_tokens: int = 0  # tokens computed in decode rows (drafts included)


class ModelFigures:
    """What the metrics actor knows of one model (see the module's docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loaded = False
        self.device = ""
        self.dtype = ""
        self.kv_blocks_total = 0
        self.kv_cache_dtype = ""
        self.kv_cache_scales = ""
        self.memory: Callable[[], ModelMemory] | None = None
        self.last_step: StepStats | None = None
        self.totals = Totals()
        self.spec: SpecDecodeStats | None = None
        self.device_memory_bytes: int | None = None
        self.engine = EngineState("serving", model=name)
        self.loads = 0
        self.unloads = 0
        self.sleep_level: int | None = None  # 1 or 2 while asleep
        self.sleeps = 0
        self.wakes = 0
        # The engine's running totals from earlier loads (see the module docstring).
        self.earlier = dict.fromkeys(ENGINE_COUNTERS, 0)
        self.earlier_spec: SpecDecodeStats | None = None
        self.recent_tokens: collections.deque[tuple[float, int]] = collections.deque()
        # Per request (exposed in this order).
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = Histogram("request_queue_time_seconds", "Time from arrival to first scheduled.")
        self.prefill_time = Histogram("request_prefill_time_seconds", "Time from first scheduled to the first token.")
        self.decode_time = Histogram("request_decode_time_seconds", "Time from the first token to the end.")
        self.inference_time = Histogram("request_inference_time_seconds", "Time from first scheduled to the end.")
        self.tpot = Histogram("request_time_per_output_token_seconds",
                              "Per request: mean time per output token after the first.")
        self.itl = Histogram("inter_token_latency_seconds", "Time between steps that gave a request tokens.")
        self.prompt_tokens = Histogram("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.generation_tokens = Histogram("request_generation_tokens", "Generated tokens per finished request.",
                                           TOKEN_BUCKETS)
        # Per engine step.
        self.step_tokens = Histogram("iteration_tokens_total", "Tokens scheduled per engine step.", STEP_TOKEN_BUCKETS)
        self.batch_size = Histogram("batch_size", "Requests per engine step.", BATCH_BUCKETS)
        self.step_time = Histogram("step_duration_seconds", "Engine step duration.")
        self.grammar_compile = Histogram("grammar_compile_seconds", "Guided decoding grammar compile time.",
                                         COMPILE_BUCKETS)
        self.load_time = Histogram("model_load_seconds", "Time to load the model (weights, KV cache, workers).",
                                   LOAD_BUCKETS)
        self.wake_time = Histogram("model_wake_seconds", "Time to wake the model from sleep (weights, KV cache).",
                                   LOAD_BUCKETS)
        self.histograms = (self.ttft, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
                           self.inference_time, self.tpot, self.itl, self.prompt_tokens, self.generation_tokens,
                           self.step_tokens, self.batch_size, self.step_time, self.grammar_compile, self.load_time,
                           self.wake_time)

    def loaded_as(self, message: ModelLoaded) -> None:
        self.loaded, self.device, self.dtype = True, message.device, message.dtype
        self.kv_blocks_total, self.memory = message.kv_blocks_total, message.memory
        self.kv_cache_dtype, self.kv_cache_scales = message.kv_cache_dtype, message.kv_cache_scales
        self.engine = EngineState("serving", model=self.name)
        self.last_step, self.sleep_level = None, None
        self.loads += 1
        self.load_time.observe(message.load_seconds)

    def unloaded(self) -> None:
        """Its gauges read zero from now on; the counts its engine kept are added to the
        earlier loads' (the next engine counts from zero)."""
        if self.last_step is not None:
            for name in ENGINE_COUNTERS:
                self.earlier[name] += getattr(self.last_step, name)
        self.earlier_spec, self.spec = self.spec_total(), None
        self.loaded, self.memory, self.device_memory_bytes = False, None, None
        self.last_step, self.sleep_level = None, None
        self.unloads += 1

    def slept(self, message: ModelSlept) -> None:
        """Asleep at message.level, or awake (None); its KV blocks went (the next step says so)."""
        self.sleep_level = message.level
        if message.level is None:
            self.wakes += 1
            self.wake_time.observe(message.seconds)
        else:
            self.sleeps += 1
            self.device_memory_bytes = None

    def engine_total(self, name: str) -> int:
        """One of ENGINE_COUNTERS over every load of the model."""
        now = getattr(self.last_step, name) if self.last_step is not None else 0
        return self.earlier[name] + now

    def spec_total(self) -> SpecDecodeStats | None:
        """Speculative decoding's counts over every load (None: it never drafted)."""
        if self.earlier_spec is None or self.spec is None:
            return self.spec or self.earlier_spec
        a, b = self.earlier_spec, self.spec
        width = max(len(a.accepted_per_position), len(b.accepted_per_position))
        per_position = [(a.accepted_per_position[i] if i < len(a.accepted_per_position) else 0)
                        + (b.accepted_per_position[i] if i < len(b.accepted_per_position) else 0) for i in range(width)]
        return SpecDecodeStats(a.num_drafts + b.num_drafts, a.num_draft_tokens + b.num_draft_tokens,
                               a.num_accepted_tokens + b.num_accepted_tokens, per_position)

    def step(self, message: StepStats) -> None:
        self.last_step = message
        if message.num_reqs:
            self.step_time.observe(message.duration_s)
            self.step_tokens.observe(message.num_tokens)
            self.batch_size.observe(message.num_reqs)
            self.totals.prefill_tokens += message.num_prefill_tokens
            self.totals.decode_tokens += message.num_tokens - message.num_prefill_tokens
        if message.num_generated:
            self.recent_tokens.append((message.time, message.num_generated))
        for seconds in message.grammar_compile_times:
            self.grammar_compile.observe(seconds)
        if message.spec is not None:
            self.spec = message.spec
        if message.device_memory_bytes is not None:
            self.device_memory_bytes = message.device_memory_bytes

    def kv_blocks_used(self) -> int:
        return self.last_step.kv_blocks_used if self.last_step is not None and self.loaded else 0

    def kv_usage(self) -> float:
        return self.kv_blocks_used() / self.kv_blocks_total if self.kv_blocks_total and self.loaded else 0.0

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        while self.recent_tokens and self.recent_tokens[0][0] < now - window:
            self.recent_tokens.popleft()
        if not self.recent_tokens:
            return 0.0
        span = max(now - self.recent_tokens[0][0], 1.0)
        return sum(n for _, n in self.recent_tokens) / span

    def prefix_hit_rate(self) -> float:
        step = self.last_step
        return step.prefix_hits / step.prefix_queries if step is not None and step.prefix_queries else 0.0
