"""GGUF weights in the x16 layout (cpu/cpu_quant_x16.cpp, gguf_quant.use_x16): every packed
type, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and the K-quants Q2_K..Q6_K.

The layout holds the GGUF bytes rearranged: reading rows back gives the file's blocks
exactly (random bytes: every bit pattern of the codes, sub-scales and fifth bits, with
fp16 scales at the edges). The product (AVX-512 VNNI, or AVX2 where a CPU lacks it: each
ISA this CPU runs is tested) quantizes x in int8 passes, so it equals x times the
dequantized weight (the gguf package's dequantization, an independent reader) within the
bound those passes allow: per element of x at most half a step of the last pass (amax /
127 / 254^(passes - 1) / 2 in its 32-column block), times the weight's size; an x whose
blocks are whole multiples of their step exactly (to float32 sums).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from llmd.gpu.layers import gguf_quant
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.layers.gguf_quant import FORMATS, X16_TYPES, GGUFMatmul, PackedPart, use_x16
from llmd.gpu.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from llmd_tools.gguf_blocks import random_blocks
from test_gguf import hf_dirs  # noqa: F401


@pytest.fixture(scope="module")
def ops():
    ops = gguf_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    return ops


@pytest.fixture(scope="module")
def x16(ops):
    if not ops.x16:
        pytest.skip("this CPU runs no x16 product (neither AVX-512 VNNI nor AVX2 with FMA and F16C), "
                    "or LLMD_GGUF_X16=0")
    return ops


ISAS = ("avx512_vnni", "avx2")  # gguf_mm_x16's, best first


@pytest.fixture(params=ISAS)
def isa(request, x16):
    if request.param not in x16.x16_isas:
        pytest.skip(f"this CPU lacks {request.param}")
    return request.param


def test_every_packed_type_has_an_x16_layout():
    assert set(X16_TYPES) == set(FORMATS)


def width(quant: str) -> int:
    """Columns of a test weight: ten 32-weight blocks, or two K-quant super-blocks."""
    return 512 if FORMATS[quant].block == 256 else 320


def packed(quant: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF rows of random bytes (the first four rows' fp16 scales 65504, 2^-24, 0 and
    -1.5), and the gguf package's float32 reading of them."""
    blocks = random_blocks(quant, rows, cols, seed=seed, extremes=True)
    dense = gguf_dequantize(blocks.numpy(), getattr(T, quant)).reshape(rows, cols).astype(np.float32)
    return blocks, torch.from_numpy(dense)


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian rows with what hidden states have: an outlier column, a zero block."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 60.0
    x[0, 32:64] = 0.0
    return x


# The K-quants whose x is quantized per 256-column super-block at one pass (llama.cpp's
# Q8_K: cpu_quant_x16_product.h's super_blocks); every other type, and two or three
# passes, per 32-column block.
SUPER_BLOCK_TYPES = ("Q3_K", "Q4_K", "Q5_K", "Q6_K")


def x_span(quant: str, passes: int) -> int:
    """Columns of x that share one scale in a product of `quant` in `passes` passes."""
    return 256 if quant in SUPER_BLOCK_TYPES and passes == 1 else 32


def error_bound(x: torch.Tensor, dense: torch.Tensor, passes: int, span: int = 32) -> torch.Tensor:
    """[rows, N]: what `passes` int8 passes over x, each `span` columns at one scale, may
    change x @ dense^T by."""
    blocks = x.double().reshape(x.shape[0], -1, span)
    step = blocks.abs().amax(dim=-1) / 127 / 254 ** (passes - 1) / 2  # [rows, blocks]
    weight = dense.double().abs().reshape(dense.shape[0], -1, span).sum(dim=-1)  # [N, blocks]
    return step @ weight.t()


