"""GGUF files for tests, written the way llama.cpp's convert_hf_to_gguf.py writes them
(metadata keys, tensor names, q/k rows permuted for llama's rotary layout, norms kept in
F32) from a random-weight HF fixture directory, with gguf.GGUFWriter. A mixture of experts
(qwen2_moe, qwen3_moe, mixtral: GGUF architectures qwen2moe, qwen3moe and llama) gets
the converter's layout: each layer's experts' gate, up and down projections stacked into
one 3-D tensor each (`ffn_gate_exps` [experts, inter, hidden]), the router
`ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` and its gate
`ffn_gate_inp_shexp` (a vector, [hidden], as llama.cpp reads it); routers and that gate
stay F32, as llama.cpp's quantizer leaves them. Gemma 2 (gemma2) gets what the converter's
Gemma2Model writes: the window and both soft-caps, no rope base, each norm stored as
1 + w under llama.cpp's names (`post_attention_norm`, `ffn_norm` for the pre-feed-forward
one, `post_ffw_norm`).

`write_gguf(hf_dir, out, qtype)` quantizes every 2-D weight whose rows fit the type's
block with gguf.quants.quantize (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). The gguf
package cannot quantize the K-quants (nor IQ4_NL); `k_quant_types=` writes those tensors
from random blocks instead (scaled to the fixture's weight size), so a test can check what llmd
loads from them against an independent dequantizer.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from llmd_tools.gguf_blocks import SCALE_OFFSETS

_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # Phi-3's fused projections (gate first in gate_up), as the converter names them
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
# Gemma 2's four norms per layer (llama.cpp's names for them), stored as 1 + w (module doc)
_BLOCK_GEMMA = {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_BLOCK_MOE = {
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "block_sparse_moe.gate": "ffn_gate_inp",
}
# checkpoint name of an expert's projection -> (its GGUF stacked tensor, the expert)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                   "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
# HF model_type -> GGUF architecture, where they differ
GGUF_ARCHS = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# the GGUF architectures whose converter (LlamaModel's) writes q/k rows in llama.cpp's rotary order
LLAMA_ROTARY = ("llama", "smollm3", "granite")
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# Byte offsets of the fp16 scales in one block of each K-quant (and of IQ4_NL / IQ4_XS, which the
# gguf package cannot quantize either): every value of a block is linear in them.
K_QUANT_SCALES = {getattr(T, q): SCALE_OFFSETS[q] for q in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")} | {
    T.IQ4_XS: (0,)}  # IQ4_XS has no kernel of its own (not in SCALE_OFFSETS): its d leads the super-block


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight|bias
    module = ".".join(parts[3:-1])
    if module in _EXPERT_TENSORS.values():  # stacked already (_stacked_experts)
        return f"blk.{parts[2]}.{module}.{parts[-1]}"
    names = {**_BLOCK, **_BLOCK_GEMMA} if arch == "gemma2" else _BLOCK
    return f"blk.{parts[2]}.{names.get(module) or _BLOCK_MOE[module]}.{parts[-1]}"


def permute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's half-split rotary rows to interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant(rows: int, cols: int, qtype: T, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` (bytes shaped [rows, cols/256*block bytes]) whose values
    have about `std`. IQ4_XS' d is a power of two: its sub-block scales d * (ls - 32) are
    then fp16 values, and the IQ4_NL blocks llmd holds them in carry the file's weights
    exactly (gguf_formats.HELD_AS)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    values = gguf.quants.dequantize(raw, qtype)
    scale = 1e-3 * std / float(values.std())
    if qtype == T.IQ4_XS:
        scale = 2.0 ** round(np.log2(scale))
    for offset in K_QUANT_SCALES[qtype]:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def gguf_with(path: Path, arch: str, metadata: dict[str, tuple], tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF of architecture `arch` holding just `metadata` {key: (value, GGUFValueType)}
    and `tensors` (typed as their numpy dtype: float32 F32, float16 F16)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in metadata.items():
        w.add_key_value(key, value, vtype)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    return written(w, path)


def written(w: gguf.GGUFWriter, path: Path) -> Path:
    """Header, metadata and tensors of `w` written to its file, closed: `path`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gguf(hf_dir: Path, out: Path, qtype: T = T.F32, *, k_quant_types: tuple[T, ...] = (),
               extra_metadata: dict[str, tuple] | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
               raw_tensors: dict[str, tuple[np.ndarray, T]] | None = None, seed: int = 0,
               split_max_tensors: int = 0, small_first_shard: bool = False) -> Path:
    """A GGUF of the HF fixture at `hf_dir` (llama, qwen2, qwen3 or a mixture of experts:
    module doc). With k_quant_types, the layer weights (an expert tensor as one) cycle
    through those types (random blocks, see random_k_quant)
    instead of quantizing the fixture's weights. `extra_metadata` {key: (value,
    GGUFValueType)} adds keys or replaces the converter's; `extra_tensors` adds tensors;
    `raw_tensors` {gguf name: (bytes, type)} replaces tensors with raw data.
    `split_max_tensors` > 0 writes shards of that many tensors as llama.cpp's converter's
    `--split-max-tensors` does (gguf-py's writer: `<stem>-00001-of-0000N.gguf`, ...; with
    `small_first_shard` the first holds the metadata alone) and returns the first's path."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCHS.get(cfg["model_type"], cfg["model_type"])
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    V = gguf.GGUFValueType
    metadata: dict[str, tuple] = {
        f"{arch}.context_length": (cfg["max_position_embeddings"], V.UINT32),
        f"{arch}.embedding_length": (hidden, V.UINT32),
        f"{arch}.block_count": (cfg["num_hidden_layers"], V.UINT32),
        f"{arch}.feed_forward_length": (cfg["intermediate_size"], V.UINT32),
        f"{arch}.attention.head_count": (heads, V.UINT32),
        f"{arch}.attention.head_count_kv": (kv_heads, V.UINT32),
        f"{arch}.rope.freq_base": (float(cfg["rope_parameters"]["rope_theta"]), V.FLOAT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (float(cfg["rms_norm_eps"]), V.FLOAT32),
        f"{arch}.vocab_size": (cfg["vocab_size"], V.UINT32),
    }
    if arch in LLAMA_ROTARY:
        metadata[f"{arch}.rope.dimension_count"] = (head_dim, V.UINT32)
    if arch == "granite":  # what the converter's GraniteModel writes beside llama's keys
        for key, field in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                           ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            metadata[f"{arch}.{key}"] = (float(cfg[field]), V.FLOAT32)
    if arch == "gemma2":  # what the converter's Gemma2Model writes beside the common keys
        metadata.pop(f"{arch}.rope.freq_base")  # (not written: llama.cpp's default, 10000)
        metadata[f"{arch}.attention.sliding_window"] = (cfg["sliding_window"], V.UINT32)
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            metadata[f"{arch}.{cap}"] = (float(cfg[cap]), V.FLOAT32)
    rope_tensors = _phi3_rope(cfg, metadata) if arch == "phi3" else {}
    metadata.update(_moe_metadata(cfg, arch))
    if head_dim != hidden // heads:
        metadata[f"{arch}.attention.key_length"] = (head_dim, V.UINT32)
        metadata[f"{arch}.attention.value_length"] = (head_dim, V.UINT32)
    metadata.update(extra_metadata or {})
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors, small_first_shard=small_first_shard)
    w.add_name(f"llmd test fixture {hf_dir.name}")
    for key, (value, vtype) in metadata.items():
        w.add_key_value(key, value, vtype)
    _add_tokenizer(w, hf_dir, cfg)

    tensors = _stacked_experts(load_file(str(hf_dir / "model.safetensors")))
    rng = np.random.default_rng(seed)
    k_cycle = 0
    for hf_name, array in tensors.items():
        if cfg.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        array = np.asarray(array, dtype=np.float32)
        if arch in LLAMA_ROTARY and ".q_proj." in hf_name:
            array = permute_rotary_rows(array, heads)
        elif arch in LLAMA_ROTARY and ".k_proj." in hf_name:
            array = permute_rotary_rows(array, kv_heads)
        name = gguf_name(hf_name, arch)
        if arch == "gemma2" and hf_name.endswith("norm.weight"):
            array = array + 1  # Gemma's norms multiply by 1 + w; llama.cpp's by the weight
        if hf_name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)
        if name in (raw_tensors or {}):
            data, raw_type = raw_tensors[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
        elif array.ndim in (2, 3) and k_quant_types and hf_name.startswith("model.layers."):
            kq = k_quant_types[k_cycle % len(k_quant_types)]
            k_cycle += 1
            rows = random_k_quant(int(np.prod(array.shape[:-1])), array.shape[-1], kq, float(array.std()), rng)
            w.add_tensor(name, rows.reshape(*array.shape[:-1], -1), raw_dtype=kq)
        elif array.ndim in (2, 3) and qtype != T.F32 and array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 \
                and not _kept_f32(hf_name):
            data = quantize(array, qtype)
            w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        else:  # norms, and rows no block of qtype fits (llama.cpp falls back the same way)
            w.add_tensor(name, array)
    for name, array in {**rope_tensors, **(extra_tensors or {})}.items():
        w.add_tensor(name, array)
    first = w.format_shard_names(Path(out))[0]
    written(w, out)
    return first


def _phi3_rope(cfg: dict, metadata: dict[str, tuple]) -> dict[str, np.ndarray]:
    """What the converter's Phi3MiniModel writes of a Phi-3 config's rotation: the rotated
    dimensions, the original context, the window (0: none) and, for longrope, the factor
    tensors and the attention factor it computes; returns the tensors."""
    V, rope = gguf.GGUFValueType, cfg["rope_parameters"]
    original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    rotated = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // cfg["num_attention_heads"]
    metadata.update({"phi3.rope.dimension_count": (rotated, V.UINT32),
                     "phi3.rope.scaling.original_context_length": (original, V.UINT32),
                     "phi3.attention.sliding_window": (cfg.get("sliding_window") or 0, V.UINT32)})
    if not rope.get("long_factor"):
        return {}
    scale = cfg["max_position_embeddings"] / original
    metadata["phi3.rope.scaling.attn_factor"] = (
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0, V.FLOAT32)
    return {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}


def _kept_f32(hf_name: str) -> bool:
    """A router or shared-expert gate: llama.cpp's quantizer leaves them F32."""
    return hf_name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight"))


