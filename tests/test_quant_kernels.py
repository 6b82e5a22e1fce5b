"""The packed layers of AWQ, GPTQ and FP8 checkpoints on their own (layers/quant/): the
exact transcoding of AWQ/GPTQ groups into GGUF blocks, and every matmul (the C++
kernels for decode rows, dequantized slices and a GEMM for more, the torch paths
without kernels) against x times the weight dequantized by tests/quant_reference.py
from the format's layout; the FP8 kernel's decoding of every e4m3 byte against torch's
float8 conversion, in the AVX-512 build and the portable one; and the
quantization_config refusals, by field."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmd.gpu.layers.cpu.cpu_kernels import fp8_ops, gguf_ops
from llmd.gpu.layers.gguf_quant import dequantize as gguf_dequantize
from llmd.gpu.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from llmd.gpu.layers.quant.fp8 import KERNEL_MAX_ROWS
from llmd.gpu.layers.quant.int_groups import awq_groups, gptq_groups
from llmd.gpu.layers.quant.quant_linear import finalize, quantized_matmul, use_quantized
from llmd.gpu.layers.quant.scheme import quant_scheme
from llmd_tools.quantize_checkpoint import awq_tensors, fp8_tensors, gptq_tensors, options, quantization_config
from quant_reference import awq_dense, fp8_dense, gptq_dense

# (name, tool options, rows, cols): each layout's corners
INT_CASES = [
    ("awq-g32", dict(method="awq", group_size=32), 48, 128),
    ("awq-g128", dict(method="awq", group_size=128), 40, 256),
    ("gptq4-sym-v1", dict(method="gptq", group_size=64), 48, 128),
    ("gptq4-asym-v1", dict(method="gptq", group_size=32, sym=False), 48, 128),
    ("gptq4-asym-v2-act-order", dict(method="gptq", group_size=32, sym=False, gptq_v2=True, act_order=True), 48, 128),
    ("gptq8-sym-act-order", dict(method="gptq", bits=8, group_size=32, act_order=True), 40, 96),
    ("gptq4-per-channel", dict(method="gptq", group_size=-1), 32, 160),
]
FP8_CASES = [("fp8-tensor", "tensor", None), ("fp8-channel", "channel", None), ("fp8-block", "block", (16, 32))]


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[:, 0] = 0.0  # a column of zeros: a group whose minimum is 0 (AWQ/GPTQ asymmetric zero point 0)
    return w


def _int_checkpoint(opts: dict, rows: int, cols: int, seed: int = 0):
    """(scheme, the checkpoint tensors of one module, its reference [out, in])."""
    args = options(**opts)
    w = _weights(rows, cols, seed)
    group = args.group_size if args.group_size > 0 else cols
    if args.method == "awq":
        tensors = awq_tensors(w, group)
        dense = awq_dense(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    else:
        order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed + 1)) if args.act_order else None
        tensors = gptq_tensors(w, args.bits, group, args.sym, order, v1=not args.gptq_v2)
        dense = gptq_dense(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], args.bits,
                           not args.gptq_v2, group)
    scheme = quant_scheme(type("Config", (), {"quantization_config": quantization_config(args)}))
    return scheme, tensors, dense


@pytest.mark.parametrize("name,opts,rows,cols", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_groups_become_gguf_blocks_exactly(name, opts, rows, cols):
    """Unpacked and transcoded, a weight's blocks dequantize (gguf_quant, equal to the gguf
    package) to exactly what the format's layout says, its columns in the sorted order."""
    scheme, t, dense = _int_checkpoint(opts, rows, cols)
    group = scheme.group_size if scheme.group_size > 0 else cols
    if scheme.method == "awq":
        groups = awq_groups(t["qweight"], t["qzeros"], t["scales"], group)
    else:
        groups = gptq_groups(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], scheme.bits, group,
                             scheme.zeros_minus_one)
    assert torch.equal(groups.dequantize(), dense)
    sorted_groups, order = groups.sorted_by_group()
    assert (order is not None) == scheme.act_order
    quant, blocks = sorted_groups.gguf_rows(name)
    expected = {("awq", 4): "Q5_0", ("gptq", 8): "Q8_0"}.get((scheme.method, scheme.bits),
                                                             "Q4_0" if opts.get("sym", True) else "Q5_0")
    assert quant == expected
    got = gguf_dequantize(blocks, quant, cols)
    assert torch.equal(got, dense if order is None else dense[:, order])


