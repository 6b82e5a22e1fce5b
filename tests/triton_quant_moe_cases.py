"""The cases tests/test_triton_quant_moe.py checks: the grouped kernel over packed experts
(llmd.gpu.layers.quant.triton_quant_moe) against moe_reference on the experts' weights
dequantized by an independent reference (the gguf package's numpy dequantizer; torch's
float8 conversion times the scales, tests/quant_reference.py), with ragged routing
(experts that get no token, one with several row blocks), a decode token (the GEMV
tile: BM 1, a program per pair), gate, up and down in three different K-quant types,
GPTQ act-order experts (each part its own input column order), K with a tail tile,
split-K, bf16 (the reference in bf16 on the weights rounded to it,
as the kernel's tl.dot rounds them), and a whole MoE GGUF model given its CUDA kernels
after a CPU load (the planes laid out in place, every layer's experts through the
kernel). Run as a script in a fresh process (Triton's interpreter is chosen when triton
is first imported; kernel_runs.py):

    TRITON_INTERPRET=1 python tests/triton_quant_moe_cases.py [CASE ...]

or compiled on a GPU (`--device cuda`); one JSON line per case: {"case", "err", "tol",
...} or {"case", "error"}. `err` is max |out - ref| over max |ref|: fp32 differs from the
float64 reference in summation order only (1e-5); bf16 by the roundings of the gate/up
output, the weights and the result (3e-2, as fused_moe_cases' bf16 against its own
reference). A wrongly decoded block or a row sent to the wrong expert moves the output by
its whole size.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch
from kernel_runs import script_device

DEVICE = torch.device("cpu")  # where the cases run (main sets it from --device)
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
SKEWED = (8.0, 0.0, 1.0, 4.0, 0.0, 0.0, 0.5, 0.0)  # experts 1, 4, 5, 7 get no token


@dataclass(frozen=True)
class Case:
    tokens: int
    types: tuple[str, str, str]  # gate, up, down
    hidden: int = 256
    inter: int = 256
    experts: int = 8
    top_k: int = 2
    dtype: str = "float32"
    load: tuple[float, ...] | None = None
    split_k: int | None = None
    ordered: bool = False  # GPTQ act-order: every part its own input column order


CASES = {
    "kquants-decode-one-token": Case(1, ("Q4_K", "Q5_K", "Q6_K")),
    "kquants-ragged-split-k": Case(37, ("Q4_K", "Q5_K", "Q6_K"), load=SKEWED, split_k=2),
    "q8_0-batch-4": Case(4, ("Q8_0", "Q8_0", "Q8_0"), hidden=64, inter=96),
    "q4_0-bf16-ragged-tail": Case(37, ("Q4_0", "Q4_0", "Q4_0"), hidden=64, inter=160, dtype="bfloat16",
                                  load=SKEWED),
    "q5_0-many-rows": Case(90, ("Q5_0", "Q5_0", "Q5_0"), hidden=64, inter=64, experts=4, top_k=1,
                           load=(6.0, 1.0, 0.0, 2.0)),
    "fp8-block-ragged": Case(13, ("FP8", "FP8", "FP8"), hidden=64, inter=96, load=SKEWED),
    "fp8-channel-decode": Case(1, ("FP8", "FP8", "FP8"), hidden=64, inter=96),
    "act-order-q5_0-ragged": Case(37, ("Q5_0", "Q5_0", "Q5_0"), hidden=64, inter=96, load=SKEWED, ordered=True),
    "act-order-q4_0-decode": Case(1, ("Q4_0", "Q4_0", "Q4_0"), hidden=64, inter=96, ordered=True),
}


def _routing(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    load = torch.tensor(case.load if case.load is not None else [1.0] * case.experts)
    ids = torch.multinomial(load.expand(case.tokens, -1), case.top_k, replacement=False, generator=gen)
    weights = torch.rand(case.tokens, case.top_k, generator=gen) + 0.1
    return weights / weights.sum(dim=-1, keepdim=True), ids


def _gguf_part(quant: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed rows [experts * rows, bytes], their dequantized weight float32) of one type."""
    import gguf

    from llmd_tools.gguf_blocks import random_blocks

    blocks = random_blocks(quant, rows, cols, seed=seed)
    dense = gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, quant))
    return blocks, torch.from_numpy(np.asarray(dense, dtype=np.float32)).reshape(rows, cols)


