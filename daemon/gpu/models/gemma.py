"""Gemma 2 and Gemma 3 text decoders (transformers' Gemma2ForCausalLM, Gemma3ForCausalLM).

What sets them apart from Llama, each as transformers computes it:
- RMSNorm with scale (1 + w), in float32 (layers.GemmaRMSNorm), and four norms per
  layer: input, post-attention (on the attention output, before the residual add),
  pre- and post-feed-forward (around the MLP);
- embeddings times sqrt(hidden_size), that factor rounded to the compute dtype first;
- a GELU (tanh) gated MLP (`hidden_activation`);
- attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- alternating local (sliding window) and global layers from `layer_types`;
- Gemma 2: attention scores soft-capped at attn_logit_softcapping (every attention
  backend implements the cap); both: final logits soft-capped at
  final_logit_softcapping;
- Gemma 3: per-head q/k norms (also 1 + w), and rope parameters per layer type
  (`rope_parameters["sliding_attention"]` / `["full_attention"]`: transformers 5 puts
  the old `rope_local_base_freq` in the first), so local and global layers rotate with
  their own theta and scaling.

Gemma 3's transformers model does not apply attn_logit_softcapping (its attention call
never passes it), so a Gemma 3 config that sets it is refused rather than run one way or
the other; so is `use_bidirectional_attention` (not a causal decoder).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.attention import AttentionMetadata
from llmd.gpu.layers.fused_ops import layer_ops
from llmd.gpu.layers.norms import GemmaRMSNorm
from llmd.gpu.models.config_checks import check_activation, check_heads, check_rope, refuse
from llmd.gpu.models.llama import DecoderAttention, DecoderMLP, LlamaForCausalLM, windows_from_layer_types
from llmd.gpu.layers.rotary import RotaryEmbedding
from llmd.gpu.layers.tp import TPShape

FLAT_ROPE = "all layers"  # rotary key of a model with one set of rope parameters


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, tp: TPShape | None, attention_backend: str,
                 sliding_window: int | None, softcap: float | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.ops = layer_ops(attention_backend)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = DecoderAttention(config, bool(getattr(config, "attention_bias", False)), qk_norm, tp,
                                          attention_backend, sliding_window,
                                          scale=float(config.query_pre_attn_scalar) ** -0.5, softcap=softcap,
                                          norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = DecoderMLP(config, tp, config.hidden_activation, self.ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        ops = self.ops
        attn = self.self_attn(ops.rms_norm(self.input_layernorm, hidden), cos, sin, kv_cache, md)
        # hidden + post_attention_layernorm(attn), then its pre-feed-forward norm: one add + norm.
        mlp_in, hidden = ops.add_rms_norm(self.pre_feedforward_layernorm,
                                          ops.rms_norm(self.post_attention_layernorm, attn), hidden)
        return hidden + ops.rms_norm(self.post_feedforward_layernorm, self.mlp(mlp_in))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; Gemma3ForCausalLM below changes what differs."""

    qk_norm = False
    norm_class = GemmaRMSNorm
    attention_softcap = True  # transformers' model applies attn_logit_softcapping
    rope_per_layer_type = False  # one rope_parameters dict for every layer

    @classmethod
    def check_config(cls, config: Any) -> None:
        name = cls.__name__
        head_dim = check_heads(name, config)
        check_activation(name, "hidden_activation", getattr(config, "hidden_activation", None))
        check_rope(name, config, head_dim, partial_rotary=False, layer_types=cls.rope_keys(config))
        if not cls.rope_per_layer_type and set(getattr(config, "rope_parameters", None) or {}) & set(
                cls._layer_types(config)):
            refuse(name, "rope_parameters", config.rope_parameters,
                   "nests parameters per layer type, which transformers' Gemma 2 does not read")
        if getattr(config, "use_bidirectional_attention", None):
            refuse(name, "use_bidirectional_attention", config.use_bidirectional_attention,
                   "asks for attention in both directions; llmd runs causal decoders only")
        _positive(name, "query_pre_attn_scalar", getattr(config, "query_pre_attn_scalar", None), required=True)
        _positive(name, "final_logit_softcapping", getattr(config, "final_logit_softcapping", None))
        cap = getattr(config, "attn_logit_softcapping", None)
        if cls.attention_softcap:
            _positive(name, "attn_logit_softcapping", cap)
        elif cap is not None:
            refuse(name, "attn_logit_softcapping", cap, "is not applied by transformers' model of this "
                   "architecture (its attention never passes it); llmd refuses rather than guess")
        cls.attention_windows(config)

    @classmethod
    def attention_windows(cls, config: Any) -> list[int | None]:
        return windows_from_layer_types(cls.__name__, config, cls._layer_types(config))

    @staticmethod
    def _layer_types(config: Any) -> list[str]:
        return list(getattr(config, "layer_types", None) or [])

    @classmethod
    def rope_keys(cls, config: Any) -> list[str | None]:
        """Each layer's rope_parameters key (None: the one flat dict)."""
        if cls.rope_per_layer_type:
            return cls._layer_types(config)
        return [None] * config.num_hidden_layers

    def make_layer(self, index: int, window: int | None, tp: TPShape | None, attention_backend: str) -> nn.Module:
        softcap = self.config.attn_logit_softcapping if self.attention_softcap else None
        return GemmaDecoderLayer(self.config, self.qk_norm, tp, attention_backend, window, softcap)

    def build_rotary(self) -> nn.Module:
        """One cos/sin table per rope key, named by it; each layer's key in order."""
        self.layer_rope_keys = [FLAT_ROPE if key is None else key for key in self.rope_keys(self.config)]
        return nn.ModuleDict({key: RotaryEmbedding(self.config, self.head_dim, self.max_positions,
                                                   None if key == FLAT_ROPE else key)
                              for key in set(self.layer_rope_keys)})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self._embed_scale(hidden.dtype)
        tables = {key: table.cos_sin(positions, hidden.dtype) for key, table in self.rotary.items()}
        for layer, key, kv_cache in zip(self.layers, self.layer_rope_keys, kv_caches):
            cos, sin = tables[key]
            hidden = layer(hidden, cos, sin, kv_cache, md)
        return self.ops.rms_norm(self.norm, hidden)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        return _rounded_sqrt(self.config.hidden_size, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: q/k norms, rope per layer type, no attention soft-cap."""

    qk_norm = True
    attention_softcap = False
    rope_per_layer_type = True


@functools.cache
def _rounded_sqrt(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to float32 and then to `dtype`, as transformers casts
    its scale buffer to the embedding's dtype (bf16: sqrt(3072) = 55.43 -> 55.5)."""
    return float(torch.tensor(hidden_size ** 0.5).to(dtype))


def _positive(architecture: str, field: str, value: Any, required: bool = False) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        refuse(architecture, field, value, "must be a positive number" + ("" if required else " or null"))