def float32_slack(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """[rows, N]: what float32 sums of these products may be off by."""
    return 1e-5 * (x.double().abs() @ dense.double().abs().t())


@pytest.mark.parametrize("quant", X16_TYPES)
def test_repacked_rows_read_back_as_the_file_stores_them(ops, quant):
    cols = width(quant)
    blocks, dense = packed(quant, 64, cols)
    code = FORMATS[quant].code
    x16 = ops.repack_x16(blocks, code, cols)
    assert x16.shape == blocks.shape and not torch.equal(x16, blocks)
    assert torch.equal(ops.unpack_x16(x16, torch.arange(64), code, cols), blocks)
    ids = torch.tensor([63, 0, 17, 17, 2])
    assert torch.equal(ops.unpack_x16(x16, ids, code, cols), blocks[ids])
    # a slice of whole 16-row groups is itself an x16 weight of those rows
    assert torch.equal(ops.unpack_x16(x16[16:48], torch.arange(32), code, cols), blocks[16:48])
    # dequantized in place: what the gguf package reads from the GGUF layout
    assert torch.equal(ops.dequantize_x16(x16, code, cols), dense)
    assert torch.equal(ops.dequantize_x16(x16[16:32], code, cols), dense[16:32])


@pytest.mark.parametrize("quant", X16_TYPES)
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_the_product_is_within_what_its_passes_allow(x16, isa, quant, passes):
    cols = width(quant)
    blocks, dense = packed(quant, 48, cols, seed=passes)
    w = x16.repack_x16(blocks, FORMATS[quant].code, cols)
    for rows in (1, 3, 4, 5, 16):
        x = activations(rows, cols, seed=rows)
        exact = x.double() @ dense.double().t()
        got = x16.mm_x16(x, w, FORMATS[quant].code, cols, passes, isa=isa).double()
        slack = float32_slack(x, dense)
        assert ((got - exact).abs() <= error_bound(x, dense, passes, x_span(quant, passes)) + slack).all()
    if passes == 1:  # the bound is not loose: one pass is measurably off, three are not
        assert ((got - exact).abs() > 100 * slack).any()
    elif passes == 3:
        assert ((got - exact).abs() <= slack).all()


def quantized_x(x: torch.Tensor, span: int) -> torch.Tensor:
    """x as one int8 pass holds it, `span` columns per scale d = amax / 127 (float32, as
    the kernels compute it: codes of x * (1 / d) rounded to nearest even), in float64."""
    blocks = x.float().reshape(x.shape[0], -1, span)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv).clamp(-127, 127)  # torch.round: half to even
    return (codes.double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize("quant", X16_TYPES)
def test_one_pass_quantizes_x_per_block_or_per_super_block(x16, isa, quant):
    """At one pass x is rounded to int8 per 32 columns, or for SUPER_BLOCK_TYPES per
    256-column super-block (llama.cpp's Q8_K), and the product is then exact to float32
    sums: it equals x so rounded times the dequantized weight. An x with one quiet
    32-column block (its values below half a step of its super-block's largest) tells the
    two apart: per super-block that block rounds to zero."""
    cols = width(quant)
    blocks, dense = packed(quant, 48, cols, seed=4)
    blocks, dense = blocks[16:], dense[16:]  # ordinary scales
    w = x16.repack_x16(blocks, FORMATS[quant].code, cols)
    x = activations(9, cols, seed=21)
    x[:, 64:96] *= 1e-3  # quiet: |x| < 0.004, the super-block's half step ~ 60 * 3.5 / 254
    span = x_span(quant, 1)
    got = x16.mm_x16(x, w, FORMATS[quant].code, cols, 1, isa=isa).double()
    slack = float32_slack(x, dense)
    assert ((got - quantized_x(x, span) @ dense.double().t()).abs() <= slack).all()
    if span == 256:
        assert ((got - quantized_x(x, 32) @ dense.double().t()).abs() > 100 * slack).any()


@pytest.mark.parametrize("quant", ["Q4_1", "Q6_K"])
def test_reduced_precision_inputs_and_empty_rows(x16, isa, quant):
    cols = width(quant)
    blocks, dense = packed(quant, 32, cols)
    blocks, dense = blocks[16:], dense[16:]  # ordinary scales
    code = FORMATS[quant].code
    w = x16.repack_x16(blocks, code, cols)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, cols).to(dtype)
        got = x16.mm_x16(x, w, code, cols, 2, isa=isa)
        assert got.dtype == dtype
        exact = x.double() @ dense.double().t()
        assert ((got.double() - exact).abs() <= error_bound(x, dense, 2) + 1e-2 * exact.abs().amax()).all()
    assert x16.mm_x16(torch.zeros(0, cols), w, code, cols, 3, isa=isa).shape == (0, 16)


