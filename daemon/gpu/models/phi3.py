"""Phi-3 and Phi-4 (transformers' Phi3ForCausalLM).

Llama's decoder, with three differences that matter here:
- the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, in
  llmd's own fused layout ([q | k | v] and [gate | up] rows), so a single rank loads
  them as they are; with tensor parallelism each rank cuts its q, k and v rows (its
  gate and up rows) out of the fused tensor and joins them in the same order;
- longrope ("su") rope scaling with short and long factors, and partial rotary
  (`partial_rotary_factor`, Phi-4-mini) — both in llmd.gpu.layers.rotary, where the choice
  between the short and long factors is described;
- one sliding window on every layer when `sliding_window` is set, as Mistral.
"""
from __future__ import annotations

from typing import Any

import torch

from llmd.gpu.models.llama import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    partial_rotary = True

    def shard_checkpoint_tensor(self, name: str, sl: Any) -> torch.Tensor:
        """This rank's rows of a fused qkv_proj / gate_up_proj (weight or bias) in
        llmd's fused order; any other tensor as for Llama."""
        tp = self.tp
        if tp is None or (".qkv_proj." not in name and ".gate_up_proj." not in name):
            return super().shard_checkpoint_tensor(name, sl)
        if ".qkv_proj." in name:
            d = self.head_dim
            q_rows = self.config.num_attention_heads * d
            kv_rows = (self.config.num_key_value_heads or self.config.num_attention_heads) * d
            q_size, kv_size = tp.num_heads * d, tp.num_kv_heads * d
            kv_start = tp.kv_head_start * d
            starts_sizes = ((tp.rank * q_size, q_size), (q_rows + kv_start, kv_size),
                            (q_rows + kv_rows + kv_start, kv_size))
        else:
            full, size = self.config.intermediate_size, tp.intermediate_size
            starts_sizes = ((tp.rank * size, size), (full + tp.rank * size, size))
        return torch.cat([sl[start:start + size] for start, size in starts_sizes])
