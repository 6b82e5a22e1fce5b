"""GGUF Q8_0/Q4_0/Q4_1 weights in the x16 layout (cpu/cpu_quant_x16.cpp, gguf_quant.use_x16).

The layout holds the GGUF bytes rearranged: reading rows back gives the file's blocks
exactly. The VNNI product quantizes x in int8 passes, so it equals x times the
dequantized weight (the gguf package's dequantization, an independent reader) within
the bound those passes allow: per element of x at most half a step of the last pass
(amax / 127 / 254^(passes - 1) / 2 in its 32-column block), times the weight's size.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.layers.gguf_quant import FORMATS, X16_MAX_ROWS, X16_TYPES, GGUFMatmul, PackedPart, use_x16
from llmd.gpu.layers.linear import ReplicatedLinear
from test_gguf import hf_dirs  # noqa: F401


@pytest.fixture(scope="module")
def ops():
    ops = gguf_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    return ops


@pytest.fixture(scope="module")
def vnni(ops):
    if not ops.x16:
        pytest.skip("this CPU lacks AVX-512 VNNI (or LLMD_GGUF_X16=0)")
    return ops


def packed(quant: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF rows of Gaussian weights with extreme blocks, and their dequantized floats."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0, :32] = 0.0
    w[1, 32:64] = 0.7
    w[2, 5] = 40.0
    blocks = quantize(w, getattr(T, quant)).reshape(rows, -1)
    dense = gguf_dequantize(blocks, getattr(T, quant)).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(dense)


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian rows with what hidden states have: an outlier column, a zero block."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 60.0
    x[0, 32:64] = 0.0
    return x


def error_bound(x: torch.Tensor, dense: torch.Tensor, passes: int) -> torch.Tensor:
    """[rows, N]: what `passes` int8 passes over x may change x @ dense^T by."""
    blocks = x.reshape(x.shape[0], -1, 32)
    step = blocks.abs().amax(dim=-1) / 127 / 254 ** (passes - 1) / 2  # [rows, blocks]
    weight = dense.abs().reshape(dense.shape[0], -1, 32).sum(dim=-1)  # [N, blocks]
    return step @ weight.t()


@pytest.mark.parametrize("quant", X16_TYPES)
def test_repacked_rows_read_back_as_the_file_stores_them(ops, quant):
    blocks, _ = packed(quant, 64, 96)
    code = FORMATS[quant].code
    x16 = ops.repack_x16(blocks, code, 96)
    assert x16.shape == blocks.shape and not torch.equal(x16, blocks)
    assert torch.equal(ops.unpack_x16(x16, torch.arange(64), code, 96), blocks)
    ids = torch.tensor([63, 0, 17, 17, 2])
    assert torch.equal(ops.unpack_x16(x16, ids, code, 96), blocks[ids])
    # a slice of whole 16-row groups is itself an x16 weight of those rows
    assert torch.equal(ops.unpack_x16(x16[16:48], torch.arange(32), code, 96), blocks[16:48])
    if ops.x16:  # dequantized in place: what the GGUF layout dequantizes to
        assert torch.equal(ops.dequantize_x16(x16, code, 96), ops.dequantize(blocks, code, 96))
        assert torch.equal(ops.dequantize_x16(x16[16:32], code, 96), ops.dequantize(blocks[16:32], code, 96))


@pytest.mark.parametrize("quant", X16_TYPES)
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_the_vnni_product_is_within_what_its_passes_allow(vnni, quant, passes):
    blocks, dense = packed(quant, 48, 320, seed=passes)
    x16 = vnni.repack_x16(blocks, FORMATS[quant].code, 320)
    for rows in (1, 3, 4, 5, 16):
        x = activations(rows, 320, seed=rows)
        exact = x.double() @ dense.double().t()
        got = vnni.mm_x16(x, x16, FORMATS[quant].code, 320, passes)
        slack = 1e-5 * exact.abs().amax()  # float32 sums
        assert ((got.double() - exact).abs() <= error_bound(x, dense, passes).double() + slack).all()
    if passes == 1:  # the bound is not loose: one pass is measurably off, three are not
        assert (got.double() - exact).abs().max() > 100 * slack
    elif passes == 3:
        torch.testing.assert_close(got.double(), exact, atol=float(slack), rtol=0)


def test_reduced_precision_inputs_and_empty_rows(vnni):
    blocks, dense = packed("Q4_1", 32, 64)
    x16 = vnni.repack_x16(blocks, FORMATS["Q4_1"].code, 64)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, 64).to(dtype)
        got = vnni.mm_x16(x, x16, FORMATS["Q4_1"].code, 64, 2)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), x.float() @ dense.t(), atol=0.05, rtol=0.02)
    assert vnni.mm_x16(torch.zeros(0, 64), x16, FORMATS["Q4_1"].code, 64, 3).shape == (0, 32)


def test_the_x16_operators_refuse_what_they_cannot_read(ops):
    blocks, _ = packed("Q8_0", 24, 64)
    code = FORMATS["Q8_0"].code
    with pytest.raises(RuntimeError, match="groups of 16"):
        ops.repack_x16(blocks, code, 64)
    x16 = ops.repack_x16(blocks[:16], code, 64)
    with pytest.raises(RuntimeError, match="outside"):
        ops.unpack_x16(x16, torch.tensor([16]), code, 64)
    with pytest.raises(RuntimeError, match="uint8 w"):
        ops.unpack_x16(x16, torch.tensor([0]), FORMATS["Q4_0"].code, 64)
    if ops.x16:
        with pytest.raises(RuntimeError, match="passes"):
            ops.mm_x16(torch.randn(1, 64), x16, code, 64, 4)


@pytest.mark.parametrize("quant", X16_TYPES)
def test_a_linear_layer_repacked_at_attach_computes_the_reference(vnni, quant):
    """Through GGUFMatmul: few rows by the VNNI kernel, more by rows read back, dequantized
    and a GEMM (exact to float32 sums); the weight is repacked once, even if asked again."""
    blocks, dense = packed(quant, 64, 128)
    layer = ReplicatedLinear(128, 64, bias=True)
    layer.use_packed(quant)
    layer.weight.data = blocks.clone()
    layer.bias.data = torch.randn(64)
    layer.kernel = GGUFMatmul(layer, vnni, 3)
    (part,) = layer.packed_parts
    assert layer.weight.x16_parts == {0} and use_x16(layer.weight, part, 128, vnni)  # not twice
    assert torch.equal(vnni.unpack_x16(layer.weight, torch.arange(64), FORMATS[quant].code, 128), blocks)
    for rows in (1, X16_MAX_ROWS[3], X16_MAX_ROWS[3] + 1, 40):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, dense, layer.bias), atol=1e-4, rtol=1e-5)


def test_odd_row_counts_and_other_types_stay_in_the_gguf_layout(ops):
    layer = ReplicatedLinear(64, 24, bias=False)
    layer.use_packed("Q8_0")
    layer.weight.data = packed("Q8_0", 24, 64)[0]
    before = layer.weight.data.clone()
    assert not use_x16(layer.weight, layer.packed_parts[0], 64, ops) and torch.equal(layer.weight.data, before)
    assert not use_x16(before, PackedPart("Q5_0", 0, 16, 0), 64, ops)  # a type the kernel does not read


def test_a_loaded_model_reads_its_weights_through_the_x16_layout(vnni, hf_dirs, tmp_path, monkeypatch):  # noqa: F811
    """A tied Q4_1 model: its LM head multiplies through the VNNI kernel (three passes for
    float32, two for bfloat16) and its embedding reads the same repacked table; the
    setting LLMD_GGUF_X16 turns it off or sets the passes."""
    from gguf_fixtures import write_gguf
    from llmd.gpu.models.loader import load_model

    path = write_gguf(hf_dirs("llama-tied"), tmp_path / "tied.gguf", T.Q4_1)
    model = load_model(path, torch.float32, torch.device("cpu"), 128)
    head, table = model.lm_head, model.embed_tokens
    def passes(model) -> int:
        return model.lm_head.kernel.parts[0][3]

    assert head.weight is table.weight and head.weight.x16_parts == {0}
    assert passes(model) == 3 and table.read_rows is not None
    assert passes(load_model(path, torch.bfloat16, torch.device("cpu"), 128)) == 2
    monkeypatch.setenv("LLMD_GGUF_X16", "1")
    assert passes(load_model(path, torch.float32, torch.device("cpu"), 128)) == 1
    monkeypatch.setenv("LLMD_GGUF_X16", "0")
    plain = load_model(path, torch.float32, torch.device("cpu"), 128)
    assert passes(plain) == 0 and not hasattr(plain.lm_head.weight, "x16_parts")
    ids = torch.tensor([3, 250, 17])
    torch.testing.assert_close(table(ids), plain.embed_tokens(ids), atol=0, rtol=0)