def _gguf_experts(case: Case, seed: int):
    """An ExpertWeights holding every expert packed as the case's types, and its dequantized
    w13 [experts, 2 inter, hidden], w2 [experts, hidden, inter]."""
    from llmd.gpu.layers.mlp import ExpertWeights

    from llmd.gpu.models.expert_sources import OrderedPackedSource

    layer = ExpertWeights(case.experts, case.hidden, case.inter, None)
    gate, up, down = case.types
    layer.use_packed({(e, p): q for e in range(case.experts) for p, q in ((0, gate), (1, up))}, "w13")
    layer.use_packed(down, "w2")
    if case.ordered:
        layer.use_input_orders()
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.empty(case.experts, 2 * case.inter, case.hidden)
    w2 = torch.empty(case.experts, case.hidden, case.inter)

    def load(name: str, shard, quant: str, rows: int, cols: int, target: torch.Tensor, part_seed: int) -> None:
        blocks, dense = _gguf_part(quant, rows, cols, part_seed)
        if case.ordered:  # the blocks hold x's columns in `order`: weight column k is x's column order[k]
            order = torch.randperm(cols, generator=gen).to(torch.int32)
            blocks = OrderedPackedSource(quant, blocks.numpy(), (rows, cols), order)
            target[:, order.long()] = dense
        else:
            target.copy_(dense)
        layer.load(name, getattr(layer, name), blocks, shard)

    for e in range(case.experts):
        for part, quant in ((0, gate), (1, up)):
            load("w13", (e, part), quant, case.inter, case.hidden, w13[e, part * case.inter:(part + 1) * case.inter],
                 seed + 10 * e + part)
        load("w2", e, down, case.hidden, case.inter, w2[e], seed + 10 * e + 2)
    return layer, w13, w2


