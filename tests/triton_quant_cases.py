"""The cases tests/test_triton_quant.py checks: the Triton matmul over packed weights
(llmd.gpu.layers.quant.triton_quant_mm) against x times the weight dequantized by an
independent reference — the gguf package's numpy dequantizer for GGUF blocks, torch's
float8 conversion for FP8 (tests/quant_reference.py), AutoAWQ's / AutoGPTQ's layouts
for AWQ and GPTQ — in float64. Run as a script in a fresh process (Triton's interpreter
is chosen when triton is first imported):

    TRITON_INTERPRET=1 python tests/triton_quant_cases.py [CASE ...]

or compiled on a GPU (`--device cuda`, kernel_runs.py); one JSON line per case:
{"case", "err", "tol"} or {"case", "error"}.

`err` is the largest |out - ref| / (|ref| + |x| @ |w|^T / 64): relative to the result,
with a floor at 1/64 of the sum of the products' sizes where terms cancel. The
reference weight is the dequantized one, on the tl.dot path in bf16 / fp16 rounded to
that dtype (as the dequantized model's is, and as the kernel rounds it). fp32 results
(the GEMV, and tl.dot in IEEE fp32) are held to 1e-5: only the summation order differs;
bf16 and fp16 results to 2^-6: one rounding of the output (the interpreter truncates,
2^-7). A wrongly decoded value is ~1/K of the size sum (K <= 512 here), an eighth or more
of the floor: far above either.
"""
from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable

import numpy as np
import torch
from kernel_runs import script_device

DEVICE = torch.device("cpu")  # where the cases run (main sets it from --device)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -6}
# (rows of x, dtype, K splits): GEMV, GEMV split-K, tl.dot in bf16 with split-K (3 rows
# padded to 16), tl.dot in fp32, tl.dot in bf16 with split-K
RUNS = ((1, torch.float32, None), (1, torch.bfloat16, 2), (3, torch.bfloat16, 2), (17, torch.float32, None),
        (17, torch.bfloat16, 2))
N = 37  # weight rows: odd, over two BN tiles of the GEMV
# Columns: 32-weight types over a K tail (160 = 1.25 tiles of 128), K-quants two super-blocks.
COLS = {"Q8_0": 160, "Q4_0": 160, "Q4_1": 160, "Q5_0": 160, "Q5_1": 160, "Q2_K": 512, "Q3_K": 512, "Q4_K": 512,
        "Q5_K": 512, "Q6_K": 256, "IQ4_NL": 160}


def _err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The module doc's err of out against x @ w^T (float64)."""
    assert not torch.isnan(out).any(), "NaN in the output"
    x64, w64 = x.double().cpu(), w.double().cpu()
    ref = x64 @ w64.T
    floor = x64.abs() @ w64.abs().T / 64
    return ((out.double().cpu() - ref).abs() / (ref.abs() + floor + 1e-300)).max().item()


def _runs(mm: Callable[[torch.Tensor, int | None], torch.Tensor], w: torch.Tensor, seed: int,
          runs=RUNS) -> list[dict]:
    """Each run's err against x times `w`, or on the tl.dot path in bf16 / fp16 times `w`
    rounded to that dtype (what the dequantized model multiplies)."""
    from llmd.gpu.layers.quant.quant_tiles import GEMV_MAX_ROWS

    gen = torch.Generator().manual_seed(seed)
    results = []
    for rows, dtype, split in runs:
        x = torch.randn(rows, w.shape[1], generator=gen).to(dtype).to(DEVICE)
        out = mm(x, split)
        assert out.dtype == dtype and tuple(out.shape) == (rows, w.shape[0]), (out.dtype, tuple(out.shape))
        ref_w = w.to(dtype) if rows > GEMV_MAX_ROWS else w
        results.append({"rows": rows, "dtype": str(dtype).removeprefix("torch."), "split": split,
                        "err": _err(out, x, ref_w), "tol": TOL[dtype]})
    return results


def gguf_case(quant: str) -> list[dict]:
    import gguf

    from llmd.gpu.layers.quant.cuda_matmul import gguf_quant_weight
    from llmd.gpu.layers.quant.gguf_planes import to_planes
    from llmd.gpu.layers.quant.triton_quant_mm import quant_matmul
    from llmd_tools.gguf_blocks import random_blocks

    cols = COLS[quant]
    blocks = random_blocks(quant, N, cols, seed=len(quant) + cols)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, quant)))
    weight = gguf_quant_weight(to_planes(blocks, quant, cols).to(DEVICE), quant, cols)
    return _runs(lambda x, split: quant_matmul(x, weight, split_k=split), ref.reshape(N, cols), seed=cols)


