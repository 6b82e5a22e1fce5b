"""The fixture models' weights ("peaked" init, tools/make_model.py's build_model): what
transformers' own init would leave near uniform, re-drawn so that greedy decoding has
clear gaps and attention is position dependent."""
from __future__ import annotations

import math

# Weight init ("peaked"). transformers' default init (std 0.02 everywhere, norm weights
# 1, zero biases) gives logits with std ~0.02*sqrt(hidden) (0.16 at hidden 64): near
# uniform, so greedy decoding is decided by gaps of ~0.01 that any change in accumulation
# order can flip. Attention is near uniform too (scores ~0.03), so outputs collapse into
# short loops; with tied embeddings the residual stream is dominated by the current
# token's embedding and the model repeats its input token forever (measured: 1-3
# distinct tokens in 64 steps). Zero biases and unit norm weights would also let an
# engine that ignores them pass its tests. So build_model re-initialises (seeded):
#   * every projection with std 1/sqrt(fan_in), so activations stay O(1) in every layer;
#     q/k scaled so attention scores have std ~sqrt(ATTN_SCORE_VAR) = 4: peaky,
#     position-dependent attention that keeps outputs from looping (for qwen3, whose q/k
#     are RMS-normalised per head, through the q_norm/k_norm weights instead);
#   * embeddings with std EMBED_STD = 0.1, small next to the O(1) layer outputs, so the
#     next token depends on the context, not only on the current token (this is what
#     keeps the tied variant from repeating one token);
#   * qwen2 q/k/v biases with std BIAS_STD (x the q/k gain); RMSNorm weights uniform in
#     [1 - NORM_JITTER, 1 + NORM_JITTER];
#   * the final norm weight times a factor giving logits of std ~TARGET_LOGIT_STD. A
#     common positive factor on all logits leaves the greedy path unchanged and widens
#     every top1-top2 gap; in units of the logit std ~2% of greedy steps have a gap
#     below ~0.007 (measured over archs, presets, tied/untied, several seeds), so std 8
#     puts the gap above 0.05 at ~98% of steps, while sampling stays non-trivial (median
#     top-1 probability ~0.7).
# Measured with greedy_stats() (4 prompts x 64 greedy steps, fp32, HF), every arch and
# preset, tied and untied: gap > 0.05 at 96-99% of steps, ~40-60 distinct tokens per
# 64-step sequence (tiny, 6 seeds x 6 variants: min 38, median 53; small, 2 seeds x 6
# variants: min 36, median 59).
# tests/test_fixtures.py checks this for the tiny fixtures.
TARGET_LOGIT_STD = 8.0
ATTN_SCORE_VAR = 16.0
EMBED_STD = 0.1
BIAS_STD = 0.2
NORM_JITTER = 0.25
ROUTER_GAIN = 2.0  # MoE router weights: std ROUTER_GAIN / sqrt(hidden)


def _peaked_init_(model, cfg, *, logit_std: float) -> float:
    """Re-initialise ``model`` in place as described at TARGET_LOGIT_STD (uses the torch
    RNG; the caller seeds it). Returns the factor applied to the final norm weight."""
    import torch

    inner = model.model
    tied = bool(cfg.tie_word_embeddings)
    qk_norm = hasattr(inner.layers[0].self_attn, "q_norm")
    qk_gain = 1.0 if qk_norm else math.sqrt(math.sqrt(ATTN_SCORE_VAR))  # on q and on k
    # Gemma's norms scale by (1 + w): the same effective scales, stored minus one.
    gemma = hasattr(inner.layers[0], "pre_feedforward_layernorm")

    def norm_(w: torch.Tensor, mul: float = 1.0) -> None:
        w.uniform_(1.0 - NORM_JITTER, 1.0 + NORM_JITTER).mul_(mul)
        if gemma:
            w.sub_(1.0)

    def linear_(weight: torch.Tensor, bias: torch.Tensor | None, gain: float) -> None:
        weight.normal_(0.0, gain / math.sqrt(weight.shape[1]))
        if bias is not None:
            bias.normal_(0.0, BIAS_STD * gain)

    # Gemma multiplies its embeddings by sqrt(hidden_size): the same EMBED_STD after that.
    embed_std = EMBED_STD / math.sqrt(cfg.hidden_size) if gemma else EMBED_STD
    emb = model.get_input_embeddings().weight
    emb.normal_(0.0, embed_std)
    head = model.get_output_embeddings().weight
    if not tied:
        head.normal_(0.0, 1.0 / math.sqrt(cfg.hidden_size))
    for layer in inner.layers:
        at, mlp = layer.self_attn, layer.mlp
        if hasattr(at, "qkv_proj"):  # Phi-3: [q | k | v] rows in one projection
            q_rows = cfg.num_attention_heads * at.head_dim
            kv_rows = cfg.num_key_value_heads * at.head_dim
            parts = at.qkv_proj.weight.split([q_rows, kv_rows, kv_rows])
            for part, gain in zip(parts, (qk_gain, qk_gain, 1.0)):
                linear_(part, None, gain)
            linear_(mlp.gate_up_proj.weight, None, 1.0)
            projections = [at.o_proj, mlp.down_proj]
        else:
            for lin, gain in ((at.q_proj, qk_gain), (at.k_proj, qk_gain), (at.v_proj, 1.0)):
                linear_(lin.weight, lin.bias, gain)
            projections = [at.o_proj]
            if hasattr(mlp, "experts"):  # a mixture-of-experts block
                projections += _moe_init_(mlp, linear_)
            else:
                projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        for lin in projections:
            linear_(lin.weight, lin.bias, 1.0)
        norm_(layer.input_layernorm.weight)
        norm_(layer.post_attention_layernorm.weight)
        if gemma:
            norm_(layer.pre_feedforward_layernorm.weight)
            norm_(layer.post_feedforward_layernorm.weight)
        if qk_norm:
            # q/k are RMS-normalised per head, so scores have std ~ w_q * w_k
            norm_(at.q_norm.weight, math.sqrt(math.sqrt(ATTN_SCORE_VAR)))
            norm_(at.k_norm.weight, math.sqrt(math.sqrt(ATTN_SCORE_VAR)))
    # normed final hidden state has RMS ~1, so logits have std ~ row_std * sqrt(hidden)
    row_std = embed_std if tied else 1.0 / math.sqrt(cfg.hidden_size)
    scale = logit_std / (row_std * math.sqrt(cfg.hidden_size))
    norm_(inner.norm.weight, scale)
    return scale


def _moe_init_(mlp, linear_) -> list:
    """Initialise a sparse MoE block's stacked experts like dense projections (std
    1/sqrt(fan_in): gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden,
    inter]) and its router with std ROUTER_GAIN/sqrt(hidden); returns the shared expert's
    projections and gate (Qwen2-MoE), for the caller to initialise as it does others."""
    experts = mlp.experts
    experts.gate_up_proj.normal_(0.0, 1.0 / math.sqrt(experts.gate_up_proj.shape[2]))
    experts.down_proj.normal_(0.0, 1.0 / math.sqrt(experts.down_proj.shape[2]))
    linear_(mlp.gate.weight, None, ROUTER_GAIN)
    shared = getattr(mlp, "shared_expert", None)
    if shared is None:
        return []
    return [shared.gate_proj, shared.up_proj, shared.down_proj, mlp.shared_expert_gate]
