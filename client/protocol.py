"""Messages shared by the daemon and its clients (msgspec Structs, defined once)."""
from __future__ import annotations

import msgspec

# Largest number of top logprobs a request may ask for; the engine may lower it.
MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        _check(1 <= self.n <= 64, "n", f"must be in [1, 64], got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
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
                _check(0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        for s in self.stop:
            _check(0 < len(s) <= 256, "stop", "each stop string must have 1 to 256 characters")
        _check(len(self.stop_token_ids) <= 64, "stop_token_ids",
               f"at most 64 stop token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check(t >= 0, "stop_token_ids", "token ids must be >= 0")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
