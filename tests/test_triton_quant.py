"""Packed weights on CUDA: the Triton matmul over GGUF planes and FP8 bytes
(llmd.gpu.layers.quant.triton_quant_mm) against independent dequantizers, the plane
layout (gguf_planes), FP8 W8A8's arithmetic (fp8_scaled_mm), and the refusals.

With no GPU here the kernels run in Triton's interpreter, in a fresh process
(triton_quant_cases.py; kernel_runs.py says why); each case's result becomes one test,
on "cpu" (interpreted) and, where a GPU is present, "cuda" (compiled). The GPU-only
end-to-end checks (a packed GGUF / AWQ / FP8 model served on CUDA against its
dequantized run) are in test_quant_cuda_models.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_runs import DEVICES, case_result, run_case_scripts
from triton_quant_cases import CASE_NAMES

from llmd.gpu.layers.gguf_quant import FORMATS, row_bytes
from llmd.gpu.layers.quant.fp8_scaled_mm import (E4M3_MAX, W8A8_ENV, quantize_rows, w8a8_applies, w8a8_matmul,
                                                 w8a8_reference)
from llmd.gpu.layers.quant.gguf_planes import GPU_TYPES, from_planes, plane_views, to_planes
from llmd_tools.gguf_blocks import random_blocks
from test_gguf import hf_dirs  # noqa: F401

CASES_SCRIPT = Path(__file__).with_name("triton_quant_cases.py")


@pytest.fixture(scope="module", params=DEVICES)
def kernel_results(request) -> dict[str, dict]:
    """case name -> result, interpreted ("cpu") or compiled ("cuda", skipped without a
    GPU); the cases split between two processes side by side."""
    names = list(CASE_NAMES)
    halves = [names[0::2], names[1::2]]
    return run_case_scripts([(CASES_SCRIPT, half) for half in halves], request.param, timeout=300)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_the_kernel_equals_x_times_the_dequantized_weight(kernel_results, name):
    """GEMV (1 and 3 rows, split-K), tl.dot GEMM (17 rows, fp32 and bf16, split-K), odd
    N, K with a tail tile: each within its dtype's tolerance of the float64 product with
    the independently dequantized weight (triton_quant_cases' doc)."""
    runs = case_result(kernel_results, name)["runs"]
    if not runs and kernel_results is not None and name == "model-tied-q4_1":
        pytest.skip("an interpreter-only case (test_quant_cuda_models loads models on CUDA)")
    assert runs
    for run in runs:
        assert run["err"] <= run["tol"], run


@pytest.mark.parametrize("quant", GPU_TYPES)
def test_planes_hold_the_blocks_bytes_and_give_them_back(quant):
    """The planes are a permutation of the blocks' bytes: as many, every row back
    (whole and by ids), each field's view the width and dtype the kernel reads."""
    cols = 512
    blocks = random_blocks(quant, 7, cols, seed=1)
    planes = to_planes(blocks, quant, cols)
    assert planes.numel() == blocks.numel() == 7 * row_bytes(quant, cols)
    assert torch.equal(planes.sort().values, blocks.reshape(-1).sort().values)
    assert torch.equal(from_planes(planes, quant, cols), blocks)
    ids = torch.tensor([5, 0, 5, 2])
    assert torch.equal(from_planes(planes, quant, cols, ids), blocks[ids])
    views = plane_views(planes, quant, cols)
    blocks_per_row = cols // FORMATS[quant].block
    assert views["d"].dtype == torch.float16 and views["d"].shape[0] == 7
    assert views["qs"].shape == (7, {"Q8_0": cols, "Q2_K": cols // 4, "Q3_K": cols // 4}.get(quant, cols // 2))
    # the first block's d, read from its plane, is the block's first scale
    d_at = {"Q6_K": 208, "Q2_K": 80, "Q3_K": 108}.get(quant, 0)
    first = blocks[0, d_at:d_at + 2].contiguous().view(torch.float16)
    assert views["d"][0, 0] == first[0] and views["d"].shape[1] == blocks_per_row * (1 if quant != "Q6_K" else 1)


def test_split_k_fills_the_gpu_without_an_empty_split():
    """split_count: enough K splits for SPLIT_K_WAVES programs per SM, none where the
    tiles alone fill the GPU, never more splits than K tiles, none without an SM count
    (the interpreter)."""
    from llmd.gpu.layers.quant.quant_tiles import SPLIT_K_WAVES, split_count

    sms = 132
    assert split_count(448, 32, sms) == sms * SPLIT_K_WAVES // 448  # a 14336-row GEMV's 448 tiles
    assert split_count(sms * SPLIT_K_WAVES, 32, sms) == 1
    assert split_count(4, 3, sms) == 3  # at most one split per K tile
    assert split_count(448, 32, 0) == 1


def test_every_default_tile_compiles_for_hopper_keeps_its_values_in_registers_and_streams():
    """Each GPU type's default tiles (the GEMV and tl.dot at 16, 32 and 64 rows) in the
    launch quant_matmul makes for a 4096 x 4096 weight on an H200, specialized as Triton's
    launcher specializes it and compiled for sm_90 on this machine — what the interpreter
    cannot check: no local-memory traffic in the machine code (the first defaults spilled
    hundreds of loads and stores a K step); the K loop's loads pipelined (cp.async) in a
    tile of more than one stage; and a GEMV's tile estimated, by its bytes in flight and
    its K loop's issue rate, to multiply weights at 0.3 a byte of the H200's bandwidth or
    more (a 4.5-bit Q4_K at 17 % of the bandwidth, 3.4-bit Q3_K at 13 %; the defaults
    before pipelining and _as_float: 3-19 % in all but Q8_0, Q4_K 5 %). A newer Triton
    that fails this: re-pick the table with tools/quant_kernel_resources.py --grid --pick."""
    import os

    import triton

    from llmd.gpu.layers.quant.gguf_planes import GPU_TYPES
    from llmd_tools.quant_kernel_resources import estimate, measure, tile_bytes, tiles_to_check

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no CUDA tools")
    failed = {}
    for quant in (*GPU_TYPES, "FP8"):
        for tiles in tiles_to_check(False, quant):
            found = measure(quant, tiles)
            weights_a_byte = estimate(found) * 8 * tiles.bn * tiles.bk / tile_bytes(quant, tiles)
            if not (0 < found["registers"] <= 255 and found["local_ops"] == 0
                    and (tiles.stages == 1 or found["async_loads"] > 0)
                    and (tiles.dot or weights_a_byte >= 0.3)):
                failed[(quant, tiles.bm, tiles.bn, tiles.bk, tiles.warps, tiles.stages)] = found
    assert not failed, failed


def test_types_without_a_gpu_kernel_are_refused_by_name():
    blocks = random_blocks("Q3_K", 2, 256)
    with pytest.raises(ValueError, match=r"IQ4_XS has no GPU kernel \(GPU types: Q8_0, Q4_0"):
        to_planes(torch.zeros(2, 136, dtype=torch.uint8), "IQ4_XS", 256)  # held as IQ4_NL, never laid out
    with pytest.raises(ValueError, match=r"packed Q4_0 rows of shape \(2, 110\) do not hold 256 columns"):
        to_planes(blocks, "Q4_0", 256)


def test_every_k_quant_is_planned_packed_on_cuda(hf_dirs, tmp_path):  # noqa: F811
    """A file of Q2_K..Q6_K layers: the CUDA plan keeps every one packed as the CPU's
    does (no CPU-packed type is refused on CUDA: gguf_types checks it at import)."""
    import gguf
    from gguf_fixtures import write_gguf

    from llmd.gpu.models.decoder import CausalLM
    from llmd.gpu.models.gguf_loader import gguf_tensor_types
    from llmd.gpu.models.loader import load_hf_config
    from llmd.gpu.models.weight_plan import packed_params

    T = gguf.GGMLQuantizationType
    path = write_gguf(hf_dirs("llama-256"), tmp_path / "k.gguf",
                      k_quant_types=(T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))
    with torch.device("meta"):
        model = CausalLM(load_hf_config(path), 64)
    types = gguf_tensor_types(path)
    file_types = {kind for _, kind in types.values()}
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= file_types
    on_cpu, on_cuda = packed_params(model, types, "cpu"), packed_params(model, types, "cuda")
    assert on_cuda == on_cpu
    kinds = {kind for held in on_cuda.values() for kind in (held.values() if isinstance(held, dict) else [held])}
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= kinds <= set(GPU_TYPES)


# ---- FP8 W8A8 (fp8_scaled_mm): the arithmetic on CPU, _scaled_mm itself where it runs.

def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 bytes [n, k], per-row scales [n, 1], the dequantized weight by torch's conversion)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    scale = w.abs().amax(1, keepdim=True) / E4M3_MAX
    codes = (w / scale).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale, codes.float() * scale


def test_per_token_activation_scales_fit_each_row():
    """Each row's largest magnitude becomes 448 exactly; every value is within e4m3's
    rounding (2^-4 relative, subnormals 2^-10 absolute in code units) of x / scale."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1e-3], [1.0], [30.0], [0.5],
                                                                                       [2.0]])
    x[3] = 0.0  # an all-zero row stays zero
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    values = codes.float()
    for r in (0, 1, 2, 4):
        assert values[r].abs().max().item() == E4M3_MAX
    assert torch.all(values[3] == 0)
    exact = x / scale
    assert torch.all((values - exact).abs() <= exact.abs() * 2.0 ** -4 + 2.0 ** -10)


def test_w8a8_reference_is_the_dequantized_product_within_fp8_rounding():
    """The W8A8 arithmetic (x quantized per token, times the e4m3 weight, both scales)
    stays within e4m3's activation rounding of x times the dequantized weight."""
    weight, scale, dense = _fp8_weight(48, 128, 1)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    got = w8a8_reference(x, weight, scale)
    ref = x.double() @ dense.double().T
    bound = (x.double().abs() @ dense.double().abs().T) * 2.0 ** -4
    assert torch.all((got.double() - ref).abs() <= bound)
    assert (got.double() - ref).abs().max() > 0  # the activations really were quantized


def test_scaled_mm_computes_the_w8a8_reference():
    """torch._scaled_mm with row-wise scales (CPU here where torch has it; the CUDA run is
    the GPU test below) equals the float32 emulation to bf16 rounding."""
    weight, scale, _ = _fp8_weight(32, 64, 3)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    try:
        got = w8a8_matmul(x, weight, scale)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {exc}")
    ref = w8a8_reference(x, weight, scale).float()
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref, rtol=2.0 ** -7, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scaled_mm_on_the_gpu_computes_the_w8a8_reference():
    weight, scale, _ = _fp8_weight(64, 256, 5)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled FP8 GEMMs need compute capability 9.0")
    got = w8a8_matmul(x.cuda(), weight.cuda(), scale.cuda()).cpu()
    ref = w8a8_reference(x, weight, scale).float()
    assert torch.allclose(got.float(), ref, rtol=2.0 ** -7, atol=1e-5)


def test_w8a8_applies_only_where_fp8_tensor_cores_run_it(monkeypatch):
    weight, scale, _ = _fp8_weight(32, 64, 7)
    assert not w8a8_applies(torch.device("cpu"), torch.bfloat16, weight, scale)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        cuda = torch.device("cuda")
        assert w8a8_applies(cuda, torch.bfloat16, weight, scale)
        assert not w8a8_applies(cuda, torch.float16, weight, scale)  # W8A16 (the Triton kernel)
        assert not w8a8_applies(cuda, torch.bfloat16, weight, scale.repeat(1, 2))  # block scales
        monkeypatch.setenv(W8A8_ENV, "0")
        assert not w8a8_applies(cuda, torch.bfloat16, weight, scale)
    monkeypatch.setenv(W8A8_ENV, "yes")
    from llmd.gpu.layers.quant.fp8_scaled_mm import w8a8_enabled
    with pytest.raises(ValueError, match="LLMD_FP8_W8A8 must be 0 or 1, got 'yes'"):
        w8a8_enabled()


def test_the_gemv_profile_summary_ranks_a_hatchet_trees_lines_by_samples():
    """tools/profile_quant_gemv.py (run on a GPU lease) reads proton's hatchet tree: every
    node's numeric metrics, the most sampled lines first, a node without samples left out."""
    from llmd_tools.profile_quant_gemv import summarize

    def node(name, metrics, *children):
        return {"frame": {"name": name}, "metrics": metrics, "children": list(children)}

    tree = [node("ROOT", {}, node("_quant_mm_kernel", {"num_samples": 100},
                                  node("triton_quant_mm.py:280", {"num_samples": 70, "stall_long_scoreboard": 50}),
                                  node("triton_quant_mm.py:291", {"num_samples": 25, "stall_barrier": 20}),
                                  node("triton_quant_mm.py:300", {"num_samples": 0, "name_only": "x"})))]
    rows = summarize(tree, top=3)
    assert [r["line"] for r in rows] == ["ROOT / _quant_mm_kernel", "_quant_mm_kernel / triton_quant_mm.py:280",
                                         "_quant_mm_kernel / triton_quant_mm.py:291"]
    assert rows[1]["metrics"] == {"num_samples": 70, "stall_long_scoreboard": 50}