@pytest.mark.parametrize("name", ["gptq4-asym-v2-act-order", "gptq8-sym-act-order"])
def test_a_share_of_act_order_columns_is_padded_to_whole_blocks(name):
    """A rank's share of act-order input columns (tensor parallelism) holds any number of
    each group's columns: sorted by group, each group's run is padded to whole 32-column
    blocks with weights exactly 0, and the blocks dequantize to the share's columns in
    the order x is taken — so x[:, share][:, order] @ blocks^T = x[:, share] @ W[:, share]^T."""
    opts, rows, cols = next((o, r, c) for n, o, r, c in INT_CASES if n == name)
    scheme, t, dense = _int_checkpoint(opts, rows, cols)
    pack = 32 // scheme.bits
    for c, d in ((0, cols // 2), (cols // 2, cols)):
        share = gptq_groups(t["qweight"][c // pack:d // pack], t["qzeros"], t["scales"], t["g_idx"][c:d],
                            scheme.bits, scheme.group_size, scheme.zeros_minus_one, all_groups=True)
        share.check_shape(rows, d - c, name)
        assert torch.equal(share.dequantize(), dense[:, c:d])
        padded, order = share.sorted_by_group()
        assert order is not None and order.numel() > d - c and order.numel() % 32 == 0  # padding happened
        quant, blocks = padded.gguf_rows(name)
        got = gguf_dequantize(blocks, quant, order.numel())
        first = torch.tensor([int(order[p]) not in order[:p].tolist() for p in range(order.numel())])
        assert sorted(order[first].tolist()) == list(range(d - c))  # every column once, then copies
        assert torch.equal(got[:, first], dense[:, c:d][:, order[first]])
        assert bool((got[:, ~first] == 0).all())
        x = torch.randn(3, d - c, dtype=torch.float64)
        torch.testing.assert_close(x[:, order] @ got.double().t(), x @ dense[:, c:d].double().t())


def _layer(scheme, tensors: dict, rows: int, cols: int, bias: bool = True) -> ReplicatedLinear:
    layer = ReplicatedLinear(cols, rows, bias=bias)
    if bias:
        layer.bias.data = torch.randn(rows, generator=torch.Generator().manual_seed(7))
    use_quantized(layer, scheme, {None: "test.proj"})
    for name, t in tensors.items():
        layer.quant_method.load(name, None, t, None)
    finalize(layer)
    return layer


def _ops(kernel: bool):
    gguf, fp8 = (gguf_ops(), fp8_ops()) if kernel else (None, None)
    if kernel and (gguf is None or fp8 is None):
        pytest.skip("the CPU kernels cannot be built here")
    return gguf, fp8


# Error bound relative to |x| @ |w|^T: float32 summation (and the x16 kernel's three int8
# passes, ~3e-7 of it), or a bfloat16 result and a bfloat16 weight on the GEMM path. A
# wrongly decoded weight errs by ~1/K of that sum (K <= 256 here): far more.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}


def _check_products(layer, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
    gen = torch.Generator().manual_seed(3)
    cols = dense.shape[1]
    for rows in (1, 5, KERNEL_MAX_ROWS, 40):
        x = torch.randn(rows, cols, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            if bias is not None:
                layer.bias.data = bias.to(dtype)
            got = layer(x.to(dtype))
            assert got.dtype == dtype and got.shape == (rows, dense.shape[0])
            xd = x.to(dtype).double()
            exact = xd @ dense.double().t() + (0 if bias is None else layer.bias.data.double())
            bound = TOLERANCE[dtype] * (xd.abs() @ dense.double().abs().t() + exact.abs()) + 1e-12
            assert ((got.double() - exact).abs() <= bound).all(), (rows, dtype)
    assert layer(torch.randn(2, 3, cols)).shape == (2, 3, dense.shape[0])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name,opts,rows,cols", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_the_int_group_matmul_equals_the_dequantized_reference(name, opts, rows, cols, kernel):
    """Decode rows (the GGUF kernels; x16 in three passes, float32's precision) and
    prefill rows (dequantized slices and a GEMM), act-order columns permuted, bias added."""
    gguf, fp8 = _ops(kernel)
    scheme, tensors, dense = _int_checkpoint(opts, rows, cols)
    layer = _layer(scheme, tensors, rows, cols)
    passes = 3 if gguf is not None and gguf.x16 else 0  # float32's precision: TOLERANCE
    layer.kernel = quantized_matmul(layer, gguf, passes, fp8)
    _check_products(layer, dense, layer.bias.data.clone())


@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "torch"])
def test_act_order_groups_of_any_size_are_padded_to_whole_blocks(kernel):
    """A GPTQ checkpoint whose g_idx gives a group 31 columns and the next 33 (not whole
    32-column blocks; refused before): the layer pads each group's run with zero weights
    and computes the dequantized reference; an expert (whose rows must all be as wide)
    refuses it by name."""
    from llmd.gpu.models.quant_plan import expert_blocks

    gguf, fp8 = _ops(kernel)
    opts, rows, cols = next((o, r, c) for n, o, r, c in INT_CASES if n == "gptq4-asym-v2-act-order")
    scheme, tensors, _ = _int_checkpoint(opts, rows, cols)
    g_idx = tensors["g_idx"].clone()
    g_idx[int(torch.nonzero(g_idx == 0)[0])] = 1  # group 0: 31 columns, group 1: 33
    tensors = {**tensors, "g_idx": g_idx}
    dense = gptq_dense(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, scheme.bits,
                       scheme.zeros_minus_one, scheme.group_size)
    layer = _layer(scheme, tensors, rows, cols)
    (order, _), = layer.int_units
    assert getattr(layer, order).numel() == cols + 32  # one padding column for group 0, 31 for group 1
    layer.kernel = quantized_matmul(layer, gguf, 3 if gguf is not None and gguf.x16 else 0, fp8)
    _check_products(layer, dense, layer.bias.data.clone())
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj: its g_idx groups are not whole 32-column blocks"):
        expert_blocks(scheme, "experts.0.down_proj", lambda name: tensors[name.rsplit(".", 1)[1]],
                      lambda name: True, cols, "Q5_0")


def test_fused_parts_with_their_own_orders_and_types():
    """gate and up of one projection quantized apart (GPTQ act-order with an order each,
    one symmetric, one not): each part keeps its own blocks, scales and column order."""
    parts, dense_parts = {}, []
    for shard, sym in ((0, True), (1, False)):
        scheme, tensors, dense = _int_checkpoint(dict(method="gptq", group_size=32, sym=sym, gptq_v2=True,
                                                      act_order=True), 64, 96, seed=shard)
        parts[shard] = tensors
        dense_parts.append(dense)
    layer = MergedColumnParallelLinear(96, 64, bias=False)
    use_quantized(layer, scheme, {0: "mlp.gate_proj", 1: "mlp.up_proj"})
    for shard, tensors in parts.items():
        for name, t in tensors.items():
            layer.quant_method.load(name, None, t, shard)
    finalize(layer)
    assert [order for order, _ in layer.int_units] == ["input_order_0", "input_order_1"]
    assert [p.quant for _, unit in layer.int_units for p in unit] == ["Q4_0", "Q5_0"]
    gguf, fp8 = _ops(gguf_ops() is not None)
    layer.kernel = quantized_matmul(layer, gguf, 0, fp8)
    _check_products(layer, torch.cat(dense_parts), None)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name,style,block", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_the_fp8_matmul_equals_the_dequantized_reference(name, style, block, kernel):
    gguf, fp8 = _ops(kernel)
    rows, cols = 40, 96
    w = _weights(rows, cols, 0)
    tensors = fp8_tensors(w, style, block or (128, 128))
    tensors.pop("input_scale", None)
    scale_name = "weight_scale_inv" if style == "block" else "weight_scale"
    dense = fp8_dense(tensors["weight"], tensors[scale_name], block)
    args = options(method="fp8", fp8_style=style, block=block or (128, 128))
    scheme = quant_scheme(type("Config", (), {"quantization_config": quantization_config(args)}))
    layer = _layer(scheme, tensors, rows, cols)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scales.shape == (rows, cols // 32 if block else 1)
    layer.kernel = quantized_matmul(layer, gguf, 0, fp8)
    assert (layer.kernel.ops is not None) == kernel
    _check_products(layer, dense, layer.bias.data.clone())


_E4M3_CHECK = r"""
import json, sys, torch
sys.path[:0] = json.loads(sys.argv[1])
from llmd.gpu.layers.cpu.cpu_kernels import fp8_ops, vector_isa
assert vector_isa() == sys.argv[2], vector_isa()
ops = fp8_ops()
every = torch.arange(256, dtype=torch.uint8).repeat(3, 1)  # every byte, three rows
scales = torch.tensor([[1.0], [0.5], [-3.0]])
values = every.view(torch.float8_e4m3fn).float() * scales
finite = ~values.isnan()
got = ops.dequantize(every.contiguous(), scales)
assert torch.equal(got[finite], values[finite]) and got[~finite].isnan().all()
w = every.clone()
w[(w & 0x7F) == 0x7F] = 0  # no NaN in a product
x = torch.randn(9, 256)
exact = x.double() @ (w.view(torch.float8_e4m3fn).double() * scales.double()).t()
for rows in (1, 9):
    error = (ops.mm(x[:rows].contiguous(), w, scales).double() - exact[:rows]).abs().max()
    assert error <= 1e-5 * exact.abs().max(), float(error)
print("e4m3 ok")
"""


@pytest.mark.parametrize("isa", ["native", "portable"])
def test_the_fp8_kernel_decodes_every_byte_as_torch_does(isa):
    """Every e4m3 byte (subnormals, the largest, both zeros; 0x7F/0xFF are NaN) as torch's
    float8 conversion gives it, times its row's scale, in this CPU's build and in the
    portable one a CPU without AVX-512 gets (a process whose torch reports no vector ISA)."""
    if fp8_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")
    from llmd.gpu.layers.cpu.cpu_kernels import vector_isa

    env = dict(os.environ, LLMD_KERNEL_BUILD_TIMEOUT="570")  # as test_gguf_packed's portable build
    if isa == "portable":
        env["ATEN_CPU_CAPABILITY"] = "default"
    want = "DEFAULT" if isa == "portable" else vector_isa()
    done = subprocess.run([sys.executable, "-c", _E4M3_CHECK, json.dumps(sys.path), want], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "e4m3 ok" in done.stdout, done.stderr[-3000:]


REFUSED = [
    ({"quant_method": "bitsandbytes"}, r"quant_method='bitsandbytes' is not implemented by llmd \(implemented: awq"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, r"bits=3 is not implemented by llmd for awq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version='gemv' is not implemented"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, r"zero_point=False"),
    ({"quant_method": "awq", "bits": 4, "group_size": 48}, r"group_size=48 is not implemented .*multiple of 32"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits=3 is not implemented by llmd for gptq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*": {}}}, r"dynamic="),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False}, r"sym=False .*9-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, r"group_size=16"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 8]}, r"weight_block_size=\[128, 8\]"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, r"scale_fmt='ue8m0'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     r"format='pack-quantized' is not implemented by llmd for compressed-tensors"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8,
                                                                                          "dynamic": True},
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}}},
     r"kv_cache_scheme.dynamic=True"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}}}},
     r"config_groups.g.weights.strategy='group' is not implemented"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}},
     r"config_groups.g.weights.type='int'"),
]


@pytest.mark.parametrize("qc,message", REFUSED, ids=[f"{c['quant_method']}-{i}" for i, (c, _) in enumerate(REFUSED)])
def test_a_quantization_llmd_does_not_implement_is_refused_by_field(qc, message):
    with pytest.raises(ValueError, match=message):
        quant_scheme(type("Config", (), {"quantization_config": qc}))
