"""What each GGUF architecture (`general.architecture`) means to llmd: the HF
architecture that runs it, the metadata keys it may carry, the HF names of its tensors,
and for Gemma 3 the config fields llama.cpp derives rather than stores.

gemma2 follows llama.cpp's reading of the file (llama_load_hparams for LLM_ARCH_GEMMA2,
and convert_hf_to_gguf.py's Gemma2Model): layers alternate, the first sliding over
`attention.sliding_window` tokens (swa pattern 2), the next global; attention logits and
the final logits soft-capped by `attn_logit_softcapping` and `final_logit_softcapping`;
attention scale 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B (46 layers); one
rope base for every layer (`rope.freq_base`, which the converter does not write: 10000);
norms stored as 1 + w, as gemma3's.

gemma3 follows llama.cpp's reading of the file (llama_load_hparams for LLM_ARCH_GEMMA3,
and convert_hf_to_gguf.py's Gemma3Model): every sixth layer global and the others
sliding over `attention.sliding_window` tokens with rope theta 10000; the global layers
take `rope.freq_base` and the rope scaling keys; attention scale 1/sqrt(head_dim), but
1/sqrt(hidden / heads) for the 27B (62 layers); norm weights stored as 1 + w (the
converter adds the 1 that Gemma's norms add at run time, since llama.cpp's norm
multiplies by the weight), so the loader subtracts it, as transformers' GGUF loader
does; `ffn_norm` is Gemma's pre-feed-forward norm.

phi3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini) holds q, k and v in one `attn_qkv` tensor and
the gated MLP's gate and up in one `ffn_up` (gate first), as the HF checkpoint's
`qkv_proj` and `gate_up_proj`; rotation may cover the first `rope.dimension_count`
dimensions of each head only (Phi-4-mini); a 128k model's longrope factors are the
`rope_factors_long` / `rope_factors_short` tensors (gguf_rope); `attention.sliding_window`
0 means none (Phi-4). It runs as the HF model it was converted from: the window on every
layer, and the rope factors chosen per position (daemon/gpu/layers/rotary.py), where
llama.cpp today drops Phi-3's window and picks one set of factors by the context size.

Mixtures of experts, as llama.cpp's converter writes them: every expert's gate, up and
down projections stacked in one 3-D tensor each (`ffn_gate_exps` [experts, inter,
hidden], `ffn_down_exps` [experts, hidden, inter]), the router `ffn_gate_inp`; every
layer sparse (a dense `ffn_gate` has no counterpart). An expert tensor's HF name holds
`{e}`: it stands for each expert's checkpoint tensor (`mlp.experts.{e}.gate_proj`), as an
HF checkpoint stores them.
- qwen2moe: Qwen2-MoE, with its shared expert (`ffn_*_shexp`, its sigmoid gate
  `ffn_gate_inp_shexp`); the top-k weights not renormalised (llama.cpp's
  llm_build_qwen2moe passes norm_w false);
- qwen3moe: Qwen3-MoE, the top-k weights renormalised (llama.cpp's qwen3moe passes
  norm_w true, whatever the HF config's norm_topk_prob was; transformers' GGUF reader
  sets it true likewise);
- llama with `expert_count` > 0: Mixtral (renormalised, as always), q/k rows permuted as
  llama's.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmd.gpu.models.llama_config import LeanLlamaConfig

# `{arch}.` keys every architecture's config is read from, and ones that change nothing
# llmd computes.
COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scale_linear",
    # harmless: a training note, and the layout a llama checkpoint had before conversion
    # (the file's q/k rows are in llama.cpp's order either way)
    "rope.scaling.finetuned", "tensor_data_layout",
    # mixture-of-experts counts: refused unless zero where the architecture has no experts
    "expert_count", "expert_used_count",
})

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
MOE_BLOCK_TENSORS = {
    **{k: v for k, v in BLOCK_TENSORS.items() if k not in DENSE_MLP},
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
QWEN2MOE_BLOCK_TENSORS = {
    **MOE_BLOCK_TENSORS,
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
MIXTRAL_BLOCK_TENSORS = {
    **{k: v for k, v in BLOCK_TENSORS.items() if k not in DENSE_MLP},
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}
PHI3_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
EXPERT = "{e}"  # in an HF name: each expert's index (module doc)
GEMMA_BLOCK_TENSORS = {
    **BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str  # the `architectures` name llmd's model registry knows
    model_type: str  # transformers' config model_type
    permuted_rotary: bool  # q/k rows in llama.cpp's pairwise rotary order
    block_tensors: Mapping[str, str] = field(default_factory=lambda: BLOCK_TENSORS)
    extra_keys: frozenset[str] = frozenset()  # `{arch}.` keys beyond COMMON_KEYS
    norm_offset: float = 0.0  # subtracted from every `*norm.weight` tensor
    # llama.cpp divides the rotary frequencies by a `rope_freqs.weight` tensor's factors
    # (gguf_rope); on the other architectures it refuses a file holding one
    reads_rope_freqs: bool = False
    # rotation of the first `rope.dimension_count` dimensions of a head only, and longrope
    # factors as tensors (phi3; gguf_rope); elsewhere refused
    partial_rotary: bool = False
    reads_longrope: bool = False
    # (metadata getter, arch, config fields so far) -> the fields this architecture adds
    config_fields: Callable[[Callable[..., Any], str, dict[str, Any]], dict[str, Any]] | None = None
    # the config's class where it is not transformers' for model_type (llama_config.py)
    config_class: type | None = None
    moe: bool = False  # experts (else `expert_count` > 0 is refused)

    @property
    def known_keys(self) -> frozenset[str]:
        return COMMON_KEYS | self.extra_keys


GEMMA2_SWA_PATTERN = 2  # llama.cpp: hparams.set_swa_pattern(2)
GEMMA2_27B_LAYERS = 46
GEMMA3_SWA_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa
GEMMA3_27B_LAYERS = 62


def _gemma_layer_types(layers: int, window: Any, pattern: int) -> list[str]:
    """llama.cpp's set_swa_pattern(pattern): of each `pattern` layers all but the last slide
    (none without a window)."""
    return ["sliding_attention" if window and (i + 1) % pattern else "full_attention" for i in range(layers)]


def _softcap(get: Callable[..., Any], key: str) -> float | None:
    cap = get(key)
    return float(cap) if cap else None


def gemma2_config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma2Config fields of a gemma2 GGUF, as llama.cpp derives them (module doc)."""
    fields.pop("hidden_act", None)
    layers, window = fields["num_hidden_layers"], get(f"{a}.attention.sliding_window")
    big = layers == GEMMA2_27B_LAYERS
    return dict(
        layer_types=_gemma_layer_types(layers, window, GEMMA2_SWA_PATTERN),
        sliding_window=int(window) if window else None,
        query_pre_attn_scalar=fields["hidden_size"] // fields["num_attention_heads"] if big else fields["head_dim"],
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=_softcap(get, f"{a}.attn_logit_softcapping"),
        final_logit_softcapping=_softcap(get, f"{a}.final_logit_softcapping"),
    )


