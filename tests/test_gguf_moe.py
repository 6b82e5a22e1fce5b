"""GGUF mixtures of experts (qwen2moe, qwen3moe, llama with experts: Mixtral) with their
experts kept packed on CPU (mlp.ExpertWeights, one GGUFMatmul per expert projection).

Fixtures: make_model's MoE models (8 experts, 2 per token) written as llama.cpp's
converter writes them (gguf_fixtures: each layer's experts stacked into 3-D
`ffn_{gate,up,down}_exps` tensors, routers F32). References:
- transformers reading the same GGUF (its own qwen2moe / qwen3moe reader, its own
  dequantizer): greedy tokens and top-5 logprobs, Q8_0, Q4_0 and K-quant experts (gate,
  up and down in different types, as llama.cpp's mixes give them);
- Mixtral (transformers reads no llama GGUF with experts): transformers on the HF
  fixture whose weights were quantized and dequantized by the gguf package, as the file
  holds them;
- the same file loaded dequantized (dequantize=True): the packed model computes the same
  logits in a fraction of the memory.
A GGUF whose experts cannot stay packed (a device with no packed MoE kernel; experts in
a dense architecture) is refused naming the tensor or key; TP=2 keeps each rank's share
packed. On CUDA the experts run through the grouped kernel (test_triton_quant_moe.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file, save_file

from gguf_fixtures import write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from llmd import LLM, SamplingParams
from llmd.gpu.layers.linear import ReplicatedLinear
from llmd.gpu.layers.mlp import ExpertWeights
from llmd.gpu.models.decoder import CausalLM
from llmd.gpu.models.gguf_loader import gguf_tensor_types
from llmd.gpu.models.loader import load_hf_config, load_model
from llmd.gpu.models.weight_plan import packed_params
from llmd.gpu.worker.memory_profile import weight_storage
from llmd_tools.make_model import build_model
from test_gguf_packed import _logits, _packed, _weight_bytes
from tiny_models import tiny_models

CPU = torch.device("cpu")
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=128, max_model_len=256)
PROMPTS = ([5, 17, 300, 42, 9, 77, 1000, 3, 64, 128, 256, 12], [900, 14, 15, 16, 500, 2, 7])
# HF fixtures: expert rows a whole number of Q8_0's / Q4_0's 32-weight blocks, or of a
# K-quant's 256. transformers' GGUF reader ignores the files' expert sizes
# (expert_feed_forward_length, expert_shared_feed_forward_length) and its qwen3 reader
# takes head_dim 128: the Qwen fixtures have its configs' defaults (Qwen2-MoE's experts
# 1408 wide, its shared expert 5632; Qwen3-MoE's experts 768)
FIXTURES = {
    "qwen2-moe": dict(arch="qwen2_moe", pad_vocab=False, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632),
    "qwen3-moe": dict(arch="qwen3_moe", head_dim=128, moe_intermediate_size=768),
    "qwen3-moe-256": dict(arch="qwen3_moe", head_dim=128, hidden_size=256, moe_intermediate_size=768,
                          num_hidden_layers=2),
    "mixtral": dict(arch="mixtral", llama3_rope=False, intermediate_size=32),
}


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("gguf-moe-hf"), FIXTURES)


def _experts(model) -> list[ExpertWeights]:
    return [m for m in model.modules() if isinstance(m, ExpertWeights)]


def _compare(reference_path: str, gguf_path: Path) -> None:
    llm = LLM(model=str(gguf_path), **SETTINGS)
    for i, (prompt, out) in enumerate(zip(PROMPTS, llm.generate([list(p) for p in PROMPTS], GREEDY))):
        compared = check_logprobs_close(hf_greedy(reference_path, list(prompt), MAX_TOKENS), engine_result(out),
                                        f"{gguf_path.name} #{i}")
        assert compared >= MAX_TOKENS // 2, f"{gguf_path.name} #{i}: diverged at token {compared}"


TP_CASES = [("qwen2-moe", T.Q8_0, ()), ("qwen3-moe-256", T.F32, (T.Q4_K, T.Q6_K))]
CASES = [("qwen2-moe", T.Q8_0, ()), ("qwen3-moe", T.Q4_0, ()), ("qwen3-moe-256", T.F32, (T.Q4_K, T.Q6_K, T.Q5_K))]


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("name,qtype,k_quants", CASES, ids=[c[0] + "-" + (c[1].name if not c[2] else "kquants")
                                                            for c in CASES])
def test_a_moe_gguf_stays_packed_and_matches_transformers_reading_it(hf_moe, tmp_path, name, qtype, k_quants):
    path = write_gguf(hf_moe(name), tmp_path / f"{name}.gguf", qtype, k_quant_types=k_quants)
    exps = [t for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")]
    assert exps and all(len(t.shape) == 3 for t in exps)
    assert {t.tensor_type for t in exps} == (set(k_quants) if k_quants else {qtype})
    model = load_model(path, torch.float32, CPU, 128)
    experts = _experts(model)
    assert len(experts) == len(model.layers) and all(e.quant is not None for e in experts)
    if k_quants:  # gate, up and down of a layer in different types: each part kept in its own
        assert any(len(set(e.packed_types["w13"])) == 2 for e in experts)
    _compare(str(path), path)


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("name,qtype,k_quants", TP_CASES, ids=[c[0] for c in TP_CASES])
def test_tp2_ranks_keep_their_experts_shares_packed(hf_moe, tmp_path, name, qtype, k_quants):
    """TP=2 over a MoE GGUF: each rank keeps its share of every expert packed (gate/up
    rows, down's columns as whole blocks; the shared expert as a dense MLP's) and computes
    what transformers does reading the file; the ranks' packed bytes add up to one rank's
    model's. Experts 768 wide in K-quants (Qwen3-30B-A3B's): shares of whole 256-weight
    blocks, 512 and 256 (tp.split_share), where equal ones would cut a block."""
    path = write_gguf(hf_moe(name), tmp_path / f"{name}.gguf", qtype, k_quant_types=k_quants)
    model = load_model(path, torch.float32, CPU, 128)
    whole = weight_storage(model)
    replicated: dict[str, int] = {}  # a router the fixture's K-quants packed: whole on each rank
    for m in model.modules():
        if isinstance(m, ReplicatedLinear) and m.quant is not None:
            replicated[m.quant] = replicated.get(m.quant, 0) + m.weight.numel()
    if k_quants:
        ranks = [load_model(path, torch.float32, CPU, 128, tp_rank=r, tp_size=2) for r in range(2)]
        assert [_experts(m)[0].share for m in ranks] == [(0, 512), (512, 768)]
        from llmd.pool.estimate import read_shape

        shape = read_shape(str(path))  # the pool's estimate counts the first rank's larger share
        assert shape.split_widths == ((768, 256),) and shape.largest_share(2) == 512 / 768
        assert shape.largest_share(4) == 1 / 4  # refused at load (a rank with no block): no share counted
    llm = LLM(model=str(path), tensor_parallel_size=2, **SETTINGS)
    try:
        for i, (prompt, out) in enumerate(zip(PROMPTS, llm.generate([list(p) for p in PROMPTS], GREEDY))):
            compared = check_logprobs_close(hf_greedy(str(path), list(prompt), MAX_TOKENS), engine_result(out),
                                            f"tp=2 #{i}")
            assert compared >= MAX_TOKENS // 2, f"tp=2 #{i}: diverged at token {compared}"
        shares = llm.engine.executor.weight_bytes()
    finally:
        llm.engine.shutdown()
    packed = {kind for kind in whole if kind[:1] == "Q"}
    assert packed and all(whole[kind] + replicated.get(kind, 0) == shares[kind] for kind in packed), (whole, shares)


def _requantized_hf_dir(hf_dir: Path, out: Path, qtype: T) -> Path:
    """A copy of the HF fixture whose weights are what a GGUF of type `qtype` holds
    (gguf_fixtures.write_gguf's choices: 2-D weights whose rows its blocks fit, routers
    kept), quantized and dequantized by the gguf package."""
    shutil.copytree(hf_dir, out)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    tensors = {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        w = np.asarray(w, dtype=np.float32)
        if w.ndim == 2 and w.shape[1] % block == 0 and not name.endswith("block_sparse_moe.gate.weight"):
            w = dequantize(quantize(w, qtype), qtype).reshape(w.shape).astype(np.float32)
        tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.usefixtures("float32_products")
def test_a_mixtral_gguf_matches_transformers_on_the_weights_it_holds(hf_moe, tmp_path):
    hf_dir = hf_moe("mixtral")
    path = write_gguf(hf_dir, tmp_path / "mixtral.gguf", T.Q4_0)
    config = load_hf_config(path)
    assert config.architectures == ["MixtralForCausalLM"] and config.num_local_experts == 8
    assert _experts(load_model(path, torch.float32, CPU, 128))[0].quant == "Q4_0"
    _compare(str(_requantized_hf_dir(hf_dir, tmp_path / "mixtral-q4_0", T.Q4_0)), path)


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("name,qtype", [("qwen2-moe", T.Q4_0), ("mixtral", T.Q8_0)])
def test_packed_experts_compute_what_the_dequantized_file_does(hf_moe, tmp_path, name, qtype):
    path = write_gguf(hf_moe(name), tmp_path / f"{name}.gguf", qtype)
    packed = load_model(path, torch.float32, CPU, 128)
    dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
    assert _packed(dense) == {} and all(e.quant == qtype.name for e in _experts(packed))
    storage = weight_storage(packed)
    experts = sum(e.w13.nbytes + e.w2.nbytes for e in _experts(packed))
    assert storage[qtype.name] >= experts  # counted as the packed type, not as uint8
    # the model pool's estimate from the file's header is what the model holds
    from llmd.config import EngineConfig
    from llmd.pool.estimate import estimate_need, read_shape

    held = sum(storage.values()) - sum(b.untyped_storage().nbytes() for b in packed.buffers())
    engine = EngineConfig(model=str(path), kv_cache_memory_bytes=1)
    assert estimate_need(engine, read_shape(str(path)), "cpu", available_ram=0) == {"cpu": held + 1}
    assert _weight_bytes(packed) < _weight_bytes(dense) / 2.5
    tokens = [1, 7, 42, 99, 3, 250, 17, 8, 8, 64, 500, 12, 13, 900, 4, 4, 33]
    torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), atol=2e-4, rtol=1e-4)
    # decode-sized batches too (the kernels' few-row paths): one token, then three
    for n in (1, 3):
        torch.testing.assert_close(_logits(packed, tokens[:n]), _logits(dense, tokens[:n]), atol=2e-4, rtol=1e-4)


def test_experts_that_cannot_stay_packed_are_refused_by_name(hf_moe, tmp_path):
    """On CUDA the plan keeps the experts packed as on CPU (the grouped kernel:
    test_triton_quant_moe.py); on a device with no packed MoE kernel it names the expert
    tensor and the way out; an old converter's tensor per expert is refused naming it; a
    dense architecture's file with an expert count is refused naming the key."""
    path = write_gguf(hf_moe("qwen3-moe"), tmp_path / "qwen3-moe.gguf", T.Q8_0)
    config = load_hf_config(path)
    with torch.device("meta"):
        model = CausalLM(config, 128, 0, 1, device=CPU)
    types = gguf_tensor_types(path)
    assert types["model.layers.0.mlp.experts.7.up_proj.weight"] == ("blk.0.ffn_up_exps.weight", "Q8_0")
    for device in ("cpu", "cuda"):
        assert packed_params(model, types, device)["layers.0.mlp.experts.w13"] == "Q8_0"
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.0.ffn_(gate|up|down)_exps.weight' of type Q8_0 cannot "
                                         r"stay packed: llmd keeps a GGUF's experts packed on CPU and CUDA only "
                                         r"\(no packed MoE kernel for mps\); dequantize=True \(--dequantize\)"):
        packed_params(model, types, "mps")
    old = write_gguf(hf_moe("mixtral"), tmp_path / "old-mixtral.gguf", T.Q8_0,
                     extra_tensors={"blk.0.ffn_gate.0.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.0.ffn_gate.0.weight' has no counterpart in llmd's "
                                         r"llama model \(MixtralForCausalLM\)"):
        load_hf_config(old)  # an old converter's tensor per expert
    V = gguf.GGUFValueType
    dense_hf = build_model(tmp_path / "qwen3", "qwen3", "tiny", head_dim=128, intermediate_size=192)
    for key in ("expert_count", "expert_used_count"):
        bad = write_gguf(dense_hf, tmp_path / f"qwen3-{key}.gguf", T.Q8_0,
                         extra_metadata={f"qwen3.{key}": (8, V.UINT32)})
        with pytest.raises(ValueError, match=rf"GGUF metadata qwen3.{key}=8: mixture-of-experts models of "
                                             r"architecture 'qwen3' are not implemented"):
            load_hf_config(bad)
