"""GGUF weights in the x16 layout inside llmd's layers and models: a packed linear layer
repacked at attach (few rows through the x16 product, more through slices dequantized from
the layout), its output buffer, the rows the kernel takes by ISA and CPU, the parts
repacked and those left, and models loaded from GGUF files reading their weights through
the layout. The kernels themselves against the gguf package's dequantization:
test_gguf_x16.py (whose fixtures and bounds these tests share).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from llmd.gpu.layers import gguf_quant
from llmd.gpu.layers.gguf_quant import FORMATS, X16_TYPES, GGUFMatmul, PackedPart, use_x16
from llmd.gpu.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from test_gguf import hf_dirs  # noqa: F401
from test_gguf_x16 import activations, error_bound, float32_slack, ops, packed, x16  # noqa: F401


@pytest.mark.parametrize("quant", X16_TYPES)
def test_a_linear_layer_repacked_at_attach_computes_the_reference(x16, quant, monkeypatch):
    """Through GGUFMatmul: few rows by the x16 kernel, more by slices dequantized from
    the layout and a GEMM (exact to float32 sums, two slices here); the weight is
    repacked once, in place, even if asked again."""
    monkeypatch.setattr(gguf_quant, "SLICE_BYTES", 32 * 4 * 256)
    blocks, dense = packed(quant, 64, 256, seed=5)
    blocks, dense = blocks[16:], dense[16:]  # ordinary scales
    layer = ReplicatedLinear(256, 48, bias=True)
    layer.use_packed(quant)
    layer.weight.data = blocks.clone()
    layer.bias.data = torch.randn(48)
    storage = layer.weight.data_ptr()
    layer.kernel = GGUFMatmul(layer, x16, 3)
    (part,) = layer.packed_parts
    assert layer.weight.data_ptr() == storage
    assert torch.equal(layer.weight, x16.repack_x16(blocks, FORMATS[quant].code, 256))
    assert layer.weight.x16_parts == {0} and use_x16(layer.weight, part, 256, x16)  # not twice
    assert torch.equal(x16.unpack_x16(layer.weight, torch.arange(48), FORMATS[quant].code, 256), blocks)
    limit = layer.kernel.max_rows[3]  # the kernel to here, slices and a GEMM above
    for rows in (1, limit, limit + 1, 40):
        x = torch.randn(rows, 256)
        exact = x.double() @ dense.double().t() + layer.bias.double()
        got = layer(x).double()
        assert ((got - exact).abs() <= float32_slack(x, dense) + 1e-6).all(), rows


def test_a_large_output_goes_into_a_buffer_the_layer_reuses(x16, monkeypatch):
    """An LM head's output of REUSED_OUTPUT_BYTES or more (its logits) is written into a
    buffer the layer keeps, handed out again once nothing holds it: the same floats as a
    new tensor, and a result still held is never overwritten. Other layers keep none."""
    monkeypatch.setattr(gguf_quant, "REUSED_OUTPUT_BYTES", 4 * 64 * 4)  # 4 rows of 64 columns
    blocks, _ = packed("Q8_0", 80, 320, seed=4)
    layer = ReplicatedLinear(320, 64, bias=False)
    layer.use_packed("Q8_0")
    layer.weight.data = blocks[16:].clone()
    layer.kernel = GGUFMatmul(layer, x16, 2)
    code = FORMATS["Q8_0"].code
    xs = [activations(4, 320, seed=s) for s in range(3)]
    assert layer.kernel.reused is None  # not an LM head: a new tensor each time
    layer.kernel = GGUFMatmul(layer, x16, 2, reuse_output=True)

    def fresh(x):
        return x16.mm_x16(x, layer.weight, code, 320, 2)

    first = layer(xs[0])
    assert torch.equal(first, fresh(xs[0]))
    second = layer(xs[1])  # the first is still held: it is not written over
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, fresh(xs[0])) and torch.equal(second, fresh(xs[1]))
    view, at = second[1:], second.data_ptr()
    del first, second
    third = layer(xs[2])  # a view of the second still holds its buffer
    assert third.data_ptr() != at and torch.equal(view, fresh(xs[1])[1:])
    at = third.data_ptr()
    del view, third
    assert layer(xs[0]).data_ptr() == at and torch.equal(layer(xs[0]), fresh(xs[0]))  # nothing holds it: reused
    assert layer(xs[0][:2]).data_ptr() != at  # below the size: a new tensor as before
    with pytest.raises(RuntimeError, match="out"):
        x16.mm_x16_into(xs[0], layer.weight, code, 320, 2, "", torch.empty(3, 64))


@pytest.mark.parametrize("isa_name, vendor, limits", [
    ("avx512_vnni", "AuthenticAMD", {1: 1 << 20, 2: 1024, 3: 64}),  # Zen 4: float32 FMAs at half Intel's rate
    ("avx512_vnni", "GenuineIntel", {1: 512, 2: 64, 3: 32}),
    ("avx2", "AuthenticAMD", {1: 512, 2: 64, 3: 32}),
    ("avx2", "", {1: 512, 2: 64, 3: 32}),
])
def test_the_rows_through_the_kernel_follow_the_isa_and_the_cpu(x16, monkeypatch, isa_name, vendor, limits):
    """Up to max_rows[passes] rows a product runs through the x16 kernel, above through
    dequantized slices and a GEMM; the limits are the ISA's on this CPU's maker (where the
    int8 products stop beating a float32 GEMM: gguf_quant.X16_MAX_ROWS)."""
    monkeypatch.setattr(gguf_quant, "cpu_vendor", lambda: vendor)
    ops = dataclasses.replace(x16, x16_isa=isa_name)
    assert gguf_quant.x16_max_rows(ops) == limits
    calls = []
    counted = dataclasses.replace(ops, mm_x16=lambda *a, **k: calls.append(a[0].shape[0]) or x16.mm_x16(*a, **k))
    blocks, dense = packed("Q4_K", 32, 256, seed=3)
    blocks, dense = blocks[16:], dense[16:]
    layer = ReplicatedLinear(256, 16, bias=False)
    layer.use_packed("Q4_K")
    layer.weight.data = blocks.clone()
    layer.kernel = GGUFMatmul(layer, counted, 2)
    for rows in (limits[2], limits[2] + 1):
        x = torch.randn(rows, 256)
        exact = x.double() @ dense.double().t()
        assert ((layer(x).double() - exact).abs() <= error_bound(x, dense, 2) + float32_slack(x, dense)).all()
    assert calls == [limits[2]]


def test_parts_of_whole_row_groups_are_repacked_the_others_stay(x16):
    """A fused projection whose parts differ in type (llama.cpp's _M mixes): a part of
    whole 16-row groups is repacked in its own type, one that is not stays in the GGUF
    layout, and the layer computes the reference either way."""
    layer = MergedColumnParallelLinear(256, 24, bias=False)
    layer.use_packed({0: "Q4_K", 1: "Q6_K"})
    gate, gate_dense = packed("Q4_K", 40, 256, seed=7)
    up, up_dense = packed("Q6_K", 40, 256, seed=8)
    gate, gate_dense, up, up_dense = gate[16:], gate_dense[16:], up[16:], up_dense[16:]  # ordinary scales
    layer.weight.data = torch.cat([gate.reshape(-1), up.reshape(-1)])
    odd = ReplicatedLinear(256, 24, bias=False)  # 24 rows: not whole groups of 16
    odd.use_packed("Q4_K")
    odd.weight.data = gate.clone()
    before = odd.weight.data.clone()
    assert not use_x16(odd.weight, odd.packed_parts[0], 256, x16) and torch.equal(odd.weight.data, before)
    assert not use_x16(before, PackedPart("Q4_K", 0, 8, 0), 256, x16)
    layer.kernel = GGUFMatmul(layer, x16, 3)
    assert [passes for *_, passes in layer.kernel.parts] == [0, 0]  # 24 rows each: neither repacked
    layer16 = MergedColumnParallelLinear(256, 16, bias=False)
    layer16.use_packed({0: "Q4_K", 1: "Q6_K"})
    layer16.weight.data = torch.cat([gate[:16].reshape(-1), up[:16].reshape(-1)])
    layer16.kernel = GGUFMatmul(layer16, x16, 3)
    assert [passes for *_, passes in layer16.kernel.parts] == [3, 3]
    x = torch.randn(2, 256)
    for lin, dense in ((layer, torch.cat([gate_dense, up_dense])),
                       (layer16, torch.cat([gate_dense[:16], up_dense[:16]]))):
        exact = x.double() @ dense.double().t()
        assert ((lin(x).double() - exact).abs() <= float32_slack(x, dense) + 1e-6).all()


def test_a_loaded_model_reads_its_weights_through_the_x16_layout(x16, hf_dirs, tmp_path, monkeypatch):  # noqa: F811
    """A tied Q4_1 model: its LM head multiplies through the x16 kernel (two passes, for
    float32 as for bfloat16) and its embedding reads the same repacked table; the
    setting LLMD_GGUF_X16 turns it off or sets the passes."""
    from gguf_fixtures import write_gguf
    from llmd.gpu.models.loader import load_model

    path = write_gguf(hf_dirs("llama-tied"), tmp_path / "tied.gguf", T.Q4_1)
    model = load_model(path, torch.float32, torch.device("cpu"), 128)
    head, table = model.lm_head, model.embed_tokens
    def passes(model) -> int:
        return model.lm_head.kernel.parts[0][3]

    assert head.weight is table.weight and head.weight.x16_parts == {0}
    assert passes(model) == 2 and table.read_rows is not None
    assert passes(load_model(path, torch.bfloat16, torch.device("cpu"), 128)) == 2
    for value in (1, 3):
        monkeypatch.setenv("LLMD_GGUF_X16", str(value))
        assert passes(load_model(path, torch.float32, torch.device("cpu"), 128)) == value
    monkeypatch.setenv("LLMD_GGUF_X16", "0")
    plain = load_model(path, torch.float32, torch.device("cpu"), 128)
    assert passes(plain) == 0 and not hasattr(plain.lm_head.weight, "x16_parts")
    ids = torch.tensor([3, 250, 17])
    torch.testing.assert_close(table(ids), plain.embed_tokens(ids), atol=0, rtol=0)


def test_a_k_quant_model_with_a_tied_table_runs_through_x16(x16, hf_dirs, tmp_path, monkeypatch):  # noqa: F811
    """Layers in every K-quant and a Q6_K vocabulary tied to the LM head (as Q4_K_M files
    store it): every part repacked, the embedding reads its rows back from the layout
    (exactly what the file stores), and the logits are the float32 kernel's (the GGUF
    layout, LLMD_GGUF_X16=0) to within two passes' precision."""
    from gguf_fixtures import random_k_quant, write_gguf
    from llmd.gpu.models.loader import load_model
    from test_gguf_packed import _logits

    table = random_k_quant(1024, 256, T.Q6_K, 0.02, np.random.default_rng(0))
    layers = (T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K, T.Q2_K)
    path = write_gguf(hf_dirs("llama-256-tied"), tmp_path / "k.gguf", k_quant_types=layers,
                      raw_tensors={"token_embd.weight": (table, T.Q6_K)})
    model = load_model(path, torch.float32, torch.device("cpu"), 256)
    kernels = [m.kernel for m in model.modules() if hasattr(m, "kernel") and getattr(m, "quant", None)]
    assert {part.quant for k in kernels for part, *_ in k.parts} == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    assert all(passes == 2 for k in kernels for *_, passes in k.parts)
    assert model.lm_head.weight is model.embed_tokens.weight and model.embed_tokens.read_rows is not None
    # the LM head alone keeps its large outputs' buffer (gguf_quant.REUSED_OUTPUT_BYTES)
    assert model.lm_head.kernel.reused is not None and [k for k in kernels if k.reused is not None] == [
        model.lm_head.kernel]
    ids = torch.tensor([3, 1000, 17, 17])
    assert torch.equal(model.embed_tokens.read_rows(ids), torch.from_numpy(table[ids.numpy()]))
    # the lookup's rows decoded by the C++ kernel: the torch reference's values exactly
    reference = gguf_quant.dequantize(torch.from_numpy(table[ids.numpy()]), "Q6_K", 256)
    assert model.embed_tokens.dequantize_rows is not None and torch.equal(model.embed_tokens(ids), reference)
    monkeypatch.setenv("LLMD_GGUF_X16", "0")
    plain = load_model(path, torch.float32, torch.device("cpu"), 256)
    torch.testing.assert_close(model.embed_tokens(ids), plain.embed_tokens(ids), atol=0, rtol=0)
    for tokens in ([1, 7, 42, 99, 3, 250], [7]):  # prefill and a decode-sized step
        torch.testing.assert_close(_logits(model, tokens), _logits(plain, tokens), atol=1e-4, rtol=1e-4)