def gemma3_config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig fields of a gemma3 GGUF, as llama.cpp derives them (module doc);
    the activation is Gemma's own (hidden_activation), not the common hidden_act."""
    fields.pop("hidden_act", None)
    layers = fields["num_hidden_layers"]
    window = get(f"{a}.attention.sliding_window")
    layer_types = _gemma_layer_types(layers, window, GEMMA3_SWA_PATTERN)
    local = {"rope_type": "default", "rope_theta": float(get(f"{a}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))}
    if layers == GEMMA3_27B_LAYERS:
        scalar = fields["hidden_size"] // fields["num_attention_heads"]
    else:
        scalar = fields["head_dim"]
    return dict(
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        rope_parameters={"full_attention": fields["rope_parameters"], "sliding_attention": local},
        query_pre_attn_scalar=scalar,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=_softcap(get, f"{a}.final_logit_softcapping"),
        attn_logit_softcapping=None,
    )


def phi3_config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Phi3Config fields of a phi3 GGUF: its window (0: none) on every layer, the context
    the rope factors were made for."""
    window = get(f"{a}.attention.sliding_window")
    original = get(f"{a}.rope.scaling.original_context_length") or fields["max_position_embeddings"]
    return dict(sliding_window=int(window) if window else None, original_max_position_embeddings=int(original))


SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp: hparams.n_no_rope_layer_step (no key in the file)


def smollm3_config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3Config fields of a smollm3 GGUF: llama.cpp leaves rotary out of every fourth
    layer (the file names none) and slides no window (the loader sets Llama's biases)."""
    layers = fields["num_hidden_layers"]
    return dict(no_rope_layers=[int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(layers)],
                use_sliding_window=False, sliding_window=None)


def granite_config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
    """GraniteConfig fields of a granite GGUF (llama.cpp's converter writes the multipliers
    as `_scale` keys; where one is absent llama.cpp multiplies by 1, and scales attention
    by 1/sqrt(head_dim))."""
    scale = get(f"{a}.attention.scale") or fields["head_dim"] ** -0.5
    return dict(attention_multiplier=float(scale), embedding_multiplier=float(get(f"{a}.embedding_scale") or 1.0),
                residual_multiplier=float(get(f"{a}.residual_scale") or 1.0),
                logits_scaling=float(get(f"{a}.logit_scale") or 1.0))


def _required_int(get: Callable[..., Any], key: str) -> int:
    value = get(key)
    if value is None:
        raise ValueError(f"GGUF metadata {key} is missing")
    return int(value)


def qwen_moe_config_fields(shared_expert: bool, renormalize: bool) -> Callable[..., dict[str, Any]]:
    """Qwen2MoeConfig / Qwen3MoeConfig fields of a qwen2moe / qwen3moe GGUF: every layer
    sparse, the top-k weights renormalised as llama.cpp does (module doc)."""
    def config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
        out = dict(num_experts=_required_int(get, f"{a}.expert_count"),
                   num_experts_per_tok=_required_int(get, f"{a}.expert_used_count"),
                   moe_intermediate_size=_required_int(get, f"{a}.expert_feed_forward_length"),
                   norm_topk_prob=renormalize, decoder_sparse_step=1, mlp_only_layers=[])
        if shared_expert:
            out["shared_expert_intermediate_size"] = _required_int(get, f"{a}.expert_shared_feed_forward_length")
        return out
    return config_fields


def mixtral_config_fields(get: Callable[..., Any], a: str, fields: dict[str, Any]) -> dict[str, Any]:
    """MixtralConfig fields of a llama GGUF with experts: each expert's size is
    `feed_forward_length` (intermediate_size already), no sliding window."""
    return dict(num_local_experts=_required_int(get, f"{a}.expert_count"),
                num_experts_per_tok=_required_int(get, f"{a}.expert_used_count"), sliding_window=None)


MIXTRAL = GGUFArchitecture("MixtralForCausalLM", "mixtral", permuted_rotary=True,
                           block_tensors=MIXTRAL_BLOCK_TENSORS, config_fields=mixtral_config_fields, moe=True)

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_rotary=True, reads_rope_freqs=True,
                              config_class=LeanLlamaConfig),
    "granite": GGUFArchitecture(
        "GraniteForCausalLM", "granite", permuted_rotary=True, config_fields=granite_config_fields,
        extra_keys=frozenset({"attention.scale", "embedding_scale", "residual_scale", "logit_scale"})),
    "smollm3": GGUFArchitecture("SmolLM3ForCausalLM", "smollm3", permuted_rotary=True,
                                config_fields=smollm3_config_fields),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", permuted_rotary=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", permuted_rotary=False),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM", "phi3", permuted_rotary=False, block_tensors=PHI3_BLOCK_TENSORS,
        extra_keys=frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
        partial_rotary=True, reads_longrope=True, config_fields=phi3_config_fields),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", "gemma2", permuted_rotary=False, block_tensors=GEMMA_BLOCK_TENSORS,
        extra_keys=frozenset({"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"}),
        norm_offset=1.0, config_fields=gemma2_config_fields),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3_text", permuted_rotary=False, block_tensors=GEMMA_BLOCK_TENSORS,
        extra_keys=frozenset({"attention.sliding_window", "rope.freq_base_swa", "final_logit_softcapping"}),
        norm_offset=1.0, config_fields=gemma3_config_fields),
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeForCausalLM", "qwen2_moe", permuted_rotary=False, block_tensors=QWEN2MOE_BLOCK_TENSORS,
        extra_keys=frozenset({"expert_feed_forward_length", "expert_shared_feed_forward_length"}),
        config_fields=qwen_moe_config_fields(shared_expert=True, renormalize=False), moe=True),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", permuted_rotary=False, block_tensors=MOE_BLOCK_TENSORS,
        extra_keys=frozenset({"expert_feed_forward_length"}),
        config_fields=qwen_moe_config_fields(shared_expert=False, renormalize=True), moe=True),
}


def gguf_architecture(arch: str, expert_count: int) -> GGUFArchitecture | None:
    """What a file of `general.architecture` `arch` with `{arch}.expert_count` experts
    runs as (None: not implemented): llama with experts is Mixtral."""
    if arch == "llama" and expert_count:
        return MIXTRAL
    return ARCHITECTURES.get(arch)
