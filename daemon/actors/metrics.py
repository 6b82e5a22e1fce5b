"""The metrics actor: per-request latencies and per-step figures of every model
(model_figures.py), served as `Status` and `Models` replies and as Prometheus text
(names after vLLM's `vllm:` metrics, prefix `llmd:`, labelled by model_name), written
by prometheus_client from a registry of the actor's own. What the pool says of each
model (loaded or not, waiting requests, expiry) it reads through `models_view`."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

from llmd.actors.messages import (Draining, EngineState, ModelLoaded, ModelSlept, ModelUnloaded, Query,
                                  RequestEvent, StepStats)
from llmd.actors.model_figures import ModelFigures
from llmd.actors.prometheus import PrometheusCollector
from llmd.actors.runtime import Actor
from llmd.core.request import parent_request_id
from llmd.core.spec_decode import SpecDecodeStats
from llmd.pool.slot import SlotView
from llmd_client.protocol import MemoryInfo, ModelStatus, ModelsReply, RequestInfo, SpecDecodeInfo, StatusReply
from llmd_client.durations import FOREVER

# The pool's states in which a model holds an engine (its figures are shown).
LOADED_STATES = ("serving", "unloading", "sleeping", "asleep", "waking")


@dataclass
class _Tracked:
    uid: int
    queued: float
    prompt_tokens: int
    model: str
    first_token: float | None = None
    scheduled: float | None = None
    last_step: float | None = None  # when a step last gave this request tokens
    generated: int = 0


class MetricsActor(Actor):
    name = "metrics"

    def __init__(self, *, default_model: str, server_version: str, health_stall_s: float = 60.0,
                 models_view: Callable[[], list[SlotView]] | None = None) -> None:
        """`default_model`: the model of requests that name none (the status reply's
        top-level fields are its); `models_view`: the pool's view of every model."""
        super().__init__()
        self.started = time.monotonic()
        self.health_stall_s = health_stall_s
        self.default_model = default_model
        self.server_version = server_version
        self.models_view = models_view
        self.requests: dict[str, _Tracked] = {}
        self.figures: dict[str, ModelFigures] = {}
        self.draining = False
        self.process = psutil.Process()
        self.process.cpu_percent(None)
        # Our own registry, not prometheus_client's global one: the figures belong to this
        # daemon (tests run several in one process), and the global one would add the
        # client library's own Python collectors.
        self.registry = CollectorRegistry()
        self.registry.register(PrometheusCollector(self))
        ProcessCollector(registry=self.registry)  # the standard process_* names (CPU seconds, RSS)

    def model(self, name: str) -> ModelFigures:
        figures = self.figures.get(name)
        if figures is None:
            figures = self.figures[name] = ModelFigures(name)
        return figures

    async def handle(self, message: object) -> None:
        match message:
            case RequestEvent(kind="queued"):
                model = message.model or self.default_model
                self.requests[message.request_id] = _Tracked(message.uid, message.time, message.prompt_tokens, model)
            case RequestEvent(kind="scheduled"):
                tracked = self.requests.get(message.request_id)
                if tracked is not None and tracked.scheduled is None:
                    tracked.scheduled = message.time
                    self.model(tracked.model).queue_time.observe(message.time - tracked.queued)
            case RequestEvent(kind="first_token"):
                tracked = self.requests.get(message.request_id)
                if tracked is not None and tracked.first_token is None:
                    tracked.first_token = message.time
                    figures = self.model(tracked.model)
                    figures.ttft.observe(message.time - tracked.queued)
                    if tracked.scheduled is not None:
                        figures.prefill_time.observe(message.time - tracked.scheduled)
            case RequestEvent(kind="finished"):
                self._finished(message)
            case StepStats():
                self._step(message)
            case EngineState():
                self.model(message.model or self.default_model).engine = message
            case ModelLoaded():
                self.model(message.model).loaded_as(message)
            case ModelUnloaded():
                self.model(message.model).unloaded()
            case ModelSlept():
                self.model(message.model).slept(message)
            case Draining():
                self.draining = True
            case Query(kind=kind, uid=uid, admin=admin, reply=reply):
                if not reply.done():
                    answers = {"status": lambda: self.status(uid, admin), "metrics": self.prometheus,
                               "health": self.health, "models": lambda: ModelsReply(self.model_statuses())}
                    reply.set_result(answers[kind]())
            case _:
                raise TypeError(f"metrics actor got {type(message).__name__}")

    def _finished(self, message: RequestEvent) -> None:
        """Per-request latencies, phases split as vLLM splits them: queue (arrival to first
        scheduled), prefill (to the first token), decode (first token to the end)."""
        tracked = self.requests.pop(message.request_id, None)
        figures = self.model(tracked.model if tracked is not None else self.default_model)
        figures.totals.prompt_tokens += message.prompt_tokens
        figures.totals.generation_tokens += message.completion_tokens
        figures.totals.finished[message.finish_reason or "unknown"] += 1
        figures.prompt_tokens.observe(message.prompt_tokens)
        figures.generation_tokens.observe(message.completion_tokens)
        if tracked is None:
            return
        figures.e2e.observe(message.time - tracked.queued)
        if tracked.scheduled is not None:
            figures.inference_time.observe(message.time - tracked.scheduled)
        if tracked.first_token is not None:
            figures.decode_time.observe(message.time - tracked.first_token)
            if message.completion_tokens > 1:
                figures.tpot.observe((message.time - tracked.first_token) / (message.completion_tokens - 1))

    def _step(self, message: StepStats) -> None:
        figures = self.model(message.model or self.default_model)
        figures.step(message)
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
                figures.itl.observe(message.time - tracked.last_step)
            tracked.last_step = message.time

    # -- what is asked ------------------------------------------------------------------
    def views(self) -> list[SlotView]:
        if self.models_view is not None:
            return self.models_view()
        return [SlotView(name=self.default_model, default=True, state="serving")]

    def model_state(self, view: SlotView) -> str:
        """A model's state: the pool's, or while it serves its engine's (restarting, dead)."""
        figures = self.figures.get(view.name)
        if view.state == "serving" and figures is not None and figures.loaded:
            return figures.engine.state
        return view.state

    def engine_state(self) -> str:
        """The default model's: serving, restarting (a worker), dead (too many worker
        failures), loading, unloaded, failed; draining on the way out."""
        state = self.model_state(self._default_view())
        return "draining" if state == "serving" and self.draining else state

    def _default_view(self) -> SlotView:
        return next((v for v in self.views() if v.default), SlotView(name=self.default_model, default=True,
                                                                      state="serving"))

    def health(self) -> tuple[bool, str]:
        """(healthy, why): unhealthy while the default model's engine is dead or
        restarting its worker, and when a model has requests pending and no engine step
        of it has ended for `health_stall_s` (a hung or dead model step)."""
        default = self.figures.get(self.default_model)
        if default is not None and default.loaded and default.engine.state == "dead":
            return False, f"engine dead: {default.engine.error}"
        if default is not None and default.loaded and default.engine.state == "restarting":
            return False, f"restarting the worker ({default.engine.restarts}) after: {default.engine.error}"
        if not self.requests:
            return True, "idle"
        now = time.monotonic()
        for name in {t.model for t in self.requests.values()}:
            figures = self.figures.get(name)
            last_step = figures.last_step.time if figures is not None and figures.last_step is not None \
                else self.started
            pending = [t for t in self.requests.values() if t.model == name]
            quiet = now - max(last_step, min(t.queued for t in pending))
            if quiet > self.health_stall_s:
                return False, f"no engine step of {name} for {quiet:.0f} s with {len(pending)} request(s) pending"
        return True, "ok"

    def running_by_model(self) -> dict[str, int]:
        """Model -> its requests in the running batch (by the model's last step)."""
        running_ids = {name: {parent_request_id(r) for r in f.last_step.running_ids}
                       for name, f in self.figures.items() if f.last_step is not None and f.loaded}
        counts: dict[str, int] = {}
        for rid, t in self.requests.items():
            if rid in running_ids.get(t.model, ()):
                counts[t.model] = counts.get(t.model, 0) + 1
        return counts

    def num_running(self, model: str) -> int:
        return self.running_by_model().get(model, 0)

    def num_admitted(self, model: str) -> int:
        return sum(1 for t in self.requests.values() if t.model == model)

    def model_statuses(self) -> list[ModelStatus]:
        running, statuses = self.running_by_model(), []
        for view in self.views():
            figures = self.figures.get(view.name)
            loaded = figures is not None and figures.loaded and view.state in LOADED_STATES
            num_running = running.get(view.name, 0)
            statuses.append(ModelStatus(
                name=view.name, aliases=list(view.aliases), path=view.path, default=view.default, task=view.task,
                state=self.model_state(view), sleep_level=view.sleep_level, idle_action=view.idle_action,
                load_progress=view.load_progress, load_phase=view.load_phase,
                device=figures.device if loaded else "", dtype=figures.dtype if loaded else "",
                memory_bytes=view.memory_bytes, memory_estimated=view.memory_estimated,
                memory=self._memory(figures) if loaded else None, num_running=num_running,
                num_waiting=self.num_admitted(view.name) - num_running + view.waiting,
                kv_blocks_total=figures.kv_blocks_total if loaded else 0,
                kv_cache_dtype=figures.kv_cache_dtype if loaded else "",
                kv_cache_scales=figures.kv_cache_scales if loaded else "",
                kv_blocks_used=figures.kv_blocks_used() if loaded else 0,
                keep_alive_s=None if view.keep_alive_s == FOREVER else view.keep_alive_s,
                expires_at=view.expires_at, last_used=view.last_used,
                engine_restarts=figures.engine.restarts if loaded else 0,
                error=view.error or (figures.engine.error if loaded else None)))
        return statuses

    def status(self, uid: int, admin: bool) -> StatusReply:
        now = time.monotonic()
        running = {parent_request_id(r) for f in self.figures.values() if f.last_step is not None and f.loaded
                   for r in f.last_step.running_ids}
        infos = [RequestInfo(request_id=rid, uid=t.uid, state="running" if rid in running else "waiting",
                             age_s=now - t.queued, prompt_tokens=t.prompt_tokens, completion_tokens=t.generated,
                             model=t.model)
                 for rid, t in self.requests.items() if admin or t.uid == uid]
        models = self.model_statuses()
        default = next(m for m in models if m.default)
        figures = self.figures.get(default.name) or ModelFigures(default.name)
        return StatusReply(
            model=self.default_model, server_version=self.server_version, uptime_s=now - self.started,
            device=default.device, dtype=default.dtype,
            num_running=default.num_running, num_waiting=default.num_waiting, requests=infos,
            kv_blocks_total=default.kv_blocks_total, kv_blocks_used=default.kv_blocks_used,
            kv_cache_dtype=default.kv_cache_dtype, kv_cache_scales=default.kv_cache_scales,
            kv_usage=figures.kv_usage(), prefix_cache_hit_rate=figures.prefix_hit_rate(),
            generation_tokens_per_s=figures.tokens_per_s(),
            prompt_tokens_total=figures.totals.prompt_tokens,
            generation_tokens_total=figures.totals.generation_tokens,
            requests_finished_total=sum(figures.totals.finished.values()),
            rss_bytes=self.process.memory_info().rss, cpu_percent=self.process.cpu_percent(None),
            num_preemptions_total=figures.engine_total("num_preemptions_total"),
            grammar_compiles_total=figures.grammar_compile.count,
            grammar_compile_seconds_total=figures.grammar_compile.sum,
            device_memory_bytes=figures.device_memory_bytes if figures.loaded else None, memory=default.memory,
            spec_decode=_spec_info(figures.spec_total()) if figures.loaded else None,
            engine_state=self.engine_state(), engine_restarts=default.engine_restarts,
            engine_error=figures.engine.error if figures.loaded else default.error,
            load_progress=default.load_progress, load_phase=default.load_phase, models=models)

    def _memory(self, figures: ModelFigures) -> MemoryInfo | None:
        """The model's memory split (MemoryInfo): "other" is what its process(es) hold
        beyond the weights and the KV cache. On a GPU that is rank 0's reserved device
        memory less its share of the weights and of the KV pool (all allocated at start);
        on CPU, the resident memory of its worker processes (or, for models in the
        daemon's own process, of the daemon: shared by them) less the weights and the
        KV blocks in use (the pool's pages are touched only as blocks are written)."""
        m = figures.memory() if figures.memory is not None else None
        if m is None:
            return None
        workers = sum(_rss(pid) for pid in m.worker_pids) if m.worker_pids else None
        weights = sum(m.weights.values())
        kv_used = figures.kv_blocks_used() * m.bytes_per_block
        if figures.device_memory_bytes is not None:
            other = figures.device_memory_bytes - (weights + m.kv_cache) // max(1, len(m.worker_pids))
        elif workers is not None:
            other = workers - weights - kv_used
        else:
            other = self.process.memory_info().rss - self._in_process_held()
        return MemoryInfo(weights=m.weights, kv_cache=m.kv_cache, kv_cache_used=kv_used, workers_rss=workers,
                          other=max(0, other))

    def _in_process_held(self) -> int:
        """Weights and KV blocks in use of every model loaded in the daemon's process."""
        held = 0
        for figures in self.figures.values():
            m = figures.memory() if figures.memory is not None else None
            if m is not None and not m.worker_pids:
                    held += sum(m.weights.values()) + figures.kv_blocks_used() * m.bytes_per_block
        return held

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