# Byte ranges of each type's codes in its GGUF block (ggml-common.h's block structs): the
# quants and their high bits (Q5's qh, Q3_K's hmask, Q6_K's qh), not the scales.
CODE_BYTES = {"Q8_0": [(2, 34)], "Q4_0": [(2, 18)], "Q4_1": [(4, 20)], "Q5_0": [(2, 22)], "Q5_1": [(4, 24)],
              "Q2_K": [(16, 80)], "Q3_K": [(0, 96)], "Q4_K": [(16, 144)], "Q5_K": [(16, 176)], "Q6_K": [(0, 192)],
              "IQ4_NL": [(2, 18)]}


def extreme_codes(quant: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed()'s rows with each code at its type's largest value in rows 0, 2, 4, ... and
    its smallest in rows 1, 3, ... (Q8_0: 127 and -128), scales and sub-scales random."""
    blocks = random_blocks(quant, rows, cols, seed=11).reshape(rows, -1, FORMATS[quant].block_bytes).clone()
    high, low = (0x7F, 0x80) if quant == "Q8_0" else (0xFF, 0x00)
    for a, b in CODE_BYTES[quant]:
        blocks[0::2, :, a:b] = high
        blocks[1::2, :, a:b] = low
    blocks = blocks.reshape(rows, -1)
    dense = gguf_dequantize(blocks.numpy(), getattr(T, quant)).reshape(rows, cols).astype(np.float32)
    return blocks, torch.from_numpy(dense)


def on_the_code_grid(rows: int, cols: int, seed: int, span: int = 32) -> torch.Tensor:
    """x whose `span`-column blocks are whole multiples of their step (amax / 127, a power
    of two): one pass quantizes them exactly. Every 32 columns reach +-127 steps, most at
    full scale throughout (all +127, all -127, alternating), the rest random steps."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g)
    pattern = torch.randint(0, 4, (rows, cols // 32), generator=g)
    steps[pattern == 0] = 127
    steps[pattern == 1] = -127
    steps[pattern == 2] = torch.tensor([127, -127] * 16)
    steps[..., 5] = 127 * torch.where(pattern == 1, -1, 1)  # every block's amax is 127 steps
    step = 2.0 ** torch.randint(-10, 0, (rows, cols // span, 1), generator=g).float()
    return (steps * step.repeat_interleave(span // 32, dim=1)).reshape(rows, cols)


@pytest.mark.parametrize("quant", X16_TYPES)
def test_extreme_codes_against_full_scale_x_are_exact(x16, isa, quant):
    """The int32 dot products are exact: with every weight code at its extremes against
    x codes of +-127 (where an AVX2 vpmaddubsw pair sum saturates int16 if more products
    are summed there than its codes allow, or Q8_0's codes are taken unsigned), an x on
    its quantization grid gives the float32 product of x and the dequantized weight, in
    one pass as in two (AVX2's Q8_0: x's two passes joined in int16) and three, for each tile of x's rows (1-5
    rows; 16 and 33: the VNNI product's tiles of eight, AVX2's of four, and one)."""
    cols = width(quant)
    blocks, dense = extreme_codes(quant, 32, cols)
    w = x16.repack_x16(blocks, FORMATS[quant].code, cols)
    for rows in (1, 2, 3, 4, 5, 16, 33):
        for passes in (1, 2, 3):
            x = on_the_code_grid(rows, cols, seed=rows, span=x_span(quant, passes))
            exact = x.double() @ dense.double().t()
            got = x16.mm_x16(x, w, FORMATS[quant].code, cols, passes, isa=isa).double()
            assert ((got - exact).abs() <= float32_slack(x, dense)).all(), (rows, passes)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_a_product_past_the_caches_equals_it_in_pieces(x16, isa, quant):
    """An output of 8 MiB or more (an LM head's logits at a batch; the VNNI product stores
    it past the caches, non-temporally) holds the same floats as the product of the
    weight's halves, each below that size and stored as usual."""
    cols, n = width(quant), 65536
    blocks, _ = packed(quant, n, cols, seed=5)
    w = x16.repack_x16(blocks, FORMATS[quant].code, cols)
    x = activations(33, cols, seed=9)  # 33 x 65536 float32: 8.25 MiB (four tiles of eight, then one)
    code = FORMATS[quant].code
    for passes in (1, 2):
        whole = x16.mm_x16(x, w, code, cols, passes, isa=isa)
        halves = [x16.mm_x16(x, w[i:i + n // 2], code, cols, passes, isa=isa) for i in (0, n // 2)]
        assert torch.equal(whole, torch.cat(halves, dim=1)), passes


@pytest.mark.parametrize("quant", ["Q8_0", "Q6_K"])
def test_rows_of_x_past_the_l2_go_in_blocks_that_equal_the_rows_in_pieces(x16, isa, quant):
    """x's rows beyond kRowBlockBytes (512 KiB: 64 rows of 8,192 columns at one pass, 32 at
    two, 16 at three) go through the weight block by block, the last one short with a tail
    of fewer than eight: every row as the product of the rows 16 at a time gives it."""
    cols, n = 8192, 48
    blocks, _ = packed(quant, n, cols, seed=4)
    code = FORMATS[quant].code
    w = x16.repack_x16(blocks, code, cols)
    x = activations(150, cols, seed=11)
    for passes in (1, 2, 3):
        whole = x16.mm_x16(x, w, code, cols, passes, isa=isa)
        pieces = [x16.mm_x16(x[a:a + 16], w, code, cols, passes, isa=isa) for a in range(0, 150, 16)]
        assert torch.equal(whole, torch.cat(pieces)), passes


@pytest.mark.parametrize("quant", X16_TYPES)
def test_the_two_isas_give_the_same_floats(x16, quant):
    """Where the CPU runs both, the AVX2 product is the VNNI one's to the bit: the same
    codes of x, the same int32 dot products, scaled in the same float32 order, whatever
    the tiles (VNNI: eight rows at a time, then four and fewer; AVX2: four)."""
    if len(x16.x16_isas) < 2:
        pytest.skip("this CPU runs one ISA of the x16 product")
    cols = width(quant)
    blocks, _ = packed(quant, 48, cols, seed=3)
    w = x16.repack_x16(blocks, FORMATS[quant].code, cols)
    for rows in (1, 4, 7, 8, 19):
        x = activations(rows, cols, seed=rows)
        for passes in (1, 2, 3):
            got = [x16.mm_x16(x, w, FORMATS[quant].code, cols, passes, isa=isa) for isa in ISAS]
            assert torch.equal(got[0], got[1]), (rows, passes)


def test_the_isa_is_chosen_by_name_or_by_the_cpu(x16):
    """isa="" (what the layers pass) is LLMD_GGUF_X16_ISA's, read once per process, else
    the best this CPU runs; a name it does not run, or no ISA's, is refused."""
    blocks, _ = packed("Q4_K", 16, 256)
    code = FORMATS["Q4_K"].code
    w = x16.repack_x16(blocks, code, 256)
    x = torch.randn(2, 256)
    assert x16.x16_isas and set(x16.x16_isas) <= set(ISAS)
    if "avx512_vnni" not in x16.x16_isas:
        with pytest.raises(RuntimeError, match="lacks avx512_vnni"):
            x16.mm_x16(x, w, code, 256, 1, isa="avx512_vnni")
    with pytest.raises(RuntimeError, match="must be avx512_vnni or avx2"):
        x16.mm_x16(x, w, code, 256, 1, isa="sse2")
    chosen = os.environ.get("LLMD_GGUF_X16_ISA") or x16.x16_isas[0]
    assert x16.x16_isa == chosen
    assert torch.equal(x16.mm_x16(x, w, code, 256, 1), x16.mm_x16(x, w, code, 256, 1, isa=chosen))
    script = ("import torch; from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops; ops = gguf_ops(); "
              "print(ops.x16, ops.x16_isa if ops else 'no kernels')")
    env = {**os.environ, "LLMD_GGUF_X16_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "True avx2", run.stderr[-2000:]
    env["LLMD_GGUF_X16_ISA"] = "sse2"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "LLMD_GGUF_X16_ISA must be avx512_vnni or avx2" in run.stderr


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
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.repack_x16(packed("Q4_K", 16, 256)[0], FORMATS["Q4_K"].code, 128)
    with pytest.raises(RuntimeError, match="format code"):
        ops.dequantize_x16(x16, len(FORMATS), 64)
    if ops.x16:
        with pytest.raises(RuntimeError, match="passes"):
            ops.mm_x16(torch.randn(1, 64), x16, code, 64, 4)


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
