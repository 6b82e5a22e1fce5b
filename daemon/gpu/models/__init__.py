"""Model architectures llmd runs, by the `architectures` name in config.json."""
from __future__ import annotations

from llmd.gpu.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from llmd.gpu.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from llmd.gpu.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from llmd.gpu.models.phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

# Architectures that are close to one llmd runs but are not it, with what to do instead.
NOT_RUN: dict[str, str] = {
    "Gemma3ForConditionalGeneration": (
        "is Gemma 3's multimodal model (a vision tower and projector beside the text decoder); llmd runs "
        "Gemma 3's text model, Gemma3ForCausalLM (checkpoints such as gemma-3-1b and gemma-3-270m)"),
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        if architecture in NOT_RUN:
            raise ValueError(f"architecture {architecture!r} {NOT_RUN[architecture]}") from None
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {supported})") from None
