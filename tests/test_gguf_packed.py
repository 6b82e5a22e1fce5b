"""GGUF weights kept packed (gguf_quant, cpu/cpu_quant.cpp): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
the K-quants Q2_K..Q6_K and IQ4_NL (IQ4_XS held as IQ4_NL).

Each format's dequantization equals the gguf package's (an independent reader of the
same bytes) bit for bit, on random blocks and on blocks of extreme scales; the packed
matmul, through the C++ kernel (decode rows; the AVX-512 build here, and the portable
build that a CPU without AVX-512 gets) and the dequantized-slice GEMM (more rows),
equals x times the dequantized weight; a GGUF model loaded packed computes what the same
file dequantized at load computes, in a fraction of the memory, a fused projection whose
parts differ in type included, and (tests/test_gguf.py) matches transformers reading the
file; a quantized tensor that cannot stay packed is refused by name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

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
from llmd.gpu.layers.cpu.cpu_linear import checkpoint_weight
from llmd.gpu.layers.gguf_formats import FORMATS, PACKED_TYPES, dequantize, held_type, reencoded
from llmd.gpu.layers.gguf_quant import KERNEL_MAX_ROWS, GGUFMatmul
from llmd.gpu.layers.linear import ReplicatedLinear
from llmd.gpu.layers.quant.gguf_planes import GPU_TYPES
from llmd.gpu.models.decoder import CausalLM
from llmd.gpu.models.gguf_loader import gguf_tensor_types, iter_gguf_weights
from llmd.gpu.models.loader import load_hf_config, load_model
from llmd.gpu.models.weight_plan import packed_params
from llmd_tools.gguf_blocks import random_blocks
from test_gguf import SETTINGS, hf_dirs  # noqa: F401

CPU = torch.device("cpu")


def _cols(quant: str) -> int:
    return 3 * FORMATS[quant].block  # three blocks: 96 weights, or 768 for a K-quant


def test_the_formats_are_the_gguf_packages():
    for quant, f in FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[getattr(T, quant)] == (f.block, f.block_bytes), quant
    assert len({f.code for f in FORMATS.values()}) == len(FORMATS)


@pytest.mark.parametrize("quant", PACKED_TYPES)
def test_dequantize_equals_the_gguf_package(quant):
    """Bit for bit, on random blocks and blocks of extreme scales."""
    cols = _cols(quant)
    blocks = torch.cat([random_blocks(quant, 40, cols, seed=1), random_blocks(quant, 8, cols, seed=2, extremes=True)])
    expected = gguf.quants.dequantize(blocks.numpy(), getattr(T, quant)).reshape(blocks.shape[0], cols)
    got = dequantize(blocks, quant, cols)
    assert torch.isfinite(got).all()
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_reads_what_the_gguf_package_quantizes(quant):
    """Blocks of real weights (the package's quantizer), a few of extremes among them."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 256)).astype(np.float32) * 0.05
    w[0, :32] = 0.0
    w[1, 32:64] = 0.7
    w[2, 5] = 40.0
    blocks = torch.from_numpy(quantize(w, getattr(T, quant)).reshape(32, -1).copy())
    expected = gguf.quants.dequantize(blocks.numpy(), getattr(T, quant)).reshape(w.shape)
    assert torch.equal(dequantize(blocks, quant, 256), torch.from_numpy(expected.astype(np.float32)))


def _packed_linear(quant: str, rows: int, cols: int, bias: bool,
                   seed: int = 0) -> tuple[ReplicatedLinear, torch.Tensor]:
    layer = ReplicatedLinear(cols, rows, bias=bias)
    layer.use_packed(quant)
    layer.weight.data = random_blocks(quant, rows, cols, seed)
    if bias:
        layer.bias.data = torch.randn(rows, generator=torch.Generator().manual_seed(seed))
    return layer, dequantize(layer.weight, quant, cols)


# Relative rounding of a result in each dtype (half an ulp).
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def assert_product_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """got == x @ w^T (+ bias), the exact value computed in float64, within what float32
    accumulation and got's dtype allow: K 2^-24 (|x| @ |w|^T) (a float32 sum of K terms
    in any order; a single wrongly decoded weight errs by about 1/K of that sum, far
    more), plus the result's rounding (bfloat16 / float16: the product rounded, then
    the sum with the bias rounded: 2^-8 / 2^-11 of each)."""
    product = x.double() @ w.double().t()
    exact = product if bias is None else product + bias.double()
    rounding = ROUNDING[got.dtype] * (product.abs() + exact.abs())
    bound = rounding + x.shape[-1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"{got.dtype}: error {float((error / bound).max()):.3g}x the bound"


@pytest.mark.parametrize("quant", PACKED_TYPES)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gemm-only"])
def test_packed_matmul_equals_the_dequantized_reference(quant, kernel):
    """Rows 1..16 run through the C++ kernel (when built), more through dequantized
    slices of the weight and a dense GEMM; both equal F.linear on the dequantized weight,
    bias added, for float32, bfloat16 and float16 activations. (Without the kernels every
    row count takes the one torch path: two suffice.)"""
    ops = gguf_ops() if kernel else None
    if kernel and ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    cols = _cols(quant)
    layer, dense = _packed_linear(quant, 200, cols, bias=True)
    layer.kernel = GGUFMatmul(layer, ops)
    gen = torch.Generator().manual_seed(1)
    bias = layer.bias.data
    for rows in (1, 3, 8, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40) if kernel else (1, KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, cols, generator=gen)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            layer.bias.data = bias.to(dtype)  # a model of that dtype's bias
            xd = x.to(dtype)
            got = layer(xd)
            assert got.dtype == dtype
            # the GEMM path multiplies in the activations' dtype: bias and weight rounded to it
            w = dense if kernel and rows <= KERNEL_MAX_ROWS or dtype == torch.float32 else dense.to(dtype)
            assert_product_close(got, xd, w, layer.bias.data)
    layer.bias.data = bias
    assert layer(torch.zeros(0, cols)).shape == (0, 200)
    assert layer(torch.randn(2, 3, cols)).shape == (2, 3, 200)  # leading dims kept


@pytest.mark.parametrize("quant", PACKED_TYPES)
def test_the_kernels_equal_the_reference_on_their_own(quant):
    """gguf_dequantize bit for bit (extreme scales included); gguf_mm for any number of
    rows (tiles of eight and a remainder) and every activation dtype, called directly."""
    ops = gguf_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    cols, code = _cols(quant), FORMATS[quant].code
    extreme = random_blocks(quant, 70, cols, seed=3, extremes=True)
    assert torch.equal(ops.dequantize(extreme, code, cols), dequantize(extreme, quant, cols))
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(0))
    assert_product_close(ops.mm(x, extreme, code, cols), x, dequantize(extreme, quant, cols))
    blocks = random_blocks(quant, 70, cols, seed=4)
    dense = dequantize(blocks, quant, cols)
    for rows in (1, 3, 8, 13, 16, 24):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = ops.mm(x.to(dtype), blocks, code, cols)
            assert got.dtype == dtype
            assert_product_close(got, x.to(dtype), dense)


def test_the_kernels_refuse_what_they_cannot_read():
    ops = gguf_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    blocks = random_blocks("Q4_1", 8, 64)
    code = FORMATS["Q4_1"].code
    with pytest.raises(RuntimeError, match="uint8 w"):
        ops.mm(torch.randn(1, 64), blocks, FORMATS["Q8_0"].code, 64)  # Q8_0 rows are longer
    with pytest.raises(RuntimeError, match="quant"):
        ops.mm(torch.randn(1, 64), blocks, len(FORMATS), 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.dequantize(blocks, code, 60)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.dequantize(random_blocks("Q4_K", 8, 256), FORMATS["Q4_K"].code, 128)
    with pytest.raises(RuntimeError, match="x"):
        ops.mm(torch.randn(1, 32), blocks, code, 64)


# A CPU without AVX-512 builds the kernels' portable path: the same checks, in a process
# whose torch reports no vector ISA (the kernels are built for it, in their own folder).
_PORTABLE_CHECK = r"""
import json, sys, torch
sys.path[:0] = json.loads(sys.argv[1])
from llmd.gpu.layers.cpu.cpu_kernels import gguf_ops, vector_isa
from llmd.gpu.layers.gguf_quant import FORMATS, dequantize
from test_gguf_packed import assert_product_close, random_blocks, _cols
assert vector_isa() == "DEFAULT", vector_isa()
ops = gguf_ops()
assert ops is not None, "the portable kernels did not build"
for quant, f in FORMATS.items():
    cols = _cols(quant)
    for blocks in (random_blocks(quant, 37, cols, seed=5, extremes=True), random_blocks(quant, 37, cols, seed=6)):
        dense = dequantize(blocks, quant, cols)
        assert torch.equal(ops.dequantize(blocks, f.code, cols), dense), quant
        for rows in (1, 9):
            x = torch.randn(rows, cols)
            assert_product_close(ops.mm(x, blocks, f.code, cols), x, dense)
        xb = torch.randn(3, cols).to(torch.bfloat16)
        assert_product_close(ops.mm(xb, blocks, f.code, cols), xb, dense)
        x16 = ops.repack_x16(blocks[:32].contiguous(), f.code, cols)  # read back through the portable decoding
        assert torch.equal(ops.dequantize_x16(x16, f.code, cols), dense[:32]), quant
print("portable ok")
"""


def test_the_portable_kernels_equal_the_reference():
    if gguf_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")
    # The build's own limit (300 s by default) below this test's: the portable build runs
    # beside the suite's other worker, and two tests wait for the same one.
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", LLMD_KERNEL_BUILD_TIMEOUT="570")
    done = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK, json.dumps(sys.path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "portable ok" in done.stdout, done.stderr[-3000:]


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
    """What the model holds for its weights (oneDNN's layouts of a CPU model's dense
    linears included: their plain layouts are released)."""
    from llmd.gpu.worker.memory_profile import weight_storage

    return sum(weight_storage(model).values())


@pytest.mark.usefixtures("float32_products")
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


@pytest.mark.usefixtures("float32_products")
def test_a_fused_projection_of_mixed_types_stays_packed_part_by_part(hf_dirs, tmp_path):  # noqa: F811
    """llama.cpp's mixes (Q4_K_M) give a layer's q, k and v different types: that fused
    projection keeps each part in its own type, and the model computes the same."""
    reader_path = write_gguf(hf_dirs("llama"), tmp_path / "plain.gguf", T.Q4_0)
    k = next(t for t in gguf.GGUFReader(reader_path).tensors if t.name == "blk.0.attn_k.weight")
    rows = int(k.shape[1])
    k_q8 = quantize(gguf.quants.dequantize(np.array(k.data), T.Q4_0).reshape(rows, -1), T.Q8_0)
    path = write_gguf(hf_dirs("llama"), tmp_path / "mixed.gguf", T.Q4_0,
                      raw_tensors={"blk.0.attn_k.weight": (k_q8, T.Q8_0)})
    packed = load_model(path, torch.float32, CPU, 128)
    kept = _packed(packed)
    assert kept["layers.0.self_attn.qkv_proj"] == "Q4_0+Q8_0+Q4_0" and kept["layers.1.self_attn.qkv_proj"] == "Q4_0"
    qkv = packed.layers[0].self_attn.qkv_proj
    assert [(p.quant, p.start, p.end) for p in qkv.packed_parts] == \
        [("Q4_0", 0, qkv.part_sizes[0]), ("Q8_0", qkv.part_sizes[0], sum(qkv.part_sizes[:2])),
         ("Q4_0", sum(qkv.part_sizes[:2]), sum(qkv.part_sizes))]
    dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
    assert qkv.weight.dtype == torch.uint8 and _weight_bytes(packed) < _weight_bytes(dense) / 3
    for tokens in ([1, 5, 9, 200, 31], [7]):  # prefill and a decode-sized step
        torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), atol=2e-4, rtol=1e-4)


def test_a_quantized_tensor_that_cannot_stay_packed_is_refused_by_name(hf_dirs, tmp_path):  # noqa: F811
    """A type without a kernel (MXFP4), a quantized norm, a fused projection mixing a
    dense part with quantized ones: the load names the tensor, its type and the way out
    (dequantize=True), which then loads the file as the gguf package reads it."""
    llama = hf_dirs("llama")
    rows, cols = 32, 64  # blk.0.attn_v: kv heads 2 x head dim 16, hidden 64
    block, block_bytes = gguf.GGML_QUANT_SIZES[T.MXFP4]
    mxfp4 = np.random.default_rng(0).integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    mxfp4[:, 0] = 120  # each block's e8m0 scale: 2^-7
    norm = quantize(np.linspace(0.5, 1.5, cols, dtype=np.float32), T.Q8_0)
    k_f16 = np.zeros((rows, cols), dtype=np.float16)
    cases = [
        ({"blk.0.attn_v.weight": (mxfp4.reshape(rows, -1), T.MXFP4)},
         r"GGUF tensor 'blk.0.attn_v.weight' of type MXFP4 cannot stay packed: llmd has no kernel for MXFP4 "
         r"\(packed types: Q8_0, .*Q6_K, IQ4_NL\); dequantize=True \(--dequantize\) loads it dequantized"),
        ({"blk.0.attn_norm.weight": (norm, T.Q8_0)},
         r"GGUF tensor 'blk.0.attn_norm.weight' of type Q8_0 cannot stay packed: its parameter takes no packed weight"),
        ({"blk.0.attn_k.weight": (k_f16, T.F16)},
         r"GGUF tensor 'blk.0.attn_[qv].weight' of type Q4_0 cannot stay packed: its fused projection mixes dense"),
    ]
    for i, (raw, message) in enumerate(cases):
        path = write_gguf(llama, tmp_path / f"refused-{i}.gguf", T.Q4_0, raw_tensors=raw)
        with pytest.raises(ValueError, match=message):
            load_model(path, torch.float32, CPU, 128)
        dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
        assert _packed(dense) == {}
    qkv = load_model(tmp_path / "refused-0.gguf", torch.float32, CPU, 128, dequantize=True).layers[0].self_attn.qkv_proj
    a, b = qkv.part_rows("v")
    expected = gguf.quants.dequantize(mxfp4, T.MXFP4).reshape(rows, cols)
    assert torch.equal(checkpoint_weight(qkv)[a:b], torch.from_numpy(expected.astype(np.float32)))


def test_iq4_xs_blocks_are_held_as_iq4_nl_blocks_under_their_sub_block_scales():
    """Each 32-weight sub-block of an IQ4_XS super-block becomes an IQ4_NL block: the
    same nibbles under d * (ls - 32) rounded to fp16 — the gguf package's weights exactly
    where that product is an fp16 (d a power of two, every 6-bit ls of both halves of the
    scale bytes), within 2^-11 of each sub-block's scale otherwise; the same on CUDA.
    A product beyond fp16's range is refused; other types are not re-encoded."""
    rows, cols = 16, 512
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 136), dtype=np.uint8)
    raw[0, 0, 2:8] = [0xE4, 0x1B, 0x10, 0x32, 0x54, 0xF6]  # scales_h, scales_l: ls of every high / low pattern
    d = (2.0 ** rng.integers(-14, -4, size=(rows, cols // 256))).astype(np.float16)
    raw[..., :2] = d.view(np.uint8).reshape(rows, -1, 2)
    exact = raw.reshape(rows, -1)
    assert held_type("IQ4_XS") == held_type("IQ4_XS", GPU_TYPES) == "IQ4_NL"
    assert held_type("IQ4_NL") == held_type("IQ4_NL", GPU_TYPES) == "IQ4_NL"
    expected = gguf.quants.dequantize(exact, T.IQ4_XS).reshape(rows, cols)
    nl = reencoded("IQ4_XS", exact)
    assert nl.shape == (rows, cols // 32 * 18)
    assert torch.equal(dequantize(torch.from_numpy(nl), "IQ4_NL", cols), torch.from_numpy(expected))
    with pytest.raises(ValueError, match="IQ4_XS is not held as Q8_0"):
        reencoded("IQ4_XS", exact, "Q8_0")
    with pytest.raises(ValueError, match="IQ4_NL is not re-encoded"):
        reencoded("IQ4_NL", nl)
    raw[..., :2] = (rng.standard_normal((rows, cols // 256)) * 0.01).astype(np.float16).view(np.uint8).reshape(
        rows, -1, 2)
    rounded = raw.reshape(rows, -1)
    expected = gguf.quants.dequantize(rounded, T.IQ4_XS).reshape(rows, cols)
    got = dequantize(torch.from_numpy(reencoded("IQ4_XS", rounded)), "IQ4_NL", cols).numpy()
    assert (np.abs(got - expected) <= np.abs(expected) * 2.0 ** -11).all()  # each weight: its scale's rounding
    assert not np.array_equal(got, expected)  # the rounding is there
    raw[0, 0, :2] = np.array([60000.0], dtype=np.float16).view(np.uint8)
    raw[0, 0, 2:8] = 0  # ls = 0: 60000 * -32
    with pytest.raises(ValueError, match="exceeds float16's range"):
        reencoded("IQ4_XS", raw.reshape(rows, -1))


@pytest.mark.usefixtures("float32_products")
def test_an_iq4_nl_gguf_loads_packed(hf_dirs, tmp_path):  # noqa: F811
    """Every layer weight IQ4_NL (random blocks), beside a Q4_0 one in the same fused
    projection: on CPU the load keeps them packed as the file stores them, and the model
    computes what the file dequantized by the gguf package computes; the CUDA plan keeps
    them as IQ4_NL too (its Triton kernel: tests/test_triton_quant.py), the loader handing
    over the file's blocks."""
    v = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32) * 0.1
    path = write_gguf(hf_dirs("llama"), tmp_path / "iq4.gguf", T.Q4_0, k_quant_types=(T.IQ4_NL,),
                      raw_tensors={"blk.0.attn_v.weight": (quantize(v, T.Q4_0), T.Q4_0)})
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == "IQ4_NL"
    assert types["blk.0.attn_v.weight"] == types["token_embd.weight"] == "Q4_0"
    packed = load_model(path, torch.float32, CPU, 128)
    kept = _packed(packed)
    assert kept["layers.0.self_attn.qkv_proj"] == "IQ4_NL+IQ4_NL+Q4_0" and kept["layers.1.mlp.down_proj"] == "IQ4_NL"
    dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
    assert _weight_bytes(packed) < _weight_bytes(dense) / 3
    for tokens in ([1, 5, 9, 200, 31], [7]):  # prefill and a decode-sized step
        torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), atol=2e-4, rtol=1e-4)
    with torch.device("meta"):
        model = CausalLM(load_hf_config(path), 128)
    plan = packed_params(model, gguf_tensor_types(path), "cuda")
    assert plan["layers.0.self_attn.qkv_proj.weight"] == {"q": "IQ4_NL", "k": "IQ4_NL", "v": "Q4_0"}
    held = {"model.layers.1.mlp.down_proj.weight": "IQ4_NL", "model.layers.0.self_attn.v_proj.weight": "Q4_0"}
    sources = {name: s for name, s in iter_gguf_weights(path, load_hf_config(path), held) if name in held}
    down, v_proj = sources["model.layers.1.mlp.down_proj.weight"], sources["model.layers.0.self_attn.v_proj.weight"]
    assert (down.quant, v_proj.quant) == ("IQ4_NL", "Q4_0")
    assert torch.equal(down.dequantize(), checkpoint_weight(dense.layers[1].mlp.down_proj))


@pytest.mark.usefixtures("float32_products")
def test_an_iq4_xs_gguf_loads_packed_as_iq4_nl(hf_dirs, tmp_path):  # noqa: F811
    """Every layer weight IQ4_XS (random super-blocks): on CPU held as IQ4_NL (the same
    nibbles, each sub-block's scale d * (ls - 32) as an fp16: the fixture's d are powers
    of two, so exactly) at 144 / 136 of the file's bytes, computing what the gguf
    package's dequantization of the file computes; the CUDA plan holds them as IQ4_NL too."""
    path = write_gguf(hf_dirs("llama-256"), tmp_path / "iq4xs.gguf", T.Q8_0, k_quant_types=(T.IQ4_XS,))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == "IQ4_XS"
    packed = load_model(path, torch.float32, CPU, 128)
    kept = _packed(packed)
    assert kept["layers.0.self_attn.qkv_proj"] == "IQ4_NL" and kept["layers.1.mlp.down_proj"] == "IQ4_NL"
    down = packed.layers[1].mlp.down_proj
    file_bytes = down.in_features * down.out_features // 256 * 136
    assert down.weight.numel() == file_bytes * 144 // 136
    dense = load_model(path, torch.float32, CPU, 128, dequantize=True)
    for tokens in ([1, 5, 9, 200, 31], [7]):  # prefill and a decode-sized step
        torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), atol=2e-4, rtol=1e-4)
    with torch.device("meta"):
        model = CausalLM(load_hf_config(path), 128)
    assert packed_params(model, gguf_tensor_types(path), "cuda")["layers.1.mlp.down_proj.weight"] == "IQ4_NL"


def test_the_pool_estimate_counts_a_gguf_as_each_device_holds_it(hf_dirs, tmp_path):  # noqa: F811
    """The model pool's estimate of a GGUF's weights (llmd.pool.estimate, from the header,
    without torch) is what the loaded model holds on CPU: IQ4_XS layers as IQ4_NL (144 /
    136 of the file's bytes), Q4_K ones as stored, the F16 vocabulary, LM head and norms
    at float32 (twice the file's bytes; the LM head once more, oneDNN's copy); on CUDA the
    IQ4_XS layers as IQ4_NL too, the rest as stored, the dense tensors at bfloat16."""
    from llmd.config import EngineConfig
    from llmd.gpu.worker.memory_profile import weight_storage
    from llmd.pool.estimate import estimate_need, read_shape

    path = write_gguf(hf_dirs("llama-256"), tmp_path / "mixed.gguf", T.F16, k_quant_types=(T.IQ4_XS, T.Q4_K))
    file_types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"IQ4_XS", "Q4_K", "F16"} <= file_types
    model = load_model(path, torch.float32, CPU, 128)
    held = sum(weight_storage(model).values()) - sum(b.untyped_storage().nbytes() for b in model.buffers())
    engine = EngineConfig(model=str(path), kv_cache_memory_bytes=1)
    shape = read_shape(str(path))
    assert estimate_need(engine, shape, "cpu", available_ram=0) == {"cpu": held + 1}
    on_cuda = 0
    for t in gguf.GGUFReader(path).tensors:
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            on_cuda += int(t.n_elements) * 2
        elif kind == "IQ4_XS":
            on_cuda += reencoded(kind, np.asarray(t.data).reshape(int(t.shape[1]), -1)).nbytes
        else:
            on_cuda += int(t.n_bytes)
    assert estimate_need(engine, shape, "cuda", available_ram=0) == {"cuda:0": on_cuda + 1}


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
