"""Messages shared by the daemon and its clients (msgspec Structs, defined once). What a
request asks for (sampling, guided decoding, pooling) is in request_params, re-exported here."""
from __future__ import annotations

from typing import Any

import msgspec

from llmd_client.request_params import (  # noqa: F401 (re-exported: what messages carry)
    GUIDED_KINDS, INT32_MAX, MAX_GUIDED_CHOICES, MAX_GUIDED_SPEC_BYTES, MAX_LOGPROBS, WHITESPACE_MODES,
    GuidedDecodingParams, PoolingParams, SamplingParams, check_field, shorten)

# -- wire messages ----------------------------------------------------------------------
# Every frame is a 4-byte big-endian length + msgpack of one tagged Struct below (see
# llmd_client.framing); a connection whose first byte is `{` speaks newline-delimited
# JSON of the same Structs instead.

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 << 20
MAX_CACHE_SALT_CHARS = 256
MAX_ID_CHARS = 128  # a request id (a client's own, or the server's) is never longer


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True, kw_only=True):
    protocol_version: int = PROTOCOL_VERSION
    client: str = ""


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One turn. An assistant turn may hold `tool_calls` (OpenAI's shape, arguments as
    an object); a `tool` turn answers the call `tool_call_id` (of function `name`).
    The chat template reads them as transformers passes them."""

    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Submit(msgspec.Struct, tag="submit", forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Exactly one of prompt, messages (chat, rendered with the model's template) or
    token_ids. `id` names the request within this connection (outputs carry it); the
    server assigns one when it is missing."""

    id: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Functions the chat template describes to the model (OpenAI's `{"type": "function",
    # "function": {...}}`); with messages only.
    tools: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    priority: int = 0
    # Extra prefix-cache key: requests share cached prefixes only when their salts are
    # equal. The daemon always adds the sender's uid unless its operator shares the
    # cache across users (prefix_cache_scope = "shared").
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_field(-INT32_MAX - 1 <= self.priority <= INT32_MAX, "priority",
               f"must be in [{-INT32_MAX - 1}, {INT32_MAX}], got {shorten(self.priority)}")


class Embed(msgspec.Struct, tag="embed", forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """An embedding: the model's final hidden states over one input, pooled (exactly one
    of prompt or token_ids). The request runs its prompt through the model and samples
    nothing; its one `output` carries `embedding`. `truncate`: an input longer than the
    context keeps its first max_model_len tokens instead of being refused."""

    id: str | None = None
    prompt: str | None = None
    token_ids: list[int] | None = None
    pooling: PoolingParams = msgspec.field(default_factory=PoolingParams)
    truncate: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        check_field(-INT32_MAX - 1 <= self.priority <= INT32_MAX, "priority",
               f"must be in [{-INT32_MAX - 1}, {INT32_MAX}], got {shorten(self.priority)}")


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """Abort by this connection's id, or by a server request id (llmctl abort)."""

    id: str


class Status(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    pass


class Metrics(msgspec.Struct, tag="metrics", forbid_unknown_fields=True):
    pass


ClientMessage = Hello | Submit | Embed | Abort | Status | Metrics


class Welcome(msgspec.Struct, tag="welcome", kw_only=True):
    protocol_version: int
    server_version: str
    model: str


class Accepted(msgspec.Struct, tag="accepted", kw_only=True):
    id: str  # the connection's id for the request
    request_id: str  # the server-wide id (what `llmctl abort` takes)
    prompt_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float  # >= MIN_WIRE_LOGPROB
    rank: int | None = None


# JSON has no -inf and clients read numbers: a token the grammar (or top-k/top-p) ruled
# out, -inf in the engine, leaves the daemon as this (vLLM's value), on every face.
MIN_WIRE_LOGPROB = -9999.0


def wire_logprob(logprob: float) -> float:
    return max(logprob, MIN_WIRE_LOGPROB)


class Output(msgspec.Struct, tag="output", kw_only=True, omit_defaults=True):
    """A streamed delta (or, with stream=false, the whole result). The last one for a
    sample has finish_reason set; the last one for the request also carries usage."""

    id: str
    index: int = 0  # which of the n samples
    text: str = ""
    token_ids: list[int] = []
    # Per new token: the chosen token first, then the top-k.
    logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    usage: Usage | None = None
    # With sampling.prompt_logprobs, on the request's last message: per prompt position,
    # the prompt's own token first, then the top-k (position 0, which nothing predicts,
    # is empty).
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    # An `embed` request's one output: the pooled vector (float32 values).
    embedding: list[float] | None = None


class Error(msgspec.Struct, tag="error", kw_only=True, omit_defaults=True):
    """`code` is stable for programs (bad_frame, bad_request, invalid_params, unknown_id,
    forbidden, too_long, unsupported_version, overloaded, shutting_down, internal);
    `message` is for people. `id` names the request it concerns, if any."""

    code: str
    message: str
    id: str | None = None


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


class MetricsReply(msgspec.Struct, tag="metrics_reply"):
    text: str  # Prometheus text exposition format


ServerMessage = Welcome | Accepted | Output | Error | StatusReply | MetricsReply
