"""The cases tests/test_moe.py checks for the fused MoE Triton kernel: its experts'
output against llmd.gpu.layers.fused_moe.moe_reference on the same routing, with loads that
are ragged on purpose (experts that get no token, one expert with several row blocks,
a single decode token, sizes that are not multiples of the tiles). The "fused-" cases
run act(gate) * up between the two grouped GEMMs as the fused layer ops' Triton kernel
(fused_ops.FusedLayerOps, what a model with fused ops passes), the others in torch; the
reference always computes in torch.

Triton's interpreter is chosen when triton is first imported, and the pytest process may
already have imported triton (xgrammar does), so the test runs this file as a script in
a fresh process with TRITON_INTERPRET=1:

    TRITON_INTERPRET=1 python tests/fused_moe_cases.py [--model DIR] [CASE ...]

or, where a GPU is present, compiled (`--device cuda`, no interpreter; kernel_runs.py),
and prints one JSON line per case: {"case", "err", "tol", ...} or {"case", "error"}.
Importing this module (for the case names) does not import triton.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass

import torch
from kernel_runs import script_device

DEVICE = torch.device("cpu")  # where the cases run (main sets it from --device)

@dataclass(frozen=True)
class MoeCase:
    tokens: int
    experts: int = 8
    top_k: int = 2
    hidden: int = 32
    inter: int = 48
    dtype: str = "float32"
    # Relative chance of each expert being picked (0: never); None: uniform.
    load: tuple[float, ...] | None = None
    activation: str = "silu"  # a norms.ACTIVATIONS name
    fused_activation: bool = False  # act * up by the fused ops' kernel


SKEWED = (8.0, 0.0, 1.0, 4.0, 0.0, 0.0, 0.5, 0.0)  # experts 1, 4, 5, 7 get no token
CASES: dict[str, MoeCase] = {
    "decode-one-token": MoeCase(1),
    "decode-batch-4": MoeCase(4),
    "ragged-empty-experts": MoeCase(37, load=SKEWED),
    "ragged-top1": MoeCase(29, top_k=1, load=SKEWED),
    "one-expert-takes-all": MoeCase(21, top_k=1, load=(0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
    "odd-sizes": MoeCase(13, experts=5, hidden=40, inter=24, load=(3.0, 0.0, 1.0, 1.0, 0.2)),
    "many-rows-block-64": MoeCase(300, experts=4, load=(6.0, 1.0, 0.0, 2.0)),
    "bf16-ragged": MoeCase(37, dtype="bfloat16", load=SKEWED),
    "fp16-ragged": MoeCase(37, dtype="float16", load=SKEWED),
    "fused-decode-one-token": MoeCase(1, fused_activation=True),
    "fused-ragged-empty-experts": MoeCase(37, load=SKEWED, fused_activation=True),
    "fused-odd-sizes": MoeCase(13, experts=5, hidden=40, inter=24, load=(3.0, 0.0, 1.0, 1.0, 0.2),
                               fused_activation=True),
    "fused-bf16-ragged": MoeCase(37, dtype="bfloat16", load=SKEWED, fused_activation=True),
    "fused-gelu-tanh-ragged-top1": MoeCase(29, top_k=1, load=SKEWED, activation="gelu_pytorch_tanh",
                                           fused_activation=True),
    "fused-gelu-tanh-bf16-ragged": MoeCase(37, dtype="bfloat16", load=SKEWED, activation="gelu_pytorch_tanh",
                                           fused_activation=True),
}
# fp32: the two sides differ only in summation order. bf16/fp16: both round the gate/up
# output and the result to the type (outputs of |1| or so; a bf16 ulp there is 1/128).
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 5e-3}
# A fused case's Triton path against the same path with the activation in torch: the
# kernel rounds where torch rounds, so in fp32 they differ in exp's last bits, in
# bf16/fp16 by at most one ulp of the output's largest magnitude (2^-7, 2^-10 relative).
ACT_TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def routing(case: MoeCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32, ids int64), [tokens, top_k]: each token's top_k distinct experts
    drawn by `load`, weights positive and summing to 1 per token."""
    load = torch.tensor(case.load if case.load is not None else [1.0] * case.experts)
    ids = torch.multinomial(load.expand(case.tokens, -1), case.top_k, replacement=False, generator=gen)
    weights = torch.rand(case.tokens, case.top_k, generator=gen) + 0.1
    return weights / weights.sum(dim=-1, keepdim=True), ids


