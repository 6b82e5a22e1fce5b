"""llmd: a single-node LLM inference daemon and its offline engine.

`from llmd import LLM, SamplingParams` loads lazily so that pure-logic modules
(scheduler, KV cache manager) import without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmd_client.protocol import GuidedDecodingParams, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from llmd.llm import LLM
    from llmd.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput"]
_OUTPUTS = ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput")


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from llmd.llm import LLM
        return LLM
    if name in _OUTPUTS:
        from llmd import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
