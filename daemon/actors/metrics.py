"""The metrics actor: per-request latencies and per-step figures, served as `Status`
replies and as Prometheus text (names after vLLM's `vllm:` metrics, prefix `llmd:`),
written by prometheus_client from a registry of the actor's own."""
from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from llmd.actors.messages import Draining, EngineState, Query, RequestEvent, StepStats
from llmd.actors.prometheus import PrometheusCollector
from llmd.actors.runtime import Actor
from llmd.core.request import parent_request_id
from llmd.core.spec_decode import SpecDecodeStats
from llmd_client.protocol import MemoryInfo, RequestInfo, SpecDecodeInfo, StatusReply

if TYPE_CHECKING:
    from llmd.engine import ModelMemory

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Token counts per request (vLLM's 1-2-5 series) and per step (vLLM's iteration buckets).
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
class _Tracked:
    uid: int
    queued: float
    prompt_tokens: int
    first_token: float | None = None
    scheduled: float | None = None
    last_step: float | None = None  # when a step last gave this request tokens
    generated: int = 0


@dataclass
class _Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)
    prefill_tokens: int = 0  # tokens computed in prefill rows (recomputation after preemption too)
    decode_tokens: int = 0  # tokens computed in decode rows (drafts included)


class MetricsActor(Actor):
    name = "metrics"

    def __init__(self, *, model: str, server_version: str, device: str, dtype: str, kv_blocks_total: int,
                 health_stall_s: float = 60.0, memory: Callable[[], ModelMemory] | None = None) -> None:
        """`memory`: where the model's memory goes (LLMEngine.memory), asked at each status."""
        super().__init__()
        self.memory = memory
        self.started = time.monotonic()
        self.health_stall_s = health_stall_s
        self.model = model
        self.server_version = server_version
        self.device = device
        self.dtype = dtype
        self.requests: dict[str, _Tracked] = {}
        self.totals = _Totals()
        self.last_step: StepStats | None = None
        self.kv_blocks_total = kv_blocks_total
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
        self.histograms = (self.ttft, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
                           self.inference_time, self.tpot, self.itl, self.prompt_tokens, self.generation_tokens,
                           self.step_tokens, self.batch_size, self.step_time, self.grammar_compile)
        self.spec: SpecDecodeStats | None = None
        self.device_memory_bytes: int | None = None
        self.engine = EngineState("serving")
        self.draining = False
        self.process = psutil.Process()
        self.process.cpu_percent(None)
        # Our own registry, not prometheus_client's global one: the figures belong to this
        # daemon (tests run several in one process), and the global one would add the
        # client library's own Python collectors.
        self.registry = CollectorRegistry()
        self.registry.register(PrometheusCollector(self))
        ProcessCollector(registry=self.registry)  # the standard process_* names (CPU seconds, RSS)

    async def handle(self, message: object) -> None:
        match message:
            case RequestEvent(kind="queued"):
                self.requests[message.request_id] = _Tracked(message.uid, message.time, message.prompt_tokens)
            case RequestEvent(kind="scheduled"):
                tracked = self.requests.get(message.request_id)
                if tracked is not None and tracked.scheduled is None:
                    tracked.scheduled = message.time
                    self.queue_time.observe(message.time - tracked.queued)
            case RequestEvent(kind="first_token"):
                tracked = self.requests.get(message.request_id)
                if tracked is not None and tracked.first_token is None:
                    tracked.first_token = message.time
                    self.ttft.observe(message.time - tracked.queued)
                    if tracked.scheduled is not None:
                        self.prefill_time.observe(message.time - tracked.scheduled)
            case RequestEvent(kind="finished"):
                tracked = self.requests.pop(message.request_id, None)
                self.totals.prompt_tokens += message.prompt_tokens
                self.totals.generation_tokens += message.completion_tokens
                self.totals.finished[message.finish_reason or "unknown"] += 1
                self.prompt_tokens.observe(message.prompt_tokens)
                self.generation_tokens.observe(message.completion_tokens)
                if tracked is not None:
                    self._finished(tracked, message)
            case StepStats():
                self._step(message)
            case EngineState():
                self.engine = message
            case Draining():
                self.draining = True
            case Query(kind=kind, uid=uid, admin=admin, reply=reply):
                if not reply.done():
                    answers = {"status": lambda: self.status(uid, admin), "metrics": self.prometheus,
                               "health": self.health}
                    reply.set_result(answers[kind]())
            case _:
                raise TypeError(f"metrics actor got {type(message).__name__}")

    def _finished(self, tracked: _Tracked, message: RequestEvent) -> None:
        """Per-request latencies, phases split as vLLM splits them: queue (arrival to first
        scheduled), prefill (to the first token), decode (first token to the end)."""
        self.e2e.observe(message.time - tracked.queued)
        if tracked.scheduled is not None:
            self.inference_time.observe(message.time - tracked.scheduled)
        if tracked.first_token is not None:
            self.decode_time.observe(message.time - tracked.first_token)
            if message.completion_tokens > 1:
                self.tpot.observe((message.time - tracked.first_token) / (message.completion_tokens - 1))

    def _step(self, message: StepStats) -> None:
        self.last_step = message
        gained = set()
        for child_id, n in message.generated.items():
            parent = parent_request_id(child_id)
            tracked = self.requests.get(parent)
            if tracked is not None:
                tracked.generated += n
                gained.add(parent)
        for parent in gained:  # one inter-token gap per request per step (n samples share it)
            tracked = self.requests[parent]
            if tracked.last_step is not None:
                self.itl.observe(message.time - tracked.last_step)
            tracked.last_step = message.time
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

    def engine_state(self) -> str:
        """serving, restarting (a worker), dead (too many worker failures), draining."""
        if self.engine.state == "serving" and self.draining:
            return "draining"
        return self.engine.state

    def health(self) -> tuple[bool, str]:
        """(healthy, why): unhealthy while the engine is dead or restarting its worker,
        and when requests are pending and no engine step has ended for `health_stall_s`
        (a hung or dead model step)."""
        if self.engine.state == "dead":
            return False, f"engine dead: {self.engine.error}"
        if self.engine.state == "restarting":
            return False, f"restarting the worker ({self.engine.restarts}) after: {self.engine.error}"
        if not self.requests:
            return True, "idle"
        now = time.monotonic()
        last_step = self.last_step.time if self.last_step is not None else self.started
        oldest = min(t.queued for t in self.requests.values())
        quiet = now - max(last_step, oldest)
        if quiet > self.health_stall_s:
            return False, f"no engine step for {quiet:.0f} s with {len(self.requests)} request(s) pending"
        return True, "ok"

    def _tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        while self.recent_tokens and self.recent_tokens[0][0] < now - window:
            self.recent_tokens.popleft()
        if not self.recent_tokens:
            return 0.0
        span = max(now - self.recent_tokens[0][0], 1.0)
        return sum(n for _, n in self.recent_tokens) / span

    def _running_parents(self) -> set[str]:
        if self.last_step is None:
            return set()
        return {parent_request_id(rid) for rid in self.last_step.running_ids}

    def num_running(self) -> int:
        running = self._running_parents()
        return sum(1 for rid in self.requests if rid in running)

    def kv_usage(self) -> float:
        used = self.last_step.kv_blocks_used if self.last_step else 0
        return used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def status(self, uid: int, admin: bool) -> StatusReply:
        now = time.monotonic()
        running = self._running_parents()
        step = self.last_step
        hits = step.prefix_hits if step else 0
        queries = step.prefix_queries if step else 0
        infos = [RequestInfo(request_id=rid, uid=t.uid, state="running" if rid in running else "waiting",
                             age_s=now - t.queued, prompt_tokens=t.prompt_tokens, completion_tokens=t.generated)
                 for rid, t in self.requests.items() if admin or t.uid == uid]
        num_running = self.num_running()
        return StatusReply(
            model=self.model, server_version=self.server_version, uptime_s=now - self.started,
            device=self.device, dtype=self.dtype,
            num_running=num_running, num_waiting=len(self.requests) - num_running, requests=infos,
            kv_blocks_total=self.kv_blocks_total, kv_blocks_used=step.kv_blocks_used if step else 0,
            kv_usage=self.kv_usage(),
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            generation_tokens_per_s=self._tokens_per_s(),
            prompt_tokens_total=self.totals.prompt_tokens,
            generation_tokens_total=self.totals.generation_tokens,
            requests_finished_total=sum(self.totals.finished.values()),
            rss_bytes=self.process.memory_info().rss,
            cpu_percent=self.process.cpu_percent(None),
            num_preemptions_total=step.num_preemptions_total if step else 0,
            grammar_compiles_total=self.grammar_compile.count,
            grammar_compile_seconds_total=self.grammar_compile.sum,
            device_memory_bytes=self.device_memory_bytes,
            memory=self._memory(step.kv_blocks_used if step else 0),
            spec_decode=_spec_info(self.spec),
            engine_state=self.engine_state(), engine_restarts=self.engine.restarts,
            engine_error=self.engine.error,
        )

    def _memory(self, kv_blocks_used: int) -> MemoryInfo | None:
        """The model's memory split (MemoryInfo): "other" is what the process(es) hold
        beyond the weights and the KV cache. On a GPU that is rank 0's reserved device
        memory less its share of the weights and of the KV pool (all allocated at start);
        on CPU, the resident memory of the daemon and its workers less the weights and
        the KV blocks in use (the pool's pages are touched only as blocks are written)."""
        if self.memory is None:
            return None
        m = self.memory()
        workers = sum(_rss(pid) for pid in m.worker_pids) if m.worker_pids else None
        weights = sum(m.weights.values())
        kv_used = kv_blocks_used * m.bytes_per_block
        if self.device_memory_bytes is not None:
            other = self.device_memory_bytes - (weights + m.kv_cache) // max(1, len(m.worker_pids))
        else:
            other = self.process.memory_info().rss + (workers or 0) - weights - kv_used
        return MemoryInfo(weights=m.weights, kv_cache=m.kv_cache, kv_cache_used=kv_used, workers_rss=workers,
                          other=max(0, other))

    def prometheus(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of this daemon's registry."""
        return generate_latest(self.registry).decode()


def _rss(pid: int) -> int:
    """A process's resident memory (0 once it is gone: a worker being replaced)."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def _spec_info(spec: SpecDecodeStats | None) -> SpecDecodeInfo | None:
    if spec is None:
        return None
    return SpecDecodeInfo(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                          num_accepted_tokens=spec.num_accepted_tokens,
                          accepted_per_position=list(spec.accepted_per_position),
                          acceptance_rate=spec.acceptance_rate, mean_accepted_length=spec.mean_accepted_length)
