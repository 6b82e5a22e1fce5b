"""Turns a prompt (text, chat messages or token ids) and sampling params into validated
scheduler Requests: one per sample for n > 1. Raises ValueError with a message naming
the field and the limit; never echoes user input."""
from __future__ import annotations

import functools
import time
from dataclasses import KW_ONLY, dataclass
from typing import Any

import msgspec

from llmd.core.request import Request, child_request_id
from llmd.pooling_config import PoolingConfig
from llmd.structured_output import RequestGrammar, parse_guided
from llmd_client.protocol import PoolingParams, SamplingParams

# Text cut for truncation: its first max_model_len tokens lie within its first
# max_prompt_chars characters; this margin past them keeps the tokens at the cut as the
# whole text would have them (pre-tokenizers split locally).
TRUNCATE_MARGIN_CHARS = 4096


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams | PoolingParams
    children: list[Request]

    @property
    def child_ids(self) -> list[str]:
        return [c.request_id for c in self.children]


@dataclass(eq=False)
class InputProcessor:
    """The model's limits a prompt is checked against, and its tokenizer."""

    tokenizer: Any
    _: KW_ONLY
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    eos_token_id: int | None
    extra_stop_token_ids: set[int]
    task: str = "generate"  # "embed": generation requests are refused
    pooling: PoolingConfig | None = None  # how embeddings are made (None: embedding requests are refused)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Text longer than this can never fit max_model_len: no token covers more than
        the longest vocabulary entry's bytes, and a character is at least one byte. A
        longer prompt is refused before it is tokenized (which takes seconds for MBs)."""
        vocab = self.tokenizer.get_vocab()
        longest = max((len(token.encode("utf-8")) for token in vocab), default=1)
        return self.max_model_len * max(longest, 1)

    def tokenize(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids

    def render_chat(self, messages: list[dict[str, str]], *, add_special_tokens: bool = False,
                    **template: Any) -> list[int]:
        """Chat messages through the model's template (chat_text), tokenized. The template
        writes BOS itself: the tokenizer adds no second one unless asked (tokenize_chat)."""
        return self.tokenize_chat(self.chat_text(messages, **template), add_special_tokens=add_special_tokens)

    def tokenize_chat(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def chat_text(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, chat_template: str | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> str:
        """Chat messages through the model's template (or `chat_template`), by default
        ending with the assistant turn's opening; with continue_final_message, ending
        inside the last message, for the model to carry on writing it."""
        if not messages:
            raise ValueError("messages must not be empty")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; send a prompt instead")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message cannot be combined with add_generation_prompt")
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **(template_kwargs or {}))
        except TemplateError as exc:  # the template's own check (say, roles out of order)
            raise ValueError(f"messages cannot be rendered by the chat template: {exc}") from None

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                priority: int = 0, cache_salt: str | None = None,
                arrival_time: float | None = None, strict_max_tokens: bool = False,
                num_ctx: int | None = None, owner: object = None) -> PreparedRequest:
        """Tokenized and validated samples. max_tokens past the context is shortened to fit,
        or with `strict_max_tokens` refused. `num_ctx` (Ollama's option) narrows the
        context of this request below max_model_len."""
        if self.task == "embed":
            raise ValueError("generation is off: this model is served for embeddings only (task embed)")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenize(prompt) if prompt else []
        else:
            text = None
            token_ids = list(prompt)
        self.validate(token_ids, params)
        context = self.max_model_len
        if num_ctx is not None and num_ctx < context:
            context = num_ctx
            if len(token_ids) >= num_ctx:
                raise ValueError(f"prompt has {len(token_ids)} tokens; the request's num_ctx is {num_ctx} "
                                 "and at least one token must be generated")
        if strict_max_tokens and params.max_tokens is not None \
                and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds "
                             f"max_model_len ({self.max_model_len})")
        spec = parse_guided(params.guided) if params.guided is not None else None
        max_tokens = context - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if self.extra_stop_token_ids and not params.ignore_eos:
            extra = sorted(self.extra_stop_token_ids - set(params.stop_token_ids))
            if extra:
                params = msgspec.structs.replace(params, stop_token_ids=params.stop_token_ids + extra)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            child_ids = [request_id]
        else:
            child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        children = []
        for i, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                # Each sample is its own sequence; seeded ones get distinct, reproducible seeds.
                child_params = msgspec.structs.replace(
                    params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**63)
            children.append(Request(child_id, token_ids, child_params, eos_token_id=self.eos_token_id,
                                    priority=priority, arrival_time=arrival, cache_salt=cache_salt,
                                    max_tokens=max_tokens, owner=owner,
                                    grammar=RequestGrammar(spec) if spec is not None else None))
        return PreparedRequest(request_id, text, token_ids, params, children)

    def prepare_pooling(self, request_id: str, prompt: str | list[int], params: PoolingParams, *,
                        truncate: bool = False, num_ctx: int | None = None, priority: int = 0,
                        cache_salt: str | None = None, arrival_time: float | None = None,
                        owner: object = None) -> PreparedRequest:
        """A tokenized and validated embedding request. Its prompt must fit the context
        (max_model_len, or `num_ctx` below it: nothing is generated, so all of it may
        be prompt); with `truncate` a longer one keeps its first tokens that fit."""
        if self.pooling is None:
            raise ValueError("embeddings are not available in this engine")
        context = self.max_model_len if num_ctx is None else min(num_ctx, self.max_model_len)
        if isinstance(prompt, str):
            text: str | None = prompt
            if truncate and len(prompt) > self.max_prompt_chars + TRUNCATE_MARGIN_CHARS:
                prompt = prompt[:self.max_prompt_chars + TRUNCATE_MARGIN_CHARS]
            token_ids = self.tokenize(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(token_ids) > context:
            if not truncate:
                limit = "max_model_len" if context == self.max_model_len else "the request's num_ctx"
                raise ValueError(f"prompt has {len(token_ids)} tokens, more than {limit} ({context})")
            token_ids = token_ids[:context]
        self.pooling.check_dimensions(params.dimensions)
        request = Request(request_id, token_ids, None, pooling_params=params, eos_token_id=self.eos_token_id,
                          priority=priority, arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                          cache_salt=cache_salt, max_tokens=0, owner=owner)
        return PreparedRequest(request_id, text, token_ids, params, [request])

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "and at least one token must be generated")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}) (the model's vocabulary)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.max_logprobs}), got {k}")
