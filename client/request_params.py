"""What a request asks for, shared by the daemon and its clients: how to sample
(SamplingParams, with GuidedDecodingParams), how to pool an embedding (PoolingParams).
Each validates on construction and on decode, raising ValueError (msgspec turns it into
a ValidationError on decode) with a message that names the field and its limit.
`llmd_client.protocol` carries them in its messages and re-exports them."""
from __future__ import annotations

import math
import struct

import msgspec

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
        check_field(len(given) == 1, "guided", "needs exactly one of json_schema, json_object, regex, choice, "
               f"grammar, structural_tag; got {len(given)}")
        check_field(self.whitespace in WHITESPACE_MODES, "guided.whitespace",
               "must be one of compact, pretty, any")
        for name in ("regex", "grammar") + tuple(k for k in ("json_schema", "structural_tag")
                                                 if isinstance(getattr(self, k), str)):
            value = getattr(self, name)
            if value is not None:
                check_field(0 < len(value.encode("utf-8", "surrogatepass")) <= MAX_GUIDED_SPEC_BYTES,
                       f"guided.{name}", f"must have 1 to {MAX_GUIDED_SPEC_BYTES} bytes")
        if self.choice is not None:
            check_field(0 < len(self.choice) <= MAX_GUIDED_CHOICES, "guided.choice",
                   f"must list 1 to {MAX_GUIDED_CHOICES} strings, got {len(self.choice)}")
            check_field(all(self.choice), "guided.choice", "strings must not be empty")
            check_field(sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice) <= MAX_GUIDED_SPEC_BYTES,
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
        check_field(1 <= self.n <= 64, "n", f"must be in [1, 64], got {shorten(self.n)}")
        check_field(self.temperature >= 0.0 and math.isfinite(self.temperature), "temperature",
               f"must be >= 0 and finite, got {self.temperature}")
        check_field(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check_field(0 <= self.top_k <= INT32_MAX, "top_k",
               f"must be 0 or -1 (disabled) or in [1, {INT32_MAX}], got {shorten(self.top_k)}")
        check_field(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            check_field(1 <= self.max_tokens <= INT32_MAX, "max_tokens",
                   f"must be in [1, {INT32_MAX}], got {shorten(self.max_tokens)}")
        check_field(0 <= self.min_tokens <= INT32_MAX, "min_tokens",
               f"must be in [0, {INT32_MAX}], got {shorten(self.min_tokens)}")
        if self.max_tokens is not None:
            check_field(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check_field(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        check_field(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        check_field(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_field(0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {shorten(value)}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            check_field(_fits_float32(getattr(self, name)), name, "must be representable as a 32-bit float "
                   "(the sampler's type): not past 3.4e38, and not so close to 0 that it rounds to 0")
        check_field(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        for s in self.stop:
            check_field(0 < len(s) <= 256, "stop", "each stop string must have 1 to 256 characters")
        check_field(len(self.stop_token_ids) <= 64, "stop_token_ids",
               f"at most 64 stop token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            check_field(0 <= t <= INT32_MAX, "stop_token_ids", f"token ids must be in [0, {INT32_MAX}]")
        if self.seed is not None:
            check_field(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class PoolingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """What an embedding request asks of the pooled hidden state (vLLM's names). How the
    model's hidden states are pooled (last token, mean, first token) is the engine's
    `pooling_type`, not the request's.

    - normalize: divide the vector by its L2 norm (OpenAI's and vLLM's embeddings are
      unit vectors; Ollama's legacy /api/embeddings is not);
    - dimensions: keep only the first N dimensions (then normalize), for models trained
      for it (Matryoshka representation learning); other models refuse it.
    """

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            check_field(1 <= self.dimensions <= INT32_MAX, "dimensions",
                   f"must be in [1, {INT32_MAX}], got {shorten(self.dimensions)}")


def check_field(ok: bool, field: str, message: str) -> None:
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


def shorten(value: int) -> str:
    """An integer for an error message: a huge one is not echoed whole."""
    text = str(value)
    return text if len(text) <= 12 else f"{text[:8]}...({len(text)} digits)"