def _fp8_experts(case: Case, seed: int, block: tuple[int, int] | None):
    """As _gguf_experts, FP8 (llmd_tools.quantize_checkpoint's e4m3 per channel, or per
    32 x 32 block), dequantized by quant_reference.fp8_dense."""
    from quant_reference import fp8_dense

    from llmd.gpu.layers.mlp import ExpertWeights
    from llmd.gpu.layers.quant.fp8 import fp8_rows
    from llmd.gpu.models.expert_sources import FP8Source
    from llmd_tools.quantize_checkpoint import fp8_tensors

    layer = ExpertWeights(case.experts, case.hidden, case.inter, None)
    for name in ("w13", "w2"):
        cols = layer.packed_columns(name)
        layer.use_fp8(name, 1 if block is None else cols // block[1])
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.empty(case.experts, 2 * case.inter, case.hidden)
    w2 = torch.empty(case.experts, case.hidden, case.inter)
    for e in range(case.experts):
        for name, shard, rows, cols, target in [("w13", (e, 0), case.inter, case.hidden, w13[e, :case.inter]),
                                                ("w13", (e, 1), case.inter, case.hidden, w13[e, case.inter:]),
                                                ("w2", e, case.hidden, case.inter, w2[e])]:
            t = fp8_tensors(torch.randn(rows, cols, generator=gen) * 0.05, "block" if block else "channel", block)
            scale = t.get("weight_scale", t.get("weight_scale_inv"))
            packed = fp8_rows(t["weight"], scale, block, 0, 0, "case")
            layer.load(name, getattr(layer, name), FP8Source("FP8", packed.bytes.numpy(), (rows, cols),
                                                            packed.scales), shard)
            target.copy_(fp8_dense(t["weight"], scale, block))
    return layer, w13, w2


def run_case(name: str, case: Case) -> dict:
    from llmd.gpu.layers.fused_ops import UNFUSED
    from llmd.gpu.layers.fused_moe import moe_reference
    from llmd.gpu.layers.quant.cuda_matmul import TritonPackedExperts
    from llmd.gpu.layers.quant.triton_quant_moe import moe_tiles, quant_fused_experts

    seed = len(name)
    if case.types[0] == "FP8":
        layer, w13, w2 = _fp8_experts(case, seed, (32, 32) if "block" in name else None)
    else:
        layer, w13, w2 = _gguf_experts(case, seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)
    weights, ids = _routing(case, gen)
    if dtype == torch.float32:
        ref = moe_reference(x.double(), w13.double(), w2.double(), weights.double(), ids)
    else:  # the kernel's tl.dot rounds the dequantized weights to bf16
        ref = moe_reference(x, w13.to(dtype), w2.to(dtype), weights, ids)
    experts = TritonPackedExperts(layer.to(DEVICE))
    out = quant_fused_experts(x.to(DEVICE), experts.gate_up, experts.down, case.experts, weights.to(DEVICE),
                              ids.to(DEVICE), "silu", UNFUSED, case.split_k).cpu()
    assert out.dtype == dtype and out.shape == (case.tokens, case.hidden), (out.dtype, out.shape)
    err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    tiles = moe_tiles(case.tokens * case.top_k, case.experts, case.types[0])
    return {"err": err, "tol": TOLERANCE[case.dtype], "gemv": not tiles.dot, "bm": tiles.bm,
            "expert_counts": torch.bincount(ids.flatten(), minlength=case.experts).tolist()}


def run_model() -> dict:
    """A tiny Qwen3-MoE GGUF (Q8_0 experts, Q4_0 attention), loaded packed on CPU with the
    torch paths (LLMD_CPU_KERNELS=0: the file's layout), then given the CUDA kernels
    (attach_cuda_gguf_kernels: the experts' and the linears' planes laid out in place):
    the same logits over 9 prefill rows and the last row alone. Interpreter only (on a
    GPU, test_quant_cuda_models loads such a file on CUDA)."""
    import tempfile
    from pathlib import Path

    from gguf import GGMLQuantizationType as T
    from gguf_fixtures import write_gguf

    from llmd.gpu.layers.mlp import ExpertWeights
    from llmd.gpu.layers.quant.cuda_matmul import attach_cuda_gguf_kernels
    from llmd.gpu.models.loader import load_model
    from llmd_tools.make_model import build_model
    from test_gguf_packed import _logits

    if DEVICE.type != "cpu":
        return {"err": 0.0, "tol": 0.0, "skipped": True}
    os.environ["LLMD_CPU_KERNELS"] = "0"
    root = Path(tempfile.mkdtemp(prefix="llmd-moe-"))
    hf = build_model(root / "hf", "qwen3_moe", "tiny", head_dim=32, moe_intermediate_size=64)
    model = load_model(write_gguf(hf, root / "moe.gguf", T.Q8_0), torch.float32, DEVICE, 128)
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    tokens = [1, 7, 42, 99, 3, 250, 17, 8, 64]
    ref_all, ref_last = _logits(model, tokens), _logits(model, tokens[-1:])
    attach_cuda_gguf_kernels(model, torch.float32)
    assert experts and all(e.fused is not None for e in experts), "the experts got no CUDA kernel"
    got_all, got_last = _logits(model, tokens), _logits(model, tokens[-1:])
    err = max(((g.double() - r.double()).abs().max() / r.double().abs().max()).item()
              for g, r in ((got_all, ref_all), (got_last, ref_last)))
    return {"err": err, "tol": 1e-4, "layers": len(experts)}


CASE_NAMES = (*CASES, "model-qwen3-moe-q8_0")


def main(args: list[str]) -> None:
    global DEVICE
    DEVICE = script_device(args)
    np.seterr(all="ignore")  # the interpreter's int32 shifts wrap on purpose
    for name in args or list(CASE_NAMES):
        try:
            result = run_model() if name == "model-qwen3-moe-q8_0" else run_case(name, CASES[name])
            print(json.dumps({"case": name, **result}), flush=True)
        except Exception:  # one case's failure is its result; the others still run
            print(json.dumps({"case": name, "error": traceback.format_exc()[-3000:]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