def build(case: MoeCase, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x, w13, w2, weights, ids) of one case, weights scaled so outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    x = torch.randn(case.tokens, case.hidden, generator=gen)
    w13 = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen) / case.hidden ** 0.5
    w2 = torch.randn(case.experts, case.hidden, case.inter, generator=gen) / case.inter ** 0.5
    weights, ids = routing(case, gen)
    return tuple(t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids))


def counting_ops(fused: bool):
    """The layer ops a case runs the Triton path with (fused: the kernel, else torch),
    counting their act_and_mul calls, so a case shows which ran."""
    from llmd.gpu.layers.fused_ops import FusedLayerOps, LayerOps

    class Counting(FusedLayerOps if fused else LayerOps):
        calls = 0

        def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
            self.calls += 1
            return super().act_and_mul(gate_up, activation)

    return Counting()


def run_case(case: MoeCase) -> dict:
    from llmd.gpu.layers.fused_moe import moe_reference
    from llmd.gpu.layers.fused_moe_triton import triton_fused_experts

    x, w13, w2, weights, ids = build(case)
    ops = counting_ops(case.fused_activation)
    ref = moe_reference(x, w13, w2, weights, ids, case.activation)
    out = triton_fused_experts(x, w13, w2, weights, ids, case.activation, ops)
    counts = torch.bincount(ids.flatten(), minlength=case.experts).tolist()
    result = {"err": (out.float() - ref.float()).abs().max().item(), "tol": TOLERANCE[case.dtype],
              "expert_counts": counts, "shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."),
              "fused": ops.fused, "act_calls": ops.calls}
    if case.fused_activation:
        torch_act = triton_fused_experts(x, w13, w2, weights, ids, case.activation, counting_ops(False)).float()
        scale = 1.0 if case.dtype == "float32" else max(torch_act.abs().max().item(), 1.0)
        result.update(act_err=(out.float() - torch_act).abs().max().item(), act_tol=ACT_TOLERANCE[case.dtype] * scale)
    return result


def _run_block(block, x: torch.Tensor, use_triton: bool, ops) -> torch.Tensor:
    """A sparse block's output with its experts on the Triton path or the reference, and
    `ops` running act * up (its Triton experts' and its shared expert's)."""
    block.use_triton, block.ops = use_triton, ops
    if block.shared_expert is not None:
        block.shared_expert.ops = ops
    return block(x)


def run_model(model_dir: str, fused: bool, tokens: int = 29) -> dict:
    """Every sparse block of a MoE checkpoint (router, experts, shared expert) on the same
    random hidden states, with the Triton experts and with the reference. `fused`: the
    model is built as a CUDA one would be with fused ops (LLMD_FUSED_OPS=1, the Triton
    attention backend), so its blocks run act * up as the fused kernel; the reference
    then runs with the torch ops."""
    from llmd.gpu.layers.fused_ops import FUSED_OPS_ENV, UNFUSED
    from llmd.gpu.models.loader import load_model

    os.environ[FUSED_OPS_ENV] = "1" if fused else "0"
    model = load_model(model_dir, torch.float32, DEVICE, 128,
                       attention_backend="triton" if fused else "torch")
    gen = torch.Generator().manual_seed(5)
    err, blocks = 0.0, model.sparse_blocks()
    fused_blocks = sum(block.ops.fused for block in blocks.values())
    with torch.inference_mode():
        for block in blocks.values():
            x = torch.randn(tokens, model.config.hidden_size, generator=gen).to(DEVICE)
            ops = block.ops
            ref = _run_block(block, x, False, UNFUSED)
            err = max(err, (_run_block(block, x, True, ops) - ref).abs().max().item())
    return {"err": err, "tol": 1e-5, "blocks": len(blocks), "fused_blocks": fused_blocks}


def main(args: list[str]) -> None:
    """Args: case names (default: all); `--model DIR` adds the "model" and
    "model-fused" checks; `--device cpu|cuda` (kernel_runs.script_device)."""
    global DEVICE
    DEVICE = script_device(args)
    jobs = {}
    if "--model" in args:
        i = args.index("--model")
        model_dir = args[i + 1]
        del args[i:i + 2]
        jobs["model"] = lambda: run_model(model_dir, fused=False)
        jobs["model-fused"] = lambda: run_model(model_dir, fused=True)
    for name in args or list(CASES):
        jobs[name] = lambda case=CASES[name]: run_case(case)
    for name, job in jobs.items():
        try:
            result = {"case": name, **job()}
        except Exception:
            result = {"case": name, "error": traceback.format_exc()}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
