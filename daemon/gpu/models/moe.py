"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (Qwen1.5-MoE) and Mixtral
(transformers' Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM).

Each is its dense relative with the MLP of some layers replaced by a sparse block:
attention, norms, rotary and windows are Llama's classes (Qwen3-MoE: Qwen3's q/k norms
and Mistral's one window for every layer; Qwen2-MoE: Qwen2's layer types, q/k/v bias
from `qkv_bias`; Mixtral: Mistral's). The sparse block routes each token to `top_k`
experts (llmd.gpu.layers.fused_moe: softmax over the experts, the top_k, renormalised when the
architecture does) and sums their outputs by the routing weights; Qwen2-MoE adds a
shared expert that every token runs, scaled by sigmoid(shared_expert_gate(x)). Which
layers are sparse: every layer for Mixtral; for Qwen, those not in `mlp_only_layers`
whose index + 1 is a multiple of `decoder_sparse_step` (the others have a dense MLP of
`intermediate_size`).

Tensor parallelism splits every expert's intermediate dimension across the ranks (as the
dense MLP is split): each rank holds rows [r * I / n, (r + 1) * I / n) of every expert's
gate and up projections and the matching columns of its down projection, and the same
slice of the shared expert; the router is replicated, so every rank routes every token
identically. Each rank's experts and shared expert then give a partial sum of the
layer's output, and one all-reduce per layer completes it: the same collective as the
dense MLP's. Splitting whole experts across ranks instead would need the tokens
exchanged (all-to-all) and would leave a rank idle whenever the routing favours another
rank's experts; slicing keeps every rank's work equal whatever the routing.

