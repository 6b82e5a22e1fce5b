"""The daemon's status replies (`llmctl status`, `llmctl ps`): the engine's figures, its
requests, memory and speculative decoding, and every model it can serve. Part of the
wire protocol (client/protocol.py re-exports them; its unions hold them)."""
from __future__ import annotations

import msgspec


class RequestInfo(msgspec.Struct, kw_only=True):
    request_id: str
    uid: int
    state: str  # waiting, running
    age_s: float
    prompt_tokens: int
    completion_tokens: int
    model: str = ""  # the model's name


class SpecDecodeInfo(msgspec.Struct, kw_only=True):
    """Speculative decoding since start: steps that verified drafts, drafted and
    accepted tokens, and how often the draft at each position was accepted."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float  # accepted / drafted tokens
    mean_accepted_length: float  # tokens emitted per verifying step (accepted + 1)


class MemoryInfo(msgspec.Struct, kw_only=True):
    """Where the model's memory goes, in bytes."""

    # The weights (every rank) by how they are kept: a GGUF type such as "Q4_1" (packed),
    # a dtype such as "float32" (dense), "onednn" (the reordered copies CPU linear
    # layers multiply with, beside the checkpoint layout).
    weights: dict[str, int]
    kv_cache: int  # the KV pool on every rank (on CPU its pages become resident as blocks are written)
    kv_cache_used: int  # the blocks in use now
    # The worker processes' resident memory (None: the model runs in the daemon's process).
    workers_rss: int | None = None
    # The rest of what holds memory for the model: activations, the runtime, caches. On a
    # GPU the device memory reserved less weights and the KV pool; on CPU the resident
    # memory (daemon and workers) less weights and the KV in use.
    other: int = 0


class ModelStatus(msgspec.Struct, kw_only=True):
    """One model the daemon can serve, and how it stands."""

    name: str  # what requests name it by (its `[models.NAME]`, or the default model's first name)
    aliases: list[str] = []  # other names it answers to
    path: str = ""  # its directory or GGUF file ("": the built-in model)
    default: bool = False  # the model of requests that name none
    task: str = "generate"  # what it is served for: "generate" (text; embeddings too) or "embed" (embeddings only)
    # "unloaded", "loading" (requests wait), "serving", "restarting" (a failed worker;
    # requests wait), "unloading", "sleeping" (going to sleep), "asleep" (its KV cache
    # freed, its weights kept in host memory or dropped, as `sleep_level` says; its next
    # request wakes it), "waking" (requests wait), "failed" (the last load failed or its
    # engine died: the next request loads it afresh; `error` says why).
    state: str = "unloaded"
    sleep_level: int | None = None  # while sleeping or asleep: 1 (weights kept in host memory) or 2 (dropped)
    idle_action: str = "unload"  # what keep_alive's end does to it: "unload" or "sleep"
    load_progress: float | None = None  # while loading: 0..1
    load_phase: str | None = None  # while loading
    device: str = ""
    dtype: str = ""
    # Bytes it holds while loaded (its weights and KV pool), else what loading it is
    # estimated to take (its weights as the device will hold them plus the KV cache
    # setting: llmd.pool.estimate): what the memory budget counts.
    memory_bytes: int = 0
    memory_estimated: bool = True  # memory_bytes is an estimate (the model is not loaded)
    memory: MemoryInfo | None = None  # while loaded
    num_running: int = 0
    num_waiting: int = 0  # admitted and queued, plus requests waiting for the model to load
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    # What the KV cache stores per element while loaded: the model's dtype ("bfloat16"),
    # a narrower float ("float16") or a quantized format ("fp8_e4m3", "int8": the engine
    # setting kv_cache_dtype).
    kv_cache_dtype: str = ""
    # Where a quantized cache's per-layer scales come from while loaded: "checkpoint" (the
    # model's own), "calibrated" (a prefill at start); "" for a float cache.
    kv_cache_scales: str = ""
    keep_alive_s: float | None = None  # how long it stays once idle (None: for ever)
    expires_at: float | None = None  # Unix time it will be unloaded (idle, with a finite keep_alive)
    last_used: float | None = None  # Unix time its last request ended (None: never used)
    engine_restarts: int = 0  # worker failures since it loaded
    error: str | None = None  # the last failure's cause


class StatusReply(msgspec.Struct, tag="status_reply", kw_only=True):
    model: str
    server_version: str
    uptime_s: float
    device: str
    dtype: str
    num_running: int
    num_waiting: int
    requests: list[RequestInfo]
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    prefix_cache_hit_rate: float
    kv_cache_dtype: str = ""  # the default model's (ModelStatus.kv_cache_dtype)
    kv_cache_scales: str = ""  # the default model's (ModelStatus.kv_cache_scales)
    generation_tokens_per_s: float
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    rss_bytes: int
    cpu_percent: float
    num_preemptions_total: int = 0
    grammar_compiles_total: int = 0
    grammar_compile_seconds_total: float = 0.0
    # Memory the model's device holds (rank 0's torch allocator, reserved); None on CPU.
    device_memory_bytes: int | None = None
    memory: MemoryInfo | None = None  # None while loading
    spec_decode: SpecDecodeInfo | None = None  # None: speculative decoding is off
    # The default model's: "loading" (requests wait); "serving"; "restarting" a failed
    # worker (requests wait); "dead" after too many worker failures (requests fail; a
    # daemon serving only this model exits); "unloaded" or "failed" (a request loads it
    # again); "sleeping", "asleep" or "waking" (a request wakes it); "draining" on the way out.
    engine_state: str = "serving"
    engine_restarts: int = 0  # worker failures since start
    engine_error: str | None = None  # the last worker failure's cause
    load_progress: float | None = None  # while loading: 0..1
    load_phase: str | None = None  # while loading: tokenizer, weights, kv cache, cuda graphs, workers
    # Every model the daemon can serve (the fields above are the default model's).
    models: list[ModelStatus] = []


class ModelsReply(msgspec.Struct, tag="models_reply"):
    """The answer to Models (every model), and to Load, Unload, Sleep and Wake (the model concerned)."""

    models: list[ModelStatus]
