"""The architectures llmd runs, as data: each is the one decoder (models/decoder.py) with
a set of features, read from the config the way transformers' model of that name reads
it. What differs between Llama, Mistral, Qwen2/3, Phi-3/4, Gemma 2/3, Granite, SmolLM3 and the MoE models
is a field here, not a subclass:

- `qkv_bias`: where q/k/v's bias comes from (a config field and its default, or always);
- `qk_norm`: per-head RMSNorm of q and k (Qwen3, Gemma 3);
- `partial_rotary`: whether `partial_rotary_factor` is applied (Phi-3/4);
- `norm`: RMSNorm, or Gemma's (scale 1 + w in float32);
- `sandwich_norms`: Gemma's four norms per layer (input, post-attention on the
  attention's output, pre- and post-feed-forward) instead of Llama's two;
- `embed_scale`: embeddings times sqrt(hidden_size), rounded to the compute dtype first;
- `attention_scale_field`: scale = config.<field> ** -0.5 instead of head_dim ** -0.5;
- `activation_field`: the config field naming the MLP activation;
- `attention_softcap` / `final_softcap`: scores / logits soft-capped (Gemma 2 / both);
- `rope_per_layer_type`: one rotary table per layer type (Gemma 3's local and global);
- `multipliers`: Granite's four config floats: embeddings times `embedding_multiplier`,
  the attention scale `attention_multiplier`, each block's output times
  `residual_multiplier` before it joins the residual stream, logits over `logits_scaling`;
- `nope_field`: the config's list of which layers rotate q/k (SmolLM3's `no_rope_layers`:
  1 rotates, 0 does not; its NoPE layers take the NOPE table, cos 1 and sin 0);
- `windows`: each layer's sliding window from the config (WINDOW_RULES);
- `moe`: how the config describes its experts (None: dense), and the checkpoint's
  expert projection names and renames.

Each architecture refuses (check_config) what transformers' model of the same name would
not run or would ignore: a ValueError naming the architecture and the field.

Gemma 3's transformers model does not apply attn_logit_softcapping (its attention call
never passes it), so a Gemma 3 config that sets it is refused rather than run one way or
the other; so is `use_bidirectional_attention` (not a causal decoder).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmd.gpu.layers.mlp import MoeSpec
from llmd.gpu.layers.norms import GemmaRMSNorm, RMSNorm
from llmd.gpu.models.config_checks import GEMMA_FIELDS, check_activation, check_heads, check_rope, check_unread, refuse

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
NOPE = "nope"  # the rotary key of a layer that does not rotate q and k (Architecture.rope_keys)
GRANITE_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


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


def full_attention(name: str, config: Any) -> list[int | None]:
    """Llama: transformers attends in full whatever `sliding_window` or `layer_types`
    say, so a config asking for windows is refused rather than run one way or the other."""
    window = getattr(config, "sliding_window", None)
    if window is not None:
        raise ValueError(f"{name}: config sliding_window={window!r} is not part of this architecture "
                         f"(transformers' Llama ignores it); llmd refuses rather than guess")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != FULL_ATTENTION for t in layer_types):
        raise ValueError(f"{name}: config layer_types other than {FULL_ATTENTION!r} are not part of "
                         f"this architecture (transformers' Llama ignores them); llmd refuses rather than guess")
    return [None] * config.num_hidden_layers


def one_window(name: str, config: Any) -> list[int | None]:
    """Mistral (and Phi-3, Mixtral, Qwen3-MoE): one sliding window for every layer
    (config.sliding_window; None: full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * config.num_hidden_layers
    declared = getattr(config, "layer_types", None)
    if declared is not None and list(declared) != layer_types:
        # transformers' Mistral ignores layer_types; a mix of types is Ministral's.
        raise ValueError(f"{name}: config layer_types {sorted(set(declared))} differ from the one window "
                         f"every Mistral layer has (sliding_window={window!r}); per-layer types are not "
                         f"implemented for this architecture")
    return windows_from_layer_types(name, config, layer_types)


def qwen2_layer_types(name: str, config: Any) -> list[int | None]:
    """Qwen2's rule: transformers' Qwen2Config derives `layer_types` (sliding from layer
    max_window_layers on when use_sliding_window is set) unless config.json lists them."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # a config object built without transformers' __post_init__
        use = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
        first = getattr(config, "max_window_layers", config.num_hidden_layers)
        layer_types = [SLIDING_ATTENTION if use and i >= first else FULL_ATTENTION
                       for i in range(config.num_hidden_layers)]
    return windows_from_layer_types(name, config, list(layer_types))


def smollm3_windows(name: str, config: Any) -> list[int | None]:
    """SmolLM3: a layer slides over config.sliding_window tokens only where
    use_sliding_window is set and its `layer_types` entry says so (transformers'
    SmolLM3Config derives them: the NoPE layers), else attends in full."""
    if not getattr(config, "use_sliding_window", False):
        return [None] * config.num_hidden_layers
    return windows_from_layer_types(name, config, list(getattr(config, "layer_types", None) or []))


def declared_layer_types(name: str, config: Any) -> list[int | None]:
    """Gemma: the config's `layer_types`, as listed."""
    return windows_from_layer_types(name, config, list(getattr(config, "layer_types", None) or []))


def _count(architecture: str, config: Any, field: str, default: Any = None, minimum: int = 1) -> int:
    value = getattr(config, field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        refuse(architecture, field, value, f"must be an int >= {minimum}")
    return value


def _top_k(architecture: str, config: Any, num_experts: int) -> int:
    top_k = _count(architecture, config, "num_experts_per_tok")
    if num_experts and top_k > num_experts:
        refuse(architecture, "num_experts_per_tok", top_k, f"exceeds the number of experts ({num_experts})")
    return top_k


def qwen_experts(shared_expert: bool) -> Callable[[str, Any], MoeSpec]:
    """Qwen2-MoE (a shared expert) and Qwen3-MoE: transformers' rule, a layer is sparse
    when num_experts > 0, it is not in mlp_only_layers and (index + 1) %
    decoder_sparse_step == 0 (the others have a dense MLP of `intermediate_size`)."""
    def spec(name: str, config: Any) -> MoeSpec:
        num_experts = _count(name, config, "num_experts", minimum=0)
        top_k = _top_k(name, config, num_experts)
        step = _count(name, config, "decoder_sparse_step", 1)
        layers = config.num_hidden_layers
        dense = getattr(config, "mlp_only_layers", None) or []
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense):
            refuse(name, "mlp_only_layers", dense, f"must list layer indices in [0, {layers})")
        shared = None
        if shared_expert:
            shared = _count(name, config, "shared_expert_intermediate_size")
        elif getattr(config, "shared_expert_intermediate_size", None):
            refuse(name, "shared_expert_intermediate_size", config.shared_expert_intermediate_size,
                   "asks for a shared expert, which transformers' model of this architecture does not have")
        sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
        return MoeSpec(num_experts, top_k, bool(getattr(config, "norm_topk_prob", False)),
                       _count(name, config, "moe_intermediate_size"), shared, sparse)
    return spec


def mixtral_experts(name: str, config: Any) -> MoeSpec:
    """Every layer sparse, the top_k weights always renormalised, expert size
    `intermediate_size`."""
    num_experts = _count(name, config, "num_local_experts")
    for field in ("shared_expert_intermediate_size", "mlp_only_layers"):
        if getattr(config, field, None):
            refuse(name, field, getattr(config, field), "is not part of this architecture (transformers' "
                   "Mixtral ignores the field); llmd refuses rather than guess")
    return MoeSpec(num_experts, _top_k(name, config, num_experts), True,
                   _count(name, config, "intermediate_size"), None, (True,) * config.num_hidden_layers)


def _positive(architecture: str, field: str, value: Any, required: bool = False) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        refuse(architecture, field, value, "must be a positive number" + ("" if required else " or null"))


@dataclass(frozen=True)
class Architecture:
    """One architecture's features (module doc); `name` is config.json's `architectures`."""

    name: str
    qkv_bias_field: str | None = "attention_bias"  # None: `qkv_bias_default` always
    qkv_bias_default: bool = False
    qk_norm: bool = False
    partial_rotary: bool = False
    norm: type[RMSNorm] = RMSNorm
    sandwich_norms: bool = False
    embed_scale: bool = False
    attention_scale_field: str | None = None
    activation_field: str = "hidden_act"
    attention_softcap: bool = False
    final_softcap: bool = False
    rope_per_layer_type: bool = False
    multipliers: bool = False
    nope_field: str | None = None
    windows: Callable[[str, Any], list[int | None]] = full_attention
    moe: Callable[[str, Any], MoeSpec] | None = None
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @property
    def gemma(self) -> bool:
        """Whether the config has Gemma's fields (query_pre_attn_scalar, soft-caps, ...)."""
        return self.attention_scale_field is not None

    def qkv_bias(self, config: Any) -> bool:
        if self.qkv_bias_field is None:
            return self.qkv_bias_default
        return bool(getattr(config, self.qkv_bias_field, self.qkv_bias_default))

    def attention_windows(self, config: Any) -> list[int | None]:
        """Each layer's sliding window (None: full attention), or ValueError naming the
        architecture and the config field llmd cannot honour."""
        return self.windows(self.name, config)

    def moe_spec(self, config: Any) -> MoeSpec | None:
        return None if self.moe is None else self.moe(self.name, config)

    def activation(self, config: Any) -> str:
        return getattr(config, self.activation_field, "silu" if self.activation_field == "hidden_act" else None)

    def rope_keys(self, config: Any) -> list[str | None]:
        """Each layer's rope_parameters key (None: the one flat dict; NOPE: no rotary)."""
        if self.rope_per_layer_type:
            keys = list(getattr(config, "layer_types", None) or [])
        else:
            keys = [None] * config.num_hidden_layers
        if self.nope_field is None:
            return keys
        return [key if rotates else NOPE for key, rotates in zip(keys, self._rotating_layers(config))]

    def _rotating_layers(self, config: Any) -> list[bool]:
        """Which layers rotate q/k: the config's `nope_field` list (1 / 0 per layer), as
        transformers' SmolLM3Config derives it where absent (every `no_rope_layer_interval`-th
        layer does not)."""
        n, field = config.num_hidden_layers, self.nope_field
        flags = getattr(config, field, None)
        if flags is None:
            interval = getattr(config, "no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if not isinstance(flags, (list, tuple)) or len(flags) != n or any(f not in (0, 1) for f in flags):
            refuse(self.name, field, flags, f"must list 1 (rotary) or 0 (none) for each of the {n} layers")
        return [bool(f) for f in flags]

    def check_config(self, config: Any) -> None:
        """ValueError naming the architecture and the field if the config asks for what
        this architecture does not run as transformers' does (config_checks); else None."""
        name = self.name
        head_dim = check_heads(name, config)
        check_activation(name, self.activation_field, self.activation(config))
        rotating = [key for key in self.rope_keys(config) if key != NOPE]
        check_rope(name, config, head_dim, self.partial_rotary, layer_types=rotating or [None])
        if self.gemma:
            self._check_gemma(config)
        else:
            check_unread(name, config, GEMMA_FIELDS)
        self.attention_windows(config)
        self.moe_spec(config)
        if self.multipliers:
            for field in GRANITE_MULTIPLIERS:
                _positive(name, field, getattr(config, field, None), required=True)
            if head_dim != config.hidden_size // config.num_attention_heads:  # transformers' Granite derives it
                refuse(name, "head_dim", head_dim, "differs from hidden_size / num_attention_heads, which "
                       "transformers' Granite uses")

    def _check_gemma(self, config: Any) -> None:
        name = self.name
        layer_types = set(getattr(config, "layer_types", None) or [])
        if not self.rope_per_layer_type and set(getattr(config, "rope_parameters", None) or {}) & layer_types:
            refuse(name, "rope_parameters", config.rope_parameters,
                   "nests parameters per layer type, which transformers' Gemma 2 does not read")
        if getattr(config, "use_bidirectional_attention", None):
            refuse(name, "use_bidirectional_attention", config.use_bidirectional_attention,
                   "asks for attention in both directions; llmd runs causal decoders only")
        _positive(name, self.attention_scale_field, getattr(config, self.attention_scale_field, None),
                  required=True)
        _positive(name, "final_logit_softcapping", getattr(config, "final_logit_softcapping", None))
        cap = getattr(config, "attn_logit_softcapping", None)
        if self.attention_softcap:
            _positive(name, "attn_logit_softcapping", cap)
        elif cap is not None:
            refuse(name, "attn_logit_softcapping", cap, "is not applied by transformers' model of this "
                   "architecture (its attention never passes it); llmd refuses rather than guess")


_GEMMA = dict(norm=GemmaRMSNorm, sandwich_norms=True, embed_scale=True, attention_scale_field="query_pre_attn_scalar",
              activation_field="hidden_activation", final_softcap=True, windows=declared_layer_types)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM"),
    Architecture("MistralForCausalLM", windows=one_window),
    Architecture("Qwen2ForCausalLM", qkv_bias_field=None, qkv_bias_default=True, windows=qwen2_layer_types),
    Architecture("Qwen3ForCausalLM", qk_norm=True, windows=qwen2_layer_types),
    # Phi-3/4: the checkpoint stores q/k/v and gate/up fused in llmd's own layout; longrope
    # and partial rotary are rotary.py's.
    Architecture("Phi3ForCausalLM", partial_rotary=True, windows=one_window),
    Architecture("Gemma2ForCausalLM", attention_softcap=True, **_GEMMA),
    Architecture("Gemma3ForCausalLM", qk_norm=True, rope_per_layer_type=True, **_GEMMA),
    # Qwen3-MoE: Qwen3's attention; one window on every layer when use_sliding_window set
    # config.sliding_window, as transformers' Qwen3-MoE builds one mask for all layers.
    Architecture("Qwen3MoeForCausalLM", qk_norm=True, windows=one_window, moe=qwen_experts(False)),
    # Qwen2-MoE: Qwen2's attention with q/k/v bias from `qkv_bias` (o_proj has none).
    Architecture("Qwen2MoeForCausalLM", qkv_bias_field="qkv_bias", qkv_bias_default=True,
                 windows=qwen2_layer_types, moe=qwen_experts(True)),
    # Granite: Llama's layers with four multipliers (module doc).
    Architecture("GraniteForCausalLM", multipliers=True),
    # SmolLM3: Llama's layers, every fourth without rotary (its config's no_rope_layers).
    Architecture("SmolLM3ForCausalLM", nope_field="no_rope_layers", windows=smollm3_windows),
    Architecture("MixtralForCausalLM", windows=one_window, moe=mixtral_experts,
                 expert_projections=("w1", "w3", "w2"), checkpoint_renames=((".block_sparse_moe.", ".mlp."),)),
)}

# Architectures that are close to one llmd runs but are not it, with what to do instead.
NOT_RUN: dict[str, str] = {
    "Gemma3ForConditionalGeneration": (
        "is Gemma 3's multimodal model (a vision tower and projector beside the text decoder); llmd runs "
        "Gemma 3's text model, Gemma3ForCausalLM (checkpoints such as gemma-3-1b and gemma-3-270m)"),
}


def get_architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        if name in NOT_RUN:
            raise ValueError(f"architecture {name!r} {NOT_RUN[name]}") from None
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture {name!r} (supported: {supported})") from None
