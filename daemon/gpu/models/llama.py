"""Llama-family decoder (Llama, Mistral with its sliding window, Qwen2 with qkv bias,
Qwen3 with q/k norm; Qwen2/Qwen3 with per-layer sliding windows).

Our own modules over the paged KV cache; weights come from an HF checkpoint through
`load_weights`, which fuses q/k/v and gate/up projections as it reads them. Each
architecture reads its layers' attention windows from the config the way transformers'
model of that name does (`attention_windows`), and refuses what it would not run as
transformers does.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmd.gpu.layers.attention import AttentionMetadata
from llmd.gpu.layers.attention_backends import make_attention
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps, layer_ops
from llmd.gpu.layers.norms import RMSNorm
from llmd.gpu.models.config_checks import GEMMA_FIELDS, check_activation, check_heads, check_rope, check_unread
from llmd.gpu.layers.rotary import RotaryEmbedding
from llmd.gpu.layers.tp import (ParallelLMHead, RowParallelLinear, TPShape, VocabParallelEmbedding,
                         shard_checkpoint_tensor, tp_shape)


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# Checkpoint projections llmd fuses: checkpoint name part -> (fused name part, shard index).
FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}
# Fused parameter name part -> its number of shards.
FUSED_PARTS = {".qkv_proj.": 3, ".gate_up_proj.": 2}


class DecoderAttention(nn.Module):
    """q/k/v projection (fused), optional per-head q/k norm, rotary, paged attention,
    o_proj. `scale` defaults to head_dim ** -0.5; `softcap` caps the scores (Gemma 2);
    `norm` is the q/k norm's class. Between the projections `ops` (fused_ops, by the
    backend) runs the norms, rotary and K/V write: unfused, or one kernel."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TPShape | None = None,
                 attention_backend: str = "torch", sliding_window: int | None = None, *,
                 scale: float | None = None, softcap: float | None = None, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        # With tensor parallelism (tp given) every size here is this rank's share.
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        if tp is not None:
            self.num_heads, self.num_kv_heads = tp.num_heads, tp.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        # Qwen2 has q/k/v bias but none on o_proj; Llama/Qwen3 follow attention_bias.
        o_bias = bool(getattr(config, "attention_bias", False))
        if tp is None:
            self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        else:
            self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.sliding_window = sliding_window  # None: full attention
        self.attn = make_attention(attention_backend, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5 if scale is None else scale, sliding_window, softcap)
        self.ops = layer_ops(attention_backend)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        out = self.ops.attend(self, self.qkv_proj(hidden), cos, sin, kv_cache, md)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


class DecoderMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused; `activation` is an ACTIVATIONS
    name (the model's check_config refused any other), act * up run by `ops`."""

    def __init__(self, config: Any, tp: TPShape | None = None, activation: str = "silu",
                 ops: LayerOps = UNFUSED) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size if tp is None else tp.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=bias)
        if tp is None:
            self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)
        else:
            self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.activation = activation
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.activation))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TPShape | None = None,
                 attention_backend: str = "torch", sliding_window: int | None = None) -> None:
        super().__init__()
        self.ops = layer_ops(attention_backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, qkv_bias, qk_norm, tp, attention_backend, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, tp, getattr(config, "hidden_act", "silu"), self.ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(self.input_layernorm, hidden)
        else:
            hidden, residual = self.ops.add_rms_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, md)
        hidden, residual = self.ops.add_rms_norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp(hidden), residual


def windows_from_layer_types(architecture: str, config: Any, layer_types: list[str]) -> list[int | None]:
    """Each layer's window from its type, as transformers reads `layer_types`: a
    "sliding_attention" layer attends over config.sliding_window tokens, a
    "full_attention" layer over its whole context. Any other type is refused."""
    n = config.num_hidden_layers
    if len(layer_types) != n:
        raise ValueError(f"{architecture}: config layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers {n}")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"{architecture}: config layer_types {unknown} are not implemented by llmd "
                         f"(only {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})")
    window = getattr(config, "sliding_window", None)
    if SLIDING_ATTENTION in layer_types and (isinstance(window, bool) or not isinstance(window, int)
                                             or window < 1):
        raise ValueError(f"{architecture}: config layer_types has {SLIDING_ATTENTION!r} layers but "
                         f"sliding_window is {window!r} (a positive token count is needed)")
    return [window if t == SLIDING_ATTENTION else None for t in layer_types]


