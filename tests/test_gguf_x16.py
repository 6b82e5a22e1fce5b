"""GGUF weights in the x16 layout (cpu/cpu_quant_x16.cpp, gguf_quant.use_x16): every packed
type, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and the K-quants Q2_K..Q6_K.

The layout holds the GGUF bytes rearranged: reading rows back gives the file's blocks
exactly (random bytes: every bit pattern of the codes, sub-scales and fifth bits, with
fp16 scales at the edges). The product (AVX-512 VNNI, or AVX2 where a CPU lacks it: each
ISA this CPU runs is tested) quantizes x in int8 passes, so it equals x times the
dequantized weight (the gguf package's dequantization, an independent reader) within the
bound those passes allow: per element of x at most half a step of the last pass (amax /
127 / 254^(passes - 1) / 2 in its 32-column block), times the weight's size; an x whose
blocks are whole multiples of their step exactly (to float32 sums). The layout inside
llmd's layers and loaded models: test_gguf_x16_layers.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops
from llmd.gpu.layers.gguf_quant import FORMATS, X16_TYPES
from llmd_tools.gguf_blocks import random_blocks


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