def fp16_case() -> list[dict]:
    """fp16 activations through both paths (one type: the dtype plumbing is shared)."""
    import gguf

    from llmd.gpu.layers.quant.cuda_matmul import gguf_quant_weight
    from llmd.gpu.layers.quant.gguf_planes import to_planes
    from llmd.gpu.layers.quant.triton_quant_mm import quant_matmul
    from llmd_tools.gguf_blocks import random_blocks

    blocks = random_blocks("Q4_K", N, 256, seed=5)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_K))
    weight = gguf_quant_weight(to_planes(blocks, "Q4_K", 256).to(DEVICE), "Q4_K", 256)
    return _runs(lambda x, split: quant_matmul(x, weight, split_k=split), ref.reshape(N, 256), seed=6,
                 runs=((1, torch.float16, None), (17, torch.float16, None)))


def tiles_case() -> list[dict]:
    """The tiles bench_quant_gpu's sweep may pick (narrow and wide BN, BK 256, 2 and 8
    warps, a 32-row dot tile over 17 rows, three stages in flight, the scale fields
    loaded a tile at a time) compute the same product: Q4_K over two super-blocks, one
    and 17 rows."""
    import gguf

    from llmd.gpu.layers.quant.cuda_matmul import gguf_quant_weight
    from llmd.gpu.layers.quant.gguf_planes import to_planes
    from llmd.gpu.layers.quant.quant_tiles import Tiles
    from llmd.gpu.layers.quant.triton_quant_mm import quant_matmul
    from llmd_tools.gguf_blocks import random_blocks

    blocks = random_blocks("Q4_K", N, 512, seed=11)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_K)).reshape(N, 512)
    weight = gguf_quant_weight(to_planes(blocks, "Q4_K", 512).to(DEVICE), "Q4_K", 512)
    results = []
    for tiles in (Tiles(1, 16, 256, False, 2), Tiles(1, 64, 128, False, 8), Tiles(32, 32, 256, True, 8),
                  Tiles(1, 8, 128, False, 4, 3), Tiles(16, 32, 128, True, 4, 3),
                  Tiles(1, 32, 128, False, 4, 3, True), Tiles(16, 32, 128, True, 4, 3, True)):  # scale words
        runs = ((17, torch.float32, None), (17, torch.bfloat16, 2)) if tiles.dot else ((1, torch.float32, 2),)
        for r in _runs(lambda x, split: quant_matmul(x, weight, split_k=split, tiles=tiles), ref, seed=12,
                       runs=runs):
            results.append({**r, "tiles": str(tiles)})
    return results


def fp8_case(strategy: str) -> list[dict]:
    """FP8 W8A16 through the Triton kernel: a weight quantized by llmd_tools'
    quantize_checkpoint per tensor, per channel, or per 16x32 block, against
    quant_reference.fp8_dense (torch's float8 conversion times the scales)."""
    from quant_reference import fp8_dense

    from llmd.gpu.layers.quant.fp8 import fp8_rows
    from llmd.gpu.layers.quant.triton_quant_mm import QuantWeight, quant_matmul
    from llmd_tools.quantize_checkpoint import fp8_tensors

    block = (16, 32) if strategy == "block" else None
    w = torch.randn(N, 160, generator=torch.Generator().manual_seed(3)) * 0.05
    t = fp8_tensors(w, strategy, block)
    scale = t.get("weight_scale", t.get("weight_scale_inv"))
    rows = fp8_rows(t["weight"], scale, block, 0, 0, "test")
    weight = QuantWeight("FP8", N, 160, rows.bytes.to(DEVICE), rows.scales.to(DEVICE),
                         fp8_group=160 // rows.scales.shape[1])
    return _runs(lambda x, split: quant_matmul(x, weight, split_k=split), fp8_dense(t["weight"], scale, block), seed=4)


def fp8_bytes_case() -> list[dict]:
    """Every e4m3 byte (NaN 0x7F / 0xFF, subnormals, both zeros) decoded in the kernel:
    row r all byte r, times a one-hot x, equals torch's float8 value of r times its scale."""
    from llmd.gpu.layers.quant.triton_quant_mm import QuantWeight, quant_matmul

    data = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 32)
    scales = torch.linspace(0.5, 2.0, 256).reshape(256, 1)
    weight = QuantWeight("FP8", 256, 32, data.to(DEVICE), scales.to(DEVICE), fp8_group=32)
    x = torch.zeros(1, 32)
    x[0, 5] = 1.0
    out = quant_matmul(x.to(DEVICE), weight).cpu()[0]
    ref = data[:, 0].view(torch.float8_e4m3fn).float() * scales[:, 0]
    same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    err = (out[finite] - ref[finite]).abs().max().item() if same_nan else float("inf")
    return [{"rows": 1, "dtype": "float32", "split": None, "err": err, "tol": 0.0}]


