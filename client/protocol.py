"""Messages shared by the daemon and its clients (msgspec Structs, defined once). What a
request asks for (sampling, guided decoding, pooling) is in request_params, re-exported here."""
from __future__ import annotations

from typing import Any

import msgspec

from llmd_client.durations import parse_duration
from llmd_client.request_params import (  # noqa: F401 (re-exported: what messages carry)
    GUIDED_KINDS, INT32_MAX, MAX_GUIDED_CHOICES, MAX_GUIDED_SPEC_BYTES, MAX_LOGPROBS, WHITESPACE_MODES,
    GuidedDecodingParams, PoolingParams, SamplingParams, check_field, shorten)
# The status replies (what `llmctl status` and `llmctl ps` show) live beside this module.
from llmd_client.status_messages import (MemoryInfo, ModelStatus, ModelsReply, RequestInfo, SpecDecodeInfo,  # noqa: F401
                                         StatusReply)

# -- wire messages ----------------------------------------------------------------------
# Every frame is a 4-byte big-endian length + msgpack of one tagged Struct below (see
# llmd_client.framing); a connection whose first byte is `{` speaks newline-delimited
# JSON of the same Structs instead.

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 << 20
MAX_CACHE_SALT_CHARS = 256
MAX_ID_CHARS = 128  # a request id (a client's own, or the server's) is never longer
MAX_MODEL_CHARS = 4096  # a model's name (or, where the operator allows them, its path)


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
    # Which model answers: one of the names the daemon serves (`llmctl ps`), or its path
    # where the operator allows paths. None: the daemon's default model.
    model: str | None = None
    # How long the model stays loaded once this request is done: seconds, or a duration
    # such as "5m" (negative: for ever; 0: unload right after). None: the model's own.
    keep_alive: float | str | None = None

    def __post_init__(self) -> None:
        _check_queueing(self.priority, self.model, self.keep_alive)


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
    # As Submit's: which model embeds (None: the default one), and how long it stays
    # loaded after (Ollama's /api/embed keep_alive).
    model: str | None = None
    keep_alive: float | str | None = None

    def __post_init__(self) -> None:
        _check_queueing(self.priority, self.model, self.keep_alive)


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """Abort by this connection's id, or by a server request id (llmctl abort)."""

    id: str


class Status(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    pass


class Models(msgspec.Struct, tag="models", forbid_unknown_fields=True):
    """List the models this daemon serves, loaded or not (`llmctl ps`)."""


class Load(msgspec.Struct, tag="load", forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Load a model (None: the default one) and keep it for `keep_alive` (as Submit's);
    the reply, a ModelsReply naming it, comes once it serves."""

    model: str | None = None
    keep_alive: float | str | None = None

    def __post_init__(self) -> None:
        _check_model(self.model, self.keep_alive)


class Unload(msgspec.Struct, tag="unload", forbid_unknown_fields=True, kw_only=True):
    """Unload a model once its requests are done; the reply (a ModelsReply naming it)
    comes once it is unloaded."""

    model: str

    def __post_init__(self) -> None:
        _check_model(self.model, None)


class Sleep(msgspec.Struct, tag="sleep", forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Put a loaded model to sleep once its requests are done (vLLM's sleep mode): its
    KV cache is freed and its weights kept in host memory (level 1; on a GPU copied to
    pinned RAM, on CPU where they are) or dropped (level 2: read from its files again at
    wake); its worker processes stay. The reply (a ModelsReply naming it) comes once it
    is asleep; a model that is not loaded is left as it is."""

    model: str | None = None  # None: the default model
    level: int = 1

    def __post_init__(self) -> None:
        _check_model(self.model, None)
        check_field(self.level in (1, 2), "level", f"must be 1 or 2, got {shorten(self.level)}")


class Wake(msgspec.Struct, tag="wake", forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Wake a sleeping model (a model that is not loaded is loaded); the reply (a
    ModelsReply naming it) comes once it serves. A request for a sleeping model wakes it too."""

    model: str | None = None  # None: the default model

    def __post_init__(self) -> None:
        _check_model(self.model, None)


def _check_queueing(priority: int, model: str | None, keep_alive: float | str | None) -> None:
    """The fields Submit and Embed share: where the request queues and which model it asks for."""
    check_field(-INT32_MAX - 1 <= priority <= INT32_MAX, "priority",
                f"must be in [{-INT32_MAX - 1}, {INT32_MAX}], got {shorten(priority)}")
    _check_model(model, keep_alive)


def _check_model(model: str | None, keep_alive: float | str | None) -> None:
    if model is not None:
        check_field(0 < len(model) <= MAX_MODEL_CHARS and "\x00" not in model, "model",
                    f"must be a name (or path) of 1 to {MAX_MODEL_CHARS} characters")
    if keep_alive is not None:
        parse_duration(keep_alive, "keep_alive")


class Metrics(msgspec.Struct, tag="metrics", forbid_unknown_fields=True):
    pass


ClientMessage = Hello | Submit | Embed | Abort | Status | Metrics | Models | Load | Unload | Sleep | Wake


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
    forbidden, too_long, unsupported_version, overloaded, shutting_down, internal,
    model_not_found, model_unavailable, aborted);
    `message` is for people. `id` names the request it concerns, if any."""

    code: str
    message: str
    id: str | None = None


class MetricsReply(msgspec.Struct, tag="metrics_reply"):
    text: str  # Prometheus text exposition format


ServerMessage = Welcome | Accepted | Output | Error | StatusReply | MetricsReply | ModelsReply
