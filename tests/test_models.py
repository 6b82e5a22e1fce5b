"""Our model code over the paged KV cache gives HF transformers' logits, for each
architecture and RoPE scaling variant, whether the sequence is computed as one prefill,
as chunks over a cached prefix, or token by token (decode) through scattered blocks."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from llmd.gpu.layers.attention import AttentionMetadata, new_kv_cache
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.models.loader import load_model

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
VARIANTS = {
    "llama": (LlamaConfig, {}),
    "llama-linear": (LlamaConfig, {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama3": (LlamaConfig, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 32}}),
    "llama-mha-bias": (LlamaConfig, {"num_key_value_heads": 4, "attention_bias": True}),
    "qwen2": (Qwen2Config, {}),
    "qwen2-yarn": (Qwen2Config, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64}}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),
}
ARCH = {LlamaConfig: "LlamaForCausalLM", Qwen2Config: "Qwen2ForCausalLM", Qwen3Config: "Qwen3ForCausalLM"}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_hf_through_the_paged_cache(name, tmp_path):
    cls, extra = VARIANTS[name]
    torch.manual_seed(0)
    config = cls(**{**BASE, **extra})
    config.architectures = [ARCH[cls]]
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.float32, torch.device("cpu"), 256)
    tokens = torch.randint(0, 300, (44,))
    with torch.no_grad():
        reference = hf(tokens[None]).logits[0]

    bs = 16
    attn = model.layers[0].self_attn
    caches = [new_kv_cache(12, bs, attn.num_kv_heads, attn.head_dim, torch.float32, torch.device("cpu"))
              for _ in model.layers]
    blocks = torch.tensor([9, 2, 7])  # deliberately out of order

    def run(start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        slots = blocks[pos // bs] * bs + pos % bs
        table = blocks[:(end + bs - 1) // bs]
        if end - start == 1:
            md = AttentionMetadata(slots, 1, table[None], torch.tensor([end]), [])
        else:
            md = AttentionMetadata(slots, 0, None, None, [(0, end - start, start, table)])
        metadata_builder(model, bs, md.slot_mapping.device).build(md)
        with torch.no_grad():
            return model.compute_logits(model(tokens[start:end], pos, caches, md))

    # A 20-token prefill, a 14-token chunk over that cached prefix, then 10 decode steps.
    got = torch.cat([run(0, 20), run(20, 34)] + [run(t, t + 1) for t in range(34, 44)])
    assert (got - reference).abs().max().item() < 2e-5


def test_wrong_checkpoint_fails_loudly(tmp_path):
    config = LlamaConfig(**BASE)
    config.architectures = ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    bigger = LlamaConfig(**{**BASE, "intermediate_size": 256})
    bigger.architectures = ["LlamaForCausalLM"]
    bigger.save_pretrained(tmp_path)  # config no longer matches the weights
    with pytest.raises(ValueError, match="expected"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), 256)