The checkpoint stores each expert separately (`mlp.experts.{e}.gate_proj/up_proj/
down_proj`; Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`); moe_weights copies them
into the stacked parameters `w13 [experts, 2 * inter, hidden]` and `w2 [experts,
hidden, inter]` the fused kernel reads.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmd.gpu.layers.fused_moe import fused_experts, select_experts
from llmd.gpu.layers.fused_ops import UNFUSED, LayerOps, layer_ops
from llmd.gpu.models.config_checks import refuse
from llmd.gpu.models.llama import (DecoderAttention, DecoderLayer, DecoderMLP, LlamaForCausalLM,
                                   MistralForCausalLM, Qwen2ForCausalLM)
from llmd.gpu.models.moe_weights import ExpertTensorNames, ExpertWeightLoader
from llmd.gpu.layers.norms import RMSNorm
from llmd.gpu.layers.tp import TPShape


@dataclass(frozen=True)
class MoeSpec:
    """What a config says about its experts (sizes whole, before tensor parallelism)."""

    num_experts: int
    top_k: int
    renormalize: bool  # rescale the top_k weights to sum to 1
    expert_size: int  # each expert's intermediate size
    shared_expert_size: int | None  # Qwen2-MoE's shared expert; None: none
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block (else a dense MLP)


class ExpertWeights(nn.Module):
    """Every expert's weights, stacked: w13 [experts, 2 * inter, hidden] (gate rows, then
    up rows) and w2 [experts, hidden, inter]; with TP, inter is this rank's slice."""

    def __init__(self, num_experts: int, hidden_size: int, inter: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a gated MLP on every token whose down projection is
    not reduced here (with TP its partial sum joins the experts' before the block's
    one all-reduce); act * up run by `ops`."""

    def __init__(self, hidden_size: int, inter: int, activation: str, ops: LayerOps = UNFUSED) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden_size, bias=False)
        self.activation = activation
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.activation))


class SparseMoeBlock(nn.Module):
    """Router (`gate`), experts, optional shared expert; one all-reduce under TP.
    `activation` is an ACTIVATIONS name (the model's check_config refused any other);
    `use_triton` None: the fused Triton kernel on CUDA, the reference elsewhere; `ops`
    runs the shared expert's act * up and the Triton experts'."""

    def __init__(self, hidden_size: int, spec: MoeSpec, tp: TPShape | None, activation: str,
                 ops: LayerOps = UNFUSED) -> None:
        super().__init__()
        world = 1 if tp is None else tp.world_size
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.reduce = tp is not None
        self.activation = activation
        self.ops = ops
        self.use_triton: bool | None = None
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = ExpertWeights(spec.num_experts, hidden_size, spec.expert_size // world)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_size is not None:
            self.shared_expert = SharedExpert(hidden_size, spec.shared_expert_size // world, activation, ops)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = fused_experts(x, self.experts.w13, self.experts.w2, weights, ids, self.activation, self.use_triton,
                            self.ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.reduce:
            dist.all_reduce(out)
        return out


class MoeDecoderLayer(DecoderLayer):
    """Llama's decoder layer (same forward) around the MLP it is given: a sparse block
    or, in a dense layer of a MoE model, a DecoderMLP."""

    def __init__(self, config: Any, mlp: nn.Module, qkv_bias: bool, qk_norm: bool, tp: TPShape | None,
                 attention_backend: str, sliding_window: int | None) -> None:
        nn.Module.__init__(self)
        self.ops = layer_ops(attention_backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, qkv_bias, qk_norm, tp, attention_backend, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp


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


class MoeForCausalLM(LlamaForCausalLM):
    """What the three MoE architectures share: sparse layers from `moe_spec`, expert
    weights loaded and sharded by moe_weights. Subclasses say how their config and
    checkpoint name things."""

    # Checkpoint names: the expert projection names (gate, up, down), and renames applied
    # to every checkpoint name first (Mixtral's block_sparse_moe -> mlp).
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        """How this architecture's config describes its experts; each registered
        subclass reads its own fields (this base class is never registered)."""
        raise NotImplementedError(f"{cls.__name__} does not say how its config describes its experts")

    @functools.cached_property
    def spec(self) -> MoeSpec:
        """This model's MoeSpec, read from its config once."""
        return self.moe_spec(self.config)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """The dense checks, then the expert fields (moe_spec refuses what it cannot read)."""
        super().check_config(config)
        cls.moe_spec(config)

    def layer_qkv_bias(self) -> bool:
        return self.qkv_bias or bool(getattr(self.config, "attention_bias", False))

    def make_layer(self, index: int, window: int | None, tp: TPShape | None, attention_backend: str) -> nn.Module:
        spec = self.spec
        activation = getattr(self.config, "hidden_act", "silu")
        ops = layer_ops(attention_backend)
        if spec.sparse_layers[index]:
            mlp: nn.Module = SparseMoeBlock(self.config.hidden_size, spec, tp, activation, ops)
        else:
            mlp = DecoderMLP(self.config, tp, activation, ops)
        return MoeDecoderLayer(self.config, mlp, self.layer_qkv_bias(), self.qk_norm, tp, attention_backend, window)

    @functools.cached_property
    def expert_tensor_names(self) -> ExpertTensorNames:
        spec = self.spec
        return ExpertTensorNames(self.expert_projections, self.checkpoint_renames, spec.expert_size,
                                 spec.shared_expert_size)

    def sparse_blocks(self) -> dict[int, SparseMoeBlock]:
        """Layer index -> its sparse block."""
        return {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}

    def shard_checkpoint_tensor(self, name: str, sl: Any) -> torch.Tensor:
        """Expert and shared-expert tensors cut along their intermediate dimension, the
        router and shared-expert gate whole; anything else as for the dense model."""
        if self.tp is not None:
            piece = self.expert_tensor_names.shard(name, sl, self.tp)
            if piece is not None:
                return piece
        return super().shard_checkpoint_tensor(name, sl)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Expert tensors into the stacked parameters; everything else, and then each
        completed stacked parameter, through the dense model's loader (whose check for
        missing and unexpected names then covers the experts too)."""
        super().load_weights(ExpertWeightLoader(self, self.expert_tensor_names).stream(weights))


class _QwenMoe(MoeForCausalLM):
    has_shared_expert = False

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        """transformers' rule: a layer is sparse when num_experts > 0, it is not in
        mlp_only_layers and (index + 1) % decoder_sparse_step == 0."""
        name = cls.__name__
        num_experts = _count(name, config, "num_experts", minimum=0)
        top_k = _top_k(name, config, num_experts)
        step = _count(name, config, "decoder_sparse_step", 1)
        layers = config.num_hidden_layers
        dense = getattr(config, "mlp_only_layers", None) or []
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense):
            refuse(name, "mlp_only_layers", dense, f"must list layer indices in [0, {layers})")
        shared = None
        if cls.has_shared_expert:
            shared = _count(name, config, "shared_expert_intermediate_size")
        elif getattr(config, "shared_expert_intermediate_size", None):
            refuse(name, "shared_expert_intermediate_size", config.shared_expert_intermediate_size,
                   "asks for a shared expert, which transformers' model of this architecture does not have")
        sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))
        return MoeSpec(num_experts, top_k, bool(getattr(config, "norm_topk_prob", False)),
                       _count(name, config, "moe_intermediate_size"), shared, sparse)


class Qwen3MoeForCausalLM(_QwenMoe, MistralForCausalLM):
    """Qwen3's attention (q/k norms, bias from attention_bias); one sliding window on
    every layer when use_sliding_window set config.sliding_window, as transformers'
    Qwen3-MoE builds one mask for all layers."""

    qk_norm = True


class Qwen2MoeForCausalLM(_QwenMoe, Qwen2ForCausalLM):
    """Qwen2's attention with q/k/v bias from `qkv_bias` (o_proj has none), windows from
    layer_types, a shared expert."""

    has_shared_expert = True

    def layer_qkv_bias(self) -> bool:
        return bool(getattr(self.config, "qkv_bias", True))


class MixtralForCausalLM(MoeForCausalLM, MistralForCausalLM):
    """Mistral's attention and window; every layer sparse, the top_k weights always
    renormalised, expert size `intermediate_size`."""

    expert_projections = ("w1", "w3", "w2")
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        name = cls.__name__
        num_experts = _count(name, config, "num_local_experts")
        for field in ("shared_expert_intermediate_size", "mlp_only_layers"):
            if getattr(config, field, None):
                refuse(name, field, getattr(config, field), "is not part of this architecture (transformers' "
                       "Mixtral ignores the field); llmd refuses rather than guess")
        return MoeSpec(num_experts, _top_k(name, config, num_experts), True,
                       _count(name, config, "intermediate_size"), None, (True,) * config.num_hidden_layers)
