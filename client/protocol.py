"""Messages shared by the daemon and its clients (msgspec Structs, defined once)."""
from __future__ import annotations

import math
import struct
from typing import Any

import msgspec

from llmd_client.durations import parse_duration
# The status replies (what `llmctl status` and `llmctl ps` show) live beside this module.
from llmd_client.status_messages import (MemoryInfo, ModelStatus, ModelsReply, RequestInfo, SpecDecodeInfo,  # noqa: F401
                                         StatusReply)


# Every integer a request carries fits a signed 32-bit int (the engine keeps counts, ids
# and priorities in int32/int64 tensors and msgpack frames): larger values are refused at
# the door with the field's name, never left to overflow inside a step.
INT32_MAX = 2**31 - 1
# Largest number of top logprobs a request may ask for; the engine may lower it.
MAX_LOGPROBS = 20
# Guided decoding: the largest spec (schema, regex or grammar text) and choice list.
MAX_GUIDED_SPEC_BYTES = 64 << 10
MAX_GUIDED_CHOICES = 256
GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
WHITESPACE_MODES = ("compact", "pretty", "any")


class GuidedDecodingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Constrain the output to a language. Exactly one of:

    - json_schema: a JSON schema (object, or its JSON text); the output is one JSON
      value that validates against it;
    - json_object: true; the output is any JSON object;
    - regex: the output matches the regular expression as a whole;
    - choice: the output is exactly one of these strings;
    - grammar: EBNF in xgrammar's dialect (GBNF-like), starting from rule `root`;
    - structural_tag: an xgrammar structural tag (`{"type": "structural_tag", "format":
      {...}}`, object or JSON text): tagged regions (tool calls) of JSON for their
      schemas, within free text or alone (what tool calling asks for).

    whitespace (JSON only): "compact" (one line, `{"a": 1, "b": [2, 3]}`), "pretty"
    (two-space indentation) or "any" (the model chooses; runs of whitespace are bounded).
    The structure is checked here; the daemon checks the spec itself (syntax, limits,
    whether it can ever complete) before accepting the request.
    """

    json_schema: dict[str, object] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, object] | str | None = None
    whitespace: str = "compact"

    def __post_init__(self) -> None:
        given = [k for k in GUIDED_KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, "guided", "needs exactly one of json_schema, json_object, regex, choice, "
               f"grammar, structural_tag; got {len(given)}")
        _check(self.whitespace in WHITESPACE_MODES, "guided.whitespace",
               "must be one of compact, pretty, any")
        for name in ("regex", "grammar") + tuple(k for k in ("json_schema", "structural_tag")
                                                 if isinstance(getattr(self, k), str)):
            value = getattr(self, name)
            if value is not None:
                _check(0 < len(value.encode("utf-8", "surrogatepass")) <= MAX_GUIDED_SPEC_BYTES,
                       f"guided.{name}", f"must have 1 to {MAX_GUIDED_SPEC_BYTES} bytes")
        if self.choice is not None:
            _check(0 < len(self.choice) <= MAX_GUIDED_CHOICES, "guided.choice",
                   f"must list 1 to {MAX_GUIDED_CHOICES} strings, got {len(self.choice)}")
            _check(all(self.choice), "guided.choice", "strings must not be empty")
            _check(sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice) <= MAX_GUIDED_SPEC_BYTES,
                   "guided.choice", f"must have at most {MAX_GUIDED_SPEC_BYTES} bytes in all")

    @property
    def kind(self) -> str:
        return next(k for k in GUIDED_KINDS if getattr(self, k) not in (None, False))


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """How to sample one request. Field names and defaults follow vLLM's.

    Validation runs on construction and on decode, and raises ValueError (msgspec turns
    it into a ValidationError on decode) with a message naming the field and its limit.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    guided: GuidedDecodingParams | None = None
    # False: never speculate for this request (when the engine has speculative decoding).
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        _check(1 <= self.n <= 64, "n", f"must be in [1, 64], got {_short(self.n)}")
        _check(self.temperature >= 0.0 and math.isfinite(self.temperature), "temperature",
               f"must be >= 0 and finite, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.top_k <= INT32_MAX, "top_k",
               f"must be 0 or -1 (disabled) or in [1, {INT32_MAX}], got {_short(self.top_k)}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(1 <= self.max_tokens <= INT32_MAX, "max_tokens",
                   f"must be in [1, {INT32_MAX}], got {_short(self.max_tokens)}")
        _check(0 <= self.min_tokens <= INT32_MAX, "min_tokens",
               f"must be in [0, {INT32_MAX}], got {_short(self.min_tokens)}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {_short(value)}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(_fits_float32(getattr(self, name)), name, "must be representable as a 32-bit float "
                   "(the sampler's type): not past 3.4e38, and not so close to 0 that it rounds to 0")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        for s in self.stop:
            _check(0 < len(s) <= 256, "stop", "each stop string must have 1 to 256 characters")
        _check(len(self.stop_token_ids) <= 64, "stop_token_ids",
               f"at most 64 stop token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check(0 <= t <= INT32_MAX, "stop_token_ids", f"token ids must be in [0, {INT32_MAX}]")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


def _fits_float32(value: float) -> bool:
    """Finite in float32 and zero there only where it is zero (temperature 1e39 became
    inf and repetition_penalty 5e-324 became 0 in the sampler: they unmasked what a grammar
    masked)."""
    try:
        narrowed = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return False
    return math.isfinite(narrowed) and (narrowed == 0.0) == (value == 0.0)


def _short(value: int) -> str:
    """An integer for an error message: a huge one is not echoed whole."""
    text = str(value)
    return text if len(text) <= 12 else f"{text[:8]}...({len(text)} digits)"


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
        _check(-INT32_MAX - 1 <= self.priority <= INT32_MAX, "priority",
               f"must be in [{-INT32_MAX - 1}, {INT32_MAX}], got {_short(self.priority)}")
        _check_model(self.model, self.keep_alive)


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


def _check_model(model: str | None, keep_alive: float | str | None) -> None:
    if model is not None:
        _check(0 < len(model) <= MAX_MODEL_CHARS and "\x00" not in model, "model",
               f"must be a name (or path) of 1 to {MAX_MODEL_CHARS} characters")
    if keep_alive is not None:
        parse_duration(keep_alive, "keep_alive")


class Metrics(msgspec.Struct, tag="metrics", forbid_unknown_fields=True):
    pass


ClientMessage = Hello | Submit | Abort | Status | Metrics | Models | Load | Unload


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