def _moe_metadata(cfg: dict, arch: str) -> dict[str, tuple]:
    """The expert counts and sizes llama.cpp's converter writes."""
    V = gguf.GGUFValueType
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return {}
    out = {f"{arch}.expert_count": (experts, V.UINT32),
           f"{arch}.expert_used_count": (cfg["num_experts_per_tok"], V.UINT32)}
    if cfg.get("moe_intermediate_size"):
        out[f"{arch}.expert_feed_forward_length"] = (cfg["moe_intermediate_size"], V.UINT32)
    if cfg.get("shared_expert_intermediate_size"):
        out[f"{arch}.expert_shared_feed_forward_length"] = (cfg["shared_expert_intermediate_size"], V.UINT32)
    return out


def _stacked_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each layer's experts' projections stacked, [experts,
    rows, cols], under a name gguf_name maps (`model.layers.N.<GGUF tensor>.weight`)."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = array
        else:
            stacks.setdefault(f"model.layers.{m[1]}.{_EXPERT_TENSORS[m[3]]}.weight", {})[int(m[2])] = array
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    """The fixture's byte-level BPE as llama.cpp stores one ("gpt2"): tokens by id,
    control tokens marked, merges as "a b" strings, the chat template."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "tokenizer ids must be dense"
    assert len(by_id) == cfg["vocab_size"], "write_gguf needs a fixture without vocab padding"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in by_id])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in by_id])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    if "<|im_end|>" in special:
        w.add_eot_token_id(special["<|im_end|>"])
    w.add_add_bos_token(False)
    template = hf_dir / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())
