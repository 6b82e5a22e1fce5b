"""The decoder every architecture is (models/architectures.py says which features each
turns on): our own modules over the paged KV cache, built with this rank's share of the
weights (layers/linear.py; `tp` None on a single rank) and loaded by models/loader.py.

A layer is Llama's pre-norm block, or with `sandwich_norms` Gemma's: input norm,
attention, post-attention norm on the attention's output, residual add, pre-feed-forward
norm, MLP, post-feed-forward norm, residual add. Both carry the residual beside the
hidden state so each residual add is fused with the next norm (`ops.add_rms_norm`).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.attention import AttentionMetadata
from llmd.gpu.layers.attention_backends import make_attention
from llmd.gpu.layers.fused_ops import LayerOps, layer_ops
from llmd.gpu.layers.linear import ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from llmd.gpu.layers.mlp import GatedMLP, SparseMoeBlock
from llmd.gpu.layers.norms import RMSNorm
from llmd.gpu.layers.rotary import NoRotary, RotaryEmbedding, rope_parameters, rotary_dim
from llmd.gpu.layers.tp import TPShape, tp_shape
from llmd.gpu.models.architectures import NOPE, Architecture, get_architecture

FLAT_ROPE = "all layers"  # rotary key of a model with one set of rope parameters


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """q/k/v projection (fused), optional per-head q/k norm, rotary, paged attention,
    o_proj. `scale` defaults to head_dim ** -0.5; `softcap` caps the scores (Gemma 2);
    `norm` is the q/k norm's class. Between the projections `ops` (fused_ops, by the
    backend) runs the norms, rotary and K/V write: unfused, or one kernel."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TPShape | None = None,
                 attention_backend: str = "torch", sliding_window: int | None = None, *,
                 scale: float | None = None, softcap: float | None = None, norm: type[RMSNorm] = RMSNorm,
                 ops: LayerOps) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, qkv_bias, tp)
        # With tensor parallelism every size here is this rank's share.
        self.num_heads, self.num_kv_heads = (heads, kv_heads) if tp is None else (tp.num_heads, tp.num_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2 has q/k/v bias but none on o_proj; every architecture's o_proj follows attention_bias.
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.sliding_window = sliding_window  # None: full attention
        self.attn = make_attention(attention_backend, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5 if scale is None else scale, sliding_window, softcap)
        self.ops = ops  # its layer's

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        out = self.ops.attend(self, self.qkv_proj(hidden), cos, sin, kv_cache, md)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


class DecoderLayer(nn.Module):
    """Attention and feed-forward (`mlp`: a GatedMLP or a SparseMoeBlock) with the
    architecture's norms (module doc)."""

    def __init__(self, arch: Architecture, config: Any, mlp: nn.Module, tp: TPShape | None,
                 attention_backend: str, sliding_window: int | None, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.ops = ops if ops is not None else layer_ops(attention_backend)
        hidden, eps, norm = config.hidden_size, config.rms_norm_eps, arch.norm
        scale = softcap = None
        if arch.attention_scale_field is not None:
            scale = float(getattr(config, arch.attention_scale_field)) ** -0.5
        elif arch.multipliers:
            scale = float(config.attention_multiplier)
        if arch.attention_softcap:
            softcap = config.attn_logit_softcapping
        self.input_layernorm = norm(hidden, eps)
        self.self_attn = DecoderAttention(config, arch.qkv_bias(config), arch.qk_norm, tp, attention_backend,
                                          sliding_window, scale=scale, softcap=softcap, norm=norm, ops=self.ops)
        self.post_attention_layernorm = norm(hidden, eps)
        # Granite's: each block's output scaled before it joins the residual stream
        self.residual_multiplier = float(config.residual_multiplier) if arch.multipliers else 1.0
        self.sandwich = arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden, eps)
            self.post_feedforward_layernorm = norm(hidden, eps)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added)."""
        ops = self.ops
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(self.input_layernorm, hidden)
        else:
            hidden, residual = ops.add_rms_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, md)
        if not self.sandwich:
            scale = self.residual_multiplier
            hidden, residual = ops.add_rms_norm(self.post_attention_layernorm,
                                                hidden if scale == 1.0 else hidden * scale, residual)
            out = self.mlp(hidden)
            return (out if scale == 1.0 else out * scale), residual
        hidden, residual = ops.add_rms_norm(self.pre_feedforward_layernorm,
                                            ops.rms_norm(self.post_attention_layernorm, hidden), residual)
        return ops.rms_norm(self.post_feedforward_layernorm, self.mlp(hidden)), residual


class CausalLM(nn.Module):
    """The decoder of architecture `config.architectures[0]` (or `arch`), this rank's
    share of it with tp_size > 1 (`tp_units`: tp.tp_shape's units, the loader's plan).
    `decode_layers`: on CPU, the layers run from C++ for the decode steps they take
    (cpu/cpu_decode_layers; None: always the Python layers)."""

    decode_layers: Any = None

    def __init__(self, config: Any, max_positions: int, tp_rank: int = 0, tp_size: int = 1,
                 attention_backend: str = "torch", arch: Architecture | None = None,
                 device: torch.device | None = None, tp_units: dict[str, int] | None = None) -> None:
        super().__init__()
        arch = arch or get_architecture((getattr(config, "architectures", None) or [""])[0])
        arch.check_config(config)
        self.arch, self.config = arch, config
        tp = tp_shape(config, tp_rank, tp_size, tp_units) if tp_size > 1 else None  # None: no distributed calls
        self.tp = tp
        self.head_dim = head_dim_of(config)
        self.max_positions = max_positions
        self.layer_rope_keys = [FLAT_ROPE if key is None else key for key in arch.rope_keys(config)]
        # Built on meta (the loader's way) the tables are made by reset_rotary on the real
        # device: computing them on meta costs nothing useful and imports torch._dynamo (~1 s).
        on_meta = torch.get_default_device().type == "meta"
        self.rotary = nn.ModuleDict() if on_meta else self.build_rotary()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        moe = arch.moe_spec(config)
        activation = arch.activation(config)
        ops = layer_ops(attention_backend, device)  # `device`: where the model will run (built on meta)
        layers = []
        for i, window in enumerate(arch.attention_windows(config)):
            if moe is not None and moe.sparse_layers[i]:
                mlp: nn.Module = SparseMoeBlock(config.hidden_size, moe, tp, activation, ops)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                               activation, tp, ops)
            layers.append(DecoderLayer(arch, config, mlp, tp, attention_backend, window, ops))
        self.layers = nn.ModuleList(layers)
        self.norm = arch.norm(config.hidden_size, config.rms_norm_eps)
        self.ops = ops  # the final norm's
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head reads the embedding table (packed or not);
        again after the parameters were materialized."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.quant = self.embed_tokens.quant

    def sparse_blocks(self) -> dict[int, SparseMoeBlock]:
        """Layer index -> its sparse block (none in a dense model)."""
        return {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}

    def build_rotary(self) -> nn.ModuleDict:
        """One cos/sin table per rope key, named by it (each layer's key in layer_rope_keys)."""
        def table(key: str) -> nn.Module:
            if key == NOPE:  # as wide as the others (the fused kernels' rotated size)
                return NoRotary(rotary_dim(rope_parameters(self.config, None), self.head_dim))
            return RotaryEmbedding(self.config, self.head_dim, self.max_positions, None if key == FLAT_ROPE else key)

        return nn.ModuleDict({key: table(key) for key in dict.fromkeys(self.layer_rope_keys)})

    def reset_rotary(self, device: torch.device) -> None:
        """Rebuild the cos/sin caches on `device` (after the model was built on meta)."""
        self.rotary = self.build_rotary().to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        """Hidden states (after the final norm) of every token of the step."""
        hidden = self.embed_tokens(input_ids)
        if self.arch.embed_scale:
            hidden = hidden * _rounded_sqrt(self.config.hidden_size, hidden.dtype)
        elif self.arch.multipliers:
            hidden = hidden * float(self.config.embedding_multiplier)
        tables = {key: table.cos_sin(positions, hidden.dtype) for key, table in self.rotary.items()}
        if self.decode_layers is not None and self.decode_layers.takes(hidden, md, kv_caches):
            hidden, residual = self.decode_layers(hidden, tables, kv_caches, md)
        else:
            residual = None
            for layer, key, kv_cache in zip(self.layers, self.layer_rope_keys, kv_caches):
                cos, sin = tables[key]
                hidden, residual = layer(hidden, residual, cos, sin, kv_cache, md)
        hidden, _ = self.ops.add_rms_norm(self.norm, hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, argmax_rows: Sequence[int] | None = None,
                       vocab_limit: int | None = None) -> torch.Tensor:
        """Full-vocab logits (with tensor parallelism a collective: every rank must call it);
        of `argmax_rows` only their argmax over [0, vocab_limit) is good (layers/greedy_head)."""
        cap = getattr(self.config, "final_logit_softcapping", None) if self.arch.final_softcap else None
        divisor = float(self.config.logits_scaling) if self.arch.multipliers else 1.0
        if divisor != 1.0:  # Granite's: the division could round a logit ruled out at one pass to the best
            argmax_rows = None
        logits = self.lm_head(hidden, argmax_rows, vocab_limit, cap)
        logits = (logits / divisor if divisor != 1.0 else logits).float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


@functools.cache
def _rounded_sqrt(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to float32 and then to `dtype`, as transformers casts
    its scale buffer to the embedding's dtype (bf16: sqrt(3072) = 55.43 -> 55.5)."""
    return float(torch.tensor(hidden_size ** 0.5).to(dtype))
