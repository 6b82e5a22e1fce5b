"""Sampling as the HTTP APIs spell it: the fields all three take by the same name, the
llama.cpp lineage's own (Ollama's `options` and llama.cpp's /infill body say `stop` and
`repeat_penalty`), and `build_sampling`, which turns an API's fields into SamplingParams
with errors that name the API's parameter."""
from __future__ import annotations

import msgspec

from llmd.http.errors import from_value_error
from llmd_client.protocol import SamplingParams


class CommonSampling(msgspec.Struct, kw_only=True):
    """The sampling fields OpenAI's, Ollama's and llama.cpp's APIs share, name for name
    with SamplingParams; None: not given."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def sampling_fields(self) -> dict[str, object]:
        """These fields (and a subclass's) by SamplingParams' names."""
        return {name: getattr(self, name) for name in CommonSampling.__struct_fields__}


class LlamaSampling(CommonSampling, kw_only=True):
    """Ollama's and llama.cpp's sampling fields: the common ones, a stop list and
    llama.cpp's name for the repetition penalty."""

    stop: list[str] | None = None
    repeat_penalty: float | None = None

    def sampling_fields(self) -> dict[str, object]:
        return super().sampling_fields() | {"stop": self.stop, "repetition_penalty": self.repeat_penalty}


def build_sampling(fields: dict[str, object], *, max_tokens: int | None,
                   params: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from an API's fields (None: not given, the default applies;
    max_tokens None: up to the context's end); a value out of range is a 400 naming the
    API's own parameter."""
    try:
        return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:
        raise from_value_error(exc, params) from None
