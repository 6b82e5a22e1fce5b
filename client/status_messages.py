"""The daemon's status reply (`llmctl status`): the engine's figures, its requests,
memory and speculative decoding. Part of the wire protocol (client/protocol.py
re-exports it; its unions hold it)."""
from __future__ import annotations

import msgspec


class RequestInfo(msgspec.Struct, kw_only=True):
    request_id: str
    uid: int
    state: str  # waiting, running
    age_s: float
    prompt_tokens: int
    completion_tokens: int


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
    # "loading" the model (requests wait); "serving"; "restarting" a failed worker
    # (requests wait); "dead" after too many worker failures (requests fail; the daemon
    # exits); "draining" on the way out.
    engine_state: str = "serving"
    engine_restarts: int = 0  # worker failures since start
    engine_error: str | None = None  # the last worker failure's cause
    load_progress: float | None = None  # while loading: 0..1
    load_phase: str | None = None  # while loading: tokenizer, weights, kv cache, cuda graphs, workers
