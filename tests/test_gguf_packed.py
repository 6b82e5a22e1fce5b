"""GGUF weights kept packed (gguf_quant, cpu/cpu_quant.cpp): Q8_0, Q4_0 and Q4_1.

Each format's dequantization equals the gguf package's (an independent reader of the
same bytes); the packed matmul, through the C++ kernel (decode rows) and the
dequantized-slice GEMM (more rows), equals x times the dequantized weight; a GGUF
model loaded packed computes what the same file dequantized at load computes, in a
fraction of the memory, and (tests/test_gguf.py) matches transformers reading the file.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from gguf_fixtures import write_gguf
from llmd import LLM
from llmd.gpu.layers.attention import AttentionMetadata, new_model_kv_caches
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.layers.gguf_quant import KERNEL_MAX_ROWS, PACKED_TYPES, TYPE_CODES, GGUFMatmul, dequantize
from llmd.gpu.layers.linear import ReplicatedLinear
from llmd.gpu.models.loader import load_model
from test_gguf import SETTINGS, hf_dirs  # noqa: F401

CPU = torch.device("cpu")


def packed_rows(weights: np.ndarray, quant: str) -> torch.Tensor:
    return torch.from_numpy(quantize(weights, getattr(T, quant)).reshape(weights.shape[0], -1).copy())


def sample_weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights with a few blocks of extremes: all equal, one large value, zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0, :32] = 0.0
    w[1, 32:64] = 0.7
    w[2, 5] = 40.0
    return w


@pytest.mark.parametrize("quant", PACKED_TYPES)
def test_dequantize_equals_the_gguf_package(quant):
    w = sample_weights(96, 256)
    blocks = packed_rows(w, quant)
    expected = gguf.quants.dequantize(blocks.numpy(), getattr(T, quant)).reshape(w.shape)
    assert torch.equal(dequantize(blocks, quant, 256), torch.from_numpy(expected.astype(np.float32)))


def _packed_linear(quant: str, rows: int, cols: int, bias: bool, seed: int = 0) -> tuple[ReplicatedLinear, torch.Tensor]:
    w = sample_weights(rows, cols, seed)
    layer = ReplicatedLinear(cols, rows, bias=bias)
    layer.use_packed(quant)
    layer.weight.data = packed_rows(w, quant)
    if bias:
        layer.bias.data = torch.randn(rows, generator=torch.Generator().manual_seed(seed))
    return layer, dequantize(layer.weight, quant, cols)


@pytest.mark.parametrize("quant", PACKED_TYPES)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gemm-only"])
def test_packed_matmul_equals_the_dequantized_reference(quant, kernel):
    """Rows 1..8 run through the C++ kernel (when built), more through dequantized slices
    of the weight and a dense GEMM; both equal F.linear on the dequantized weight, bias
    added, in float32 to summation order and in bfloat16 to its rounding."""
    ops = gguf_ops() if kernel else None
    if kernel and ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    layer, dense = _packed_linear(quant, 200, 320, bias=True)
    layer.kernel = GGUFMatmul(layer, ops)
    gen = torch.Generator().manual_seed(1)
    bias = layer.bias.data
    for rows in (1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 320, generator=gen)
        layer.bias.data = bias
        expected = torch.nn.functional.linear(x, dense, bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
        layer.bias.data = bias.to(torch.bfloat16)  # a bfloat16 model's bias
        xb = x.to(torch.bfloat16)
        got = layer(xb)
        assert got.dtype == torch.bfloat16
        reference = torch.nn.functional.linear(xb.float(), dense, layer.bias.float())
        torch.testing.assert_close(got.float(), reference, atol=0.05, rtol=0.02)
    layer.bias.data = bias
    assert layer(torch.zeros(0, 320)).shape == (0, 200)
    assert layer(torch.randn(2, 3, 320)).shape == (2, 3, 200)  # leading dims kept


@pytest.mark.parametrize("quant", PACKED_TYPES)
def test_the_kernels_equal_the_reference_on_their_own(quant):
    """gguf_mm for any number of rows (tiles of eight and a remainder) and
    gguf_dequantize, called directly."""
    ops = gguf_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    blocks = packed_rows(sample_weights(70, 96, seed=3), quant)
    dense = dequantize(blocks, quant, 96)
    assert torch.equal(ops.dequantize(blocks, TYPE_CODES[quant], 96), dense)
    for rows in (1, 8, 13, 24):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(ops.mm(x, blocks, TYPE_CODES[quant], 96), x @ dense.t(), atol=1e-4, rtol=1e-5)


def test_the_kernels_refuse_what_they_cannot_read():
    ops = gguf_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    blocks = packed_rows(sample_weights(8, 64), "Q4_1")
    code = TYPE_CODES["Q4_1"]
    with pytest.raises(RuntimeError, match="uint8 w"):
        ops.mm(torch.randn(1, 64), blocks, TYPE_CODES["Q8_0"], 64)  # Q8_0 rows are longer
    with pytest.raises(RuntimeError, match="quant"):
        ops.mm(torch.randn(1, 64), blocks, 7, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.dequantize(blocks, code, 60)
    with pytest.raises(RuntimeError, match="x"):
        ops.mm(torch.randn(1, 32), blocks, code, 64)


def _logits(model, tokens: list[int]) -> torch.Tensor:
    caches = new_model_kv_caches(model, 8, 16, torch.float32, CPU)
    n = len(tokens)
    md = AttentionMetadata(torch.arange(n), 0, None, None, [(0, n, 0, torch.arange(8))])
    metadata_builder(model, 16, CPU).build(md)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), caches, md))


def _packed(model) -> dict[str, str]:
    return {name: m.quant for name, m in model.named_modules() if getattr(m, "quant", None)}


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name,quant", [("llama", "Q8_0"), ("llama", "Q4_0"), ("llama-tied", "Q4_1")])
def test_a_gguf_loads_packed_and_computes_what_its_dequantized_weights_do(hf_dirs, tmp_path, name, quant):  # noqa: F811
    path = write_gguf(hf_dirs(name), tmp_path / f"{name}.gguf", getattr(T, quant))
    packed = load_model(path, torch.float32, CPU, 128)
    dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
    layers = len(packed.layers)
    kept = _packed(packed)
    assert set(kept.values()) == {quant} and _packed(dense) == {}
    # every projection of every layer, the vocabulary (the LM head too, tied or not)
    assert len(kept) == 4 * layers + 2
    assert _weight_bytes(packed) < _weight_bytes(dense) / 3
    tokens = [1, 7, 42, 99, 3, 250, 17, 8, 8, 64]
    torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), atol=2e-4, rtol=1e-4)


def test_a_fused_projection_of_mixed_types_stays_dense(hf_dirs, tmp_path):  # noqa: F811
    """llama.cpp's mixes (Q4_K_M) give a layer's q, k and v different types: that fused
    projection is dequantized, the rest stays packed, and the model computes the same."""
    reader_path = write_gguf(hf_dirs("llama"), tmp_path / "plain.gguf", T.Q4_0)
    k = next(t for t in gguf.GGUFReader(reader_path).tensors if t.name == "blk.0.attn_k.weight")
    rows = int(k.shape[1])
    k_q8 = quantize(gguf.quants.dequantize(np.array(k.data), T.Q4_0).reshape(rows, -1), T.Q8_0)
    path = write_gguf(hf_dirs("llama"), tmp_path / "mixed.gguf", T.Q4_0,
                      raw_tensors={"blk.0.attn_k.weight": (k_q8, T.Q8_0)})
    packed = load_model(path, torch.float32, CPU, 128)
    kept = _packed(packed)
    assert "layers.0.self_attn.qkv_proj" not in kept and kept["layers.1.self_attn.qkv_proj"] == "Q4_0"
    assert packed.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
    tokens = [1, 5, 9, 200, 31]
    torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), atol=2e-4, rtol=1e-4)


def test_the_engine_setting_dequantize_keeps_every_weight_dense(hf_dirs, tmp_path):  # noqa: F811
    """... and the engine's memory account (llmctl status) counts packed weights as the
    file stores them: its Q8_0 bytes are the file's."""
    path = str(write_gguf(hf_dirs("llama"), tmp_path / "q8.gguf", T.Q8_0))
    in_file: dict[str, int] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        in_file[tensor.tensor_type.name] = in_file.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    packed = LLM(model=path, **SETTINGS)
    dense = LLM(model=path, dequantize=True, **SETTINGS)
    try:
        assert _packed(packed.engine.executor.runner.model)
        assert _packed(dense.engine.executor.runner.model) == {}
        memory, dense_memory = packed.engine.memory(), dense.engine.memory()
        assert memory.weights["Q8_0"] == in_file["Q8_0"] and memory.worker_pids == []
        assert "Q8_0" not in dense_memory.weights
        assert sum(dense_memory.weights.values()) > 3 * sum(memory.weights.values())
        assert memory.kv_cache == SETTINGS["num_gpu_blocks_override"] * memory.bytes_per_block
    finally:
        packed.engine.shutdown()
        dense.engine.shutdown()