def int_groups_case(name: str) -> list[dict]:
    """An AWQ / GPTQ layer finalized as on CPU (transcoded into GGUF blocks, act-order
    columns sorted) and multiplied by the CUDA matmul (quant/cuda_matmul.py) with its
    bias, against quant_reference's dense weight."""
    from test_quant_kernels import INT_CASES, _int_checkpoint, _layer

    from llmd.gpu.layers.quant.cuda_matmul import cuda_quantized_matmul

    opts, rows, cols = next((o, r, c) for n, o, r, c in INT_CASES if n == name)
    scheme, tensors, dense = _int_checkpoint(opts, rows, cols)
    layer = _layer(scheme, tensors, rows, cols, bias=False).to(DEVICE)
    mm = cuda_quantized_matmul(layer)
    return _runs(lambda x, split: mm(x), dense, seed=rows)


def fused_layer_case() -> list[dict]:
    """A [gate | up] projection whose parts are Q4_K and Q6_K (llama.cpp's _M mixes), with
    a bias, through TritonGGUFMatmul: each part laid out as planes in place, once."""
    import gguf

    from llmd.gpu.layers.linear import MergedColumnParallelLinear
    from llmd.gpu.layers.quant.cuda_matmul import TritonGGUFMatmul
    from llmd.gpu.layers.quant.gguf_planes import from_planes
    from llmd_tools.gguf_blocks import random_blocks

    cols, size = 256, 19
    layer = MergedColumnParallelLinear(cols, size, bias=True)
    layer.use_packed({0: "Q4_K", 1: "Q6_K"})
    parts = [random_blocks(q, size, cols, seed=i) for i, q in enumerate(("Q4_K", "Q6_K"))]
    for shard, blocks in enumerate(parts):
        layer.load("weight", layer.weight, blocks, shard)
    bias = torch.randn(2 * size, generator=torch.Generator().manual_seed(9))
    layer.bias.data.copy_(bias)
    layer = layer.to(DEVICE)
    ref = torch.cat([torch.from_numpy(gguf.quants.dequantize(b.numpy(), getattr(gguf.GGMLQuantizationType, q)))
                     .reshape(size, cols) for b, q in zip(parts, ("Q4_K", "Q6_K"))])
    mm = TritonGGUFMatmul(layer)
    TritonGGUFMatmul(layer)  # a second attach (a tied module) must not lay the planes out again
    laid_out = [from_planes(layer.weight.reshape(-1)[p.offset:p.offset + b.numel()], p.quant, cols).cpu()
                for p, b in zip(layer.packed_parts, parts)]
    assert all(torch.equal(a, b) for a, b in zip(laid_out, parts)), "the planes do not hold the part's blocks"
    results = []
    for r in _runs(lambda x, split: mm(x) - bias.to(x.dtype).to(DEVICE), ref, seed=8,
                   runs=((1, torch.float32, None), (17, torch.float32, None))):
        results.append(r)
    return results


