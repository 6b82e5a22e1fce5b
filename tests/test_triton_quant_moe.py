"""Packed experts on CUDA: the grouped kernel over every expert's packed weights
(llmd.gpu.layers.quant.triton_quant_moe, through quant/cuda_matmul.TritonPackedExperts)
against moe_reference on the experts dequantized by independent references — GGUF types
(gate, up and down in three K-quants), GPTQ act-order experts (an input column order per
part), FP8 per channel and per block — on ragged routing,
decode (the GEMV tile) and prefill (tl.dot) shapes, split-K and bf16; a whole MoE GGUF
given its CUDA kernels after a CPU load computes the same logits; and the kernel, as a
real layer's shapes launch it, compiles for Hopper without spilling.

With no GPU here the kernels run in Triton's interpreter, in fresh processes
(triton_quant_moe_cases.py; kernel_runs.py says why), on "cpu", and compiled on "cuda"
where a GPU is present. Models served on CUDA with packed experts: test_quant_cuda_models.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from kernel_runs import DEVICES, case_result, run_case_scripts
from triton_quant_moe_cases import CASE_NAMES

CASES_SCRIPT = Path(__file__).with_name("triton_quant_moe_cases.py")


@pytest.fixture(scope="module", params=DEVICES)
def kernel_results(request) -> dict[str, dict]:
    names = list(CASE_NAMES)
    return run_case_scripts([(CASES_SCRIPT, names[0::2]), (CASES_SCRIPT, names[1::2])], request.param, timeout=300)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_packed_experts_compute_what_their_dequantized_weights_do(kernel_results, name):
    result = case_result(kernel_results, name)
    if result.get("skipped"):
        pytest.skip("an interpreter-only case (test_quant_cuda_models loads MoE files on CUDA)")
    assert result["err"] <= result["tol"], result


def test_the_cases_cover_both_tiles(kernel_results):
    """Decode shapes take the GEMV tile (a program per pair), larger batches tl.dot with
    row blocks of 16 and 32: each path is checked above."""
    tiles = {(r["gemv"], r["bm"]) for r in kernel_results.values() if "gemv" in r}
    assert {(True, 1), (False, 16), (False, 32)} <= tiles, tiles


def test_the_experts_kernel_compiles_for_hopper_without_spilling():
    """A Qwen3-30B-A3B-shaped layer (128 experts of 768 over hidden 2048, 8 a token) in
    Q4_K_M's types and Q8_0, at 1, 4 and 32 tokens, and GPTQ act-order experts (Q5_0 at
    one token, Q4_0 at 32), each part's launch compiled for sm_90
    as its launcher specializes it (tools/quant_kernel_resources.py): within the register
    file, no local memory, the K loop's loads pipelined (cp.async)."""
    import os

    import triton

    from llmd_tools.quant_kernel_resources import compile_experts_tile, resources

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no CUDA tools")
    failed = {}
    cases = [(quants, tokens, False) for quants in (("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")) for tokens in (1, 4, 32)]
    for quants, tokens, ordered in cases + [(("Q5_0", "Q5_0"), 1, True), (("Q4_0", "Q4_0"), 32, True)]:
        for part, tiles, kernel, _ in compile_experts_tile(quants, 128, (2048, 768), tokens, 8, ordered):
            found = resources(kernel)
            if not (0 < found["registers"] <= 255 and found["local_ops"] == 0 and found["async_loads"] > 0):
                failed[(quants, tokens, ordered, part, tiles)] = found
    assert not failed, failed