def _loaded_keys(name: str) -> list[str]:
    """The keys load_weights records for parameter `name`: one per shard of a fused
    projection (each is loaded on its own), else the name itself."""
    for part, count in FUSED_PARTS.items():
        if part in name:
            return [f"{name}#{i}" for i in range(count)]
    return [name]


class LlamaForCausalLM(nn.Module):
    """Also the base of Mistral (a sliding window), Qwen2 (qkv_bias=True) and Qwen3
    (qk_norm=True)."""

    qkv_bias = False
    qk_norm = False
    partial_rotary = False  # whether transformers' model applies partial_rotary_factor

    @classmethod
    def check_config(cls, config: Any) -> None:
        """ValueError naming the architecture and the field if the config asks for what
        this model does not run as transformers' does (config_checks); else None."""
        name = cls.__name__
        head_dim = check_heads(name, config)
        check_activation(name, "hidden_act", getattr(config, "hidden_act", "silu"))
        check_rope(name, config, head_dim, cls.partial_rotary)
        check_unread(name, config, GEMMA_FIELDS)
        cls.attention_windows(config)

    @classmethod
    def attention_windows(cls, config: Any) -> list[int | None]:
        """Each layer's sliding window (None: full attention), or ValueError naming the
        architecture and the config field llmd cannot honour. transformers' Llama
        attends in full whatever `sliding_window` or `layer_types` say, so a Llama
        config asking for windows is refused rather than run one way or the other."""
        name = cls.__name__
        window = getattr(config, "sliding_window", None)
        if window is not None:
            raise ValueError(f"{name}: config sliding_window={window!r} is not part of this architecture "
                             f"(transformers' Llama ignores it); llmd refuses rather than guess")
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and any(t != FULL_ATTENTION for t in layer_types):
            raise ValueError(f"{name}: config layer_types other than {FULL_ATTENTION!r} are not part of "
                             f"this architecture (transformers' Llama ignores them); llmd refuses rather than guess")
        return [None] * config.num_hidden_layers

    def __init__(self, config: Any, max_positions: int, tp_rank: int = 0, tp_size: int = 1,
                 attention_backend: str = "torch") -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        # tp is None on a single rank: plain layers, no distributed calls.
        tp = tp_shape(config, tp_rank, tp_size) if tp_size > 1 else None
        self.tp = tp
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rotary = self.build_rotary()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(tp, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i, window, tp, attention_backend)
                                    for i, window in enumerate(self.attention_windows(config)))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.ops = layer_ops(attention_backend)  # the final norm's
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if tp is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(tp, config.hidden_size, config.vocab_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    norm_class: type[RMSNorm] = RMSNorm

    def make_layer(self, index: int, window: int | None, tp: TPShape | None, attention_backend: str) -> nn.Module:
        qkv_bias = self.qkv_bias or bool(getattr(self.config, "attention_bias", False))
        return DecoderLayer(self.config, qkv_bias, self.qk_norm, tp, attention_backend, window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        """Hidden states (after the final norm) of every token of the step."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, md)
        hidden, _ = self.ops.add_rms_norm(self.norm, hidden, residual)
        return hidden

    def build_rotary(self) -> nn.Module:
        return RotaryEmbedding(self.config, self.head_dim, self.max_positions)

    def reset_rotary(self, device: torch.device) -> None:
        """Rebuild the cos/sin cache on `device` (after the model was built on meta)."""
        self.rotary = self.build_rotary().to(device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits (with tensor parallelism a collective: every rank must call it)."""
        return self.lm_head(hidden).float()

    def shard_checkpoint_tensor(self, name: str, sl: Any) -> torch.Tensor:
        """This rank's piece of checkpoint tensor `name` from a safetensors slice."""
        if self.tp is None:
            return sl[:]
        return shard_checkpoint_tensor(name, sl, self.tp, self.head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v and gate/up; raise on missing or
        unexpected names so a wrong checkpoint fails loudly."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            fused = next(((src, dst, shard) for src, (dst, shard) in FUSED_SHARDS.items() if src in name), None)
            if fused is not None:
                loaded.add(self._load_shard(params, name, tensor, *fused))
            else:
                loaded.update(self._load_whole(params, name, tensor))
        missing = [key for name in params if not (name == "lm_head.weight" and self.tie_word_embeddings)
                   for key in _loaded_keys(name) if key not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[0]!r}")

    def _load_shard(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
                    src: str, dst: str, shard: int) -> str:
        """Copy a checkpoint's q, k, v, gate or up projection into its rows of the fused
        parameter; returns the key that records this shard as loaded."""
        target_name = name.replace(src, dst)
        target = params.get(target_name)
        if target is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        offset, size = self._shard_range(target_name, shard)
        if tensor.shape[0] != size:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {size} rows")
        with torch.no_grad():
            target.data[offset:offset + size].copy_(tensor)
        return f"{target_name}#{shard}"

    def _load_whole(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> list[str]:
        """Copy a tensor that is one parameter as it stands (a fused projection stored
        fused, as Phi-3 does, loads every shard); returns the keys it records as loaded."""
        target = params.get(name)
        if target is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        keys = [name]
        if any(part in name for part in FUSED_PARTS):  # stored fused (Phi-3): every shard
            keys += _loaded_keys(name)
        if (self.tp is not None and name in ("embed_tokens.weight", "lm_head.weight")
                and tensor.shape[0] < target.shape[0] and tensor.shape[1:] == target.shape[1:]):
            # The last rank's vocab slice is padded to the common size with zeros.
            with torch.no_grad():
                target.data[:tensor.shape[0]].copy_(tensor)
                target.data[tensor.shape[0]:].zero_()
            return keys
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        with torch.no_grad():
            target.data.copy_(tensor)
        return keys

    def _shard_range(self, fused_name: str, shard: int) -> tuple[int, int]:
        if ".qkv_proj." in fused_name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            inter = self.config.intermediate_size if self.tp is None else self.tp.intermediate_size
            sizes = [inter, inter]
        return sum(sizes[:shard]), sizes[shard]


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with one sliding window for every layer (config.sliding_window; None:
    full attention), as transformers' Mistral."""

    @classmethod
    def attention_windows(cls, config: Any) -> list[int | None]:
        name = cls.__name__
        window = getattr(config, "sliding_window", None)
        layer_types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * config.num_hidden_layers
        declared = getattr(config, "layer_types", None)
        if declared is not None and list(declared) != layer_types:
            # transformers' Mistral ignores layer_types; a mix of types is Ministral's.
            raise ValueError(f"{name}: config layer_types {sorted(set(declared))} differ from the one window "
                             f"every Mistral layer has (sliding_window={window!r}); per-layer types are not "
                             f"implemented for this architecture")
        return windows_from_layer_types(name, config, layer_types)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias. Sliding windows per layer: transformers' Qwen2Config
    derives `layer_types` (sliding from layer max_window_layers on when
    use_sliding_window is set) unless config.json lists them."""

    qkv_bias = True

    @classmethod
    def attention_windows(cls, config: Any) -> list[int | None]:
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # a config object built without transformers' __post_init__
            use = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
            first = getattr(config, "max_window_layers", config.num_hidden_layers)
            layer_types = [SLIDING_ATTENTION if use and i >= first else FULL_ATTENTION
                           for i in range(config.num_hidden_layers)]
        return windows_from_layer_types(cls.__name__, config, list(layer_types))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's layout of windows, q/k RMSNorm instead of q/k/v bias."""

    qkv_bias = False
    qk_norm = True