def tied_model_case() -> list[dict]:
    """A whole GGUF model (tiny llama, Q4_1, its vocabulary table tied to the LM head),
    loaded packed on CPU with the torch paths (LLMD_CPU_KERNELS=0: the file's layout),
    then given the CUDA kernels (attach_cuda_gguf_kernels, the planes laid out in place):
    the same logits, 17 prefill rows (tl.dot) and the last row alone (GEMV), and the
    embedding's lookups read back through the planes. Interpreter only (on a GPU,
    test_quant_cuda_models loads such files on CUDA)."""
    import os
    import tempfile
    from pathlib import Path

    from gguf import GGMLQuantizationType as T
    from gguf_fixtures import write_gguf

    from llmd.gpu.layers.attention import AttentionMetadata, new_model_kv_caches
    from llmd.gpu.layers.attention_backends import metadata_builder
    from llmd.gpu.layers.linear import VocabParallelEmbedding
    from llmd.gpu.layers.quant.cuda_matmul import attach_cuda_gguf_kernels
    from llmd.gpu.models.loader import load_model
    from llmd_tools.make_model import build_model

    if DEVICE.type != "cpu":
        return []
    os.environ["LLMD_CPU_KERNELS"] = "0"
    root = Path(tempfile.mkdtemp(prefix="llmd-tied-"))
    hf = build_model(root / "hf", "llama", "tiny", llama3_rope=False, intermediate_size=192, tie_word_embeddings=True)
    model = load_model(write_gguf(hf, root / "tied.gguf", T.Q4_1), torch.float32, DEVICE, 128)
    tokens = [1, 7, 42, 99, 3, 250, 17, 8, 8, 64, 5, 11, 90, 2, 33, 71, 18]

    def logits() -> tuple[torch.Tensor, torch.Tensor]:
        n = len(tokens)
        caches = new_model_kv_caches(model, 8, 16, torch.float32, DEVICE)
        md = AttentionMetadata(torch.arange(n), 0, None, None, [(0, n, 0, torch.arange(8))])
        metadata_builder(model, 16, DEVICE).build(md)
        with torch.no_grad():
            hidden = model(torch.tensor(tokens), torch.arange(n), caches, md)
            return model.compute_logits(hidden), model.compute_logits(hidden[-1:])

    ref_all, ref_last = logits()
    attach_cuda_gguf_kernels(model, torch.float32)
    (table,) = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    assert table.read_rows is not None, "the tied table does not read through the planes"
    got_all, got_last = logits()
    results = []
    for rows, got, ref in ((17, got_all, ref_all), (1, got_last, ref_last)):
        err = ((got.double() - ref.double()).abs() / (ref.double().abs() + ref.double().abs().mean())).max().item()
        results.append({"rows": rows, "dtype": "float32", "split": None, "err": err, "tol": 1e-4})
    return results


def _cases() -> dict[str, Callable[[], list[dict]]]:
    from llmd.gpu.layers.quant.gguf_planes import GPU_TYPES

    cases: dict[str, Callable[[], list[dict]]] = {f"gguf-{q}": (lambda q=q: gguf_case(q)) for q in GPU_TYPES}
    cases["gguf-fp16"] = fp16_case
    cases["gguf-tiles"] = tiles_case
    cases.update({f"fp8-{s}": (lambda s=s: fp8_case(s)) for s in ("tensor", "channel", "block")})
    cases["fp8-every-byte"] = fp8_bytes_case
    cases.update({f"int-{n}": (lambda n=n: int_groups_case(n))
                  for n in ("awq-g32", "gptq4-sym-v1", "gptq4-asym-v2-act-order", "gptq8-sym-act-order")})
    cases["fused-mixed-types"] = fused_layer_case
    cases["model-tied-q4_1"] = tied_model_case
    return cases


CASE_NAMES = ("gguf-Q8_0", "gguf-Q4_0", "gguf-Q4_1", "gguf-Q5_0", "gguf-Q5_1", "gguf-Q2_K", "gguf-Q3_K", "gguf-Q4_K",
              "gguf-Q5_K", "gguf-Q6_K", "gguf-IQ4_NL", "gguf-fp16", "gguf-tiles", "fp8-tensor", "fp8-channel", "fp8-block", "fp8-every-byte",
              "int-awq-g32", "int-gptq4-sym-v1", "int-gptq4-asym-v2-act-order", "int-gptq8-sym-act-order",
              "fused-mixed-types", "model-tied-q4_1")


def main(args: list[str]) -> None:
    global DEVICE
    DEVICE = script_device(args)
    np.seterr(all="ignore")  # the interpreter's int32 shifts wrap on purpose (e4m3's sign bit)
    cases = _cases()
    assert tuple(cases) == CASE_NAMES, "CASE_NAMES is out of date"
    for name in args or list(cases):
        try:
            print(json.dumps({"case": name, "runs": cases[name]()}), flush=True)
        except Exception:  # one case's failure is its result; the others still run
            print(json.dumps({"case": name, "error": traceback.format_exc()[-3000:]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
