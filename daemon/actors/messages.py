"""Messages between the daemon's actors. In-process only (never encoded), so fields may
hold live objects such as a connection or a reply future."""
from __future__ import annotations

from typing import Any

import msgspec

from llmd.core.engine_core import EngineStats
from llmd.core.scheduler import RequestUpdate


class AddRequest(msgspec.Struct):
    """intake -> scheduler: a validated request and its samples."""

    request_id: str
    children: list[Any]  # llmd.core.request.Request, one per sample


class AbortRequest(msgspec.Struct):
    """intake -> scheduler (abort, closed connection, drain timeout)."""

    request_ids: list[str]


class StopSamples(msgspec.Struct):
    """detokenizer -> scheduler: samples that hit a stop string."""

    child_ids: list[str]


class GrammarCompiled(msgspec.Struct):
    """A grammar compile finished (sent from the compiler's thread): wake the scheduler."""


class RegisterRequest(msgspec.Struct):
    """intake -> detokenizer, before the scheduler sees the request."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    child_ids: list[str]
    sink: Any  # the connection's per-request sink: sink.send(message), sink.closed


class StepTokens(msgspec.Struct):
    """scheduler -> detokenizer: what one step produced."""

    updates: list[RequestUpdate]
    num_cached: dict[str, int]


class RequestsAborted(msgspec.Struct):
    """scheduler -> detokenizer: requests finished by abort (or by an executor failure:
    reason "error", with `error` saying what happened)."""

    request_ids: list[str]
    reason: str = "abort"
    error: str | None = None


class WorkerExited(msgspec.Struct):
    """A worker process of executor `generation` exited (seen between steps, from the
    event loop): -> scheduler, which fails what ran on it and restarts it."""

    generation: int


class ChangeSleep(msgspec.Struct):
    """pool -> scheduler: put the idle engine to sleep at `level` (1 or 2), or wake it
    (None). `done` (an asyncio.Future) gets None once done, or the error."""

    level: int | None
    done: Any


class ModelSlept(msgspec.Struct, kw_only=True):
    """pool -> metrics: a model went to sleep at `level`, or woke (level None), taking
    `seconds`."""

    model: str
    level: int | None
    seconds: float = 0.0


class EngineState(msgspec.Struct):
    """scheduler -> metrics: how the engine is doing. `state` is "serving",
    "restarting" or "dead"; `restarts` counts worker failures since start; `error` is
    the last failure's cause."""

    state: str
    restarts: int = 0
    error: str | None = None
    model: str = ""  # the model whose engine it is


class Draining(msgspec.Struct):
    """server -> metrics: the daemon stopped accepting and is finishing its requests."""


class RequestEvent(msgspec.Struct):
    """-> metrics: lifecycle timestamps (time.monotonic())."""

    request_id: str
    kind: str  # "queued", "first_token", "finished"
    time: float
    uid: int = -1
    prompt_tokens: int = 0
    model: str = ""  # "queued" says which model answers it (the others follow the request)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


class StepStats(EngineStats, kw_only=True):
    """scheduler -> metrics, once per step (or after a change between steps): the step's
    figures beside the engine's (EngineStats; grammar compile times since the last one)."""

    time: float
    duration_s: float
    num_reqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_reqs: int
    num_generated: int
    generated: dict[str, int]  # scheduler (child) id -> tokens it gained this step
    device_memory_bytes: int | None = None  # see RunnerOutput.device_memory_bytes
    model: str = ""  # the model whose engine stepped


class ModelLoaded(msgspec.Struct, kw_only=True):
    """pool -> metrics: a model serves now. `memory` is its engine's memory() (asked at
    each status; dropped at unload, so the metrics keep no reference to the engine)."""

    model: str
    device: str
    dtype: str
    kv_blocks_total: int
    kv_cache_dtype: str = ""  # its KV cache's elements (LLMEngine.kv_cache_dtype)
    kv_cache_scales: str = ""  # where a quantized cache's scales come from (LLMEngine.kv_cache_scales)
    memory: Any = None  # () -> llmd.engine.ModelMemory
    load_seconds: float = 0.0


class ModelUnloaded(msgspec.Struct, kw_only=True):
    """pool -> metrics: a model was unloaded (its counters stay, its gauges go)."""

    model: str


class Query(msgspec.Struct):
    """intake -> metrics: a Status or Metrics request; the answer goes into `reply`."""

    kind: str  # "status", "metrics" or "health"
    uid: int
    admin: bool
    reply: Any  # asyncio.Future
