"""GPU only (skipped without CUDA): quantized checkpoints loaded packed on CUDA (the
Triton kernels, quant/cuda_matmul.py) compute what the same files dequantized at load
compute on CUDA — GGUF files of every GPU type (a tied vocabulary read back through its
planes, a projection mixing K-quants), AWQ and GPTQ checkpoints (on one rank), FP8 per
channel (W8A8 on Hopper in bf16, W8A16 in fp32), packed experts (MoE GGUFs, AWQ and FP8
experts: the grouped kernel) — and a packed GGUF, dense or MoE, served by the engine
generates the dequantized run's greedy tokens. The kernels themselves are checked
against independent dequantizers in test_triton_quant.py (interpreted everywhere,
compiled here).
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_fixtures import write_gguf
from llmd import LLM, SamplingParams
from llmd.gpu.layers.attention import AttentionMetadata, new_model_kv_caches
from llmd.gpu.layers.attention_backends import metadata_builder
from llmd.gpu.layers.mlp import ExpertWeights
from llmd.gpu.layers.quant.cuda_matmul import TritonFP8Matmul, TritonGGUFMatmul, TritonPackedExperts
from llmd.gpu.layers.quant.fp8_scaled_mm import quantize_rows
from llmd.gpu.layers.quant.quant_linear import IntGroupMatmul
from llmd.gpu.models.loader import load_model
from test_gguf import hf_dirs  # noqa: F401
from test_gguf_moe import hf_moe  # noqa: F401
from test_quantized_checkpoints import checkpoints  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
TOKENS = [1, 7, 42, 99, 3, 250, 17, 8, 8, 64, 5, 11, 90, 2, 33, 71, 18]  # 17 rows: the tl.dot path


def _logits(model, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits of a prefill of `tokens` (17 rows: the GEMM path) and of one decode step
    after it (1 row: the GEMV), float32 [len(tokens) + 1, vocab]."""
    caches = new_model_kv_caches(model, 8, 16, dtype, CUDA)
    n = len(tokens)
    table = torch.arange(8, device=CUDA)
    builder = metadata_builder(model, 16, CUDA)
    md = AttentionMetadata(torch.arange(n, device=CUDA), 0, None, None, [(0, n, 0, table)])
    builder.build(md)
    with torch.no_grad():
        hidden = model(torch.tensor(tokens, device=CUDA), torch.arange(n, device=CUDA), caches, md)
        prefill = model.compute_logits(hidden)
        md = AttentionMetadata(torch.tensor([n], device=CUDA), 0, None, None, [(0, 1, n, table)])  # one new token
        builder.build(md)
        decode = model.compute_logits(model(torch.tensor([tokens[-1]], device=CUDA), torch.tensor([n], device=CUDA),
                                            caches, md))
    return torch.cat([prefill, decode]).float()


def _kernels(model) -> set[type]:
    return {type(m.kernel) for m in model.modules() if getattr(m, "kernel", None) is not None
            and getattr(m, "quant", None) is not None}


def _close(packed: torch.Tensor, dense: torch.Tensor, rel: float) -> None:
    err = ((packed - dense).norm() / dense.norm()).item()
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("name,quant", [("llama", T.Q8_0), ("llama", T.Q4_0), ("llama-tied", T.Q4_1),
                                        ("llama", T.Q5_0), ("llama", T.Q5_1)])
def test_a_packed_gguf_on_cuda_computes_what_its_dequantized_weights_do(hf_dirs, tmp_path, name, quant):  # noqa: F811
    path = write_gguf(hf_dirs(name), tmp_path / f"{name}.gguf", quant)
    packed = load_model(path, torch.float32, CUDA, 128)
    dense = load_model(path, torch.float32, CUDA, 128, dequantize=True)
    assert _kernels(packed) == {TritonGGUFMatmul}
    _close(_logits(packed, TOKENS, torch.float32), _logits(dense, TOKENS, torch.float32), 1e-4)


def test_k_quant_mixes_on_cuda_compute_what_their_dequantized_weights_do(hf_dirs, tmp_path):  # noqa: F811
    path = write_gguf(hf_dirs("llama-256"), tmp_path / "k.gguf", T.Q8_0,
                      k_quant_types=(T.Q4_K, T.Q6_K, T.Q5_K, T.Q2_K, T.Q3_K))
    _assert_as_dequantized(path)


def test_iq4_nl_and_iq4_xs_on_cuda_stay_packed_as_iq4_nl(hf_dirs, tmp_path):  # noqa: F811
    for qtype in (T.IQ4_NL, T.IQ4_XS):
        path = write_gguf(hf_dirs("llama-256"), tmp_path / f"{qtype.name}.gguf", T.Q8_0, k_quant_types=(qtype,))
        packed = load_model(path, torch.float32, CUDA, 128)
        assert packed.layers[0].mlp.down_proj.quant == "IQ4_NL"
        _assert_as_dequantized(path)


def _assert_as_dequantized(path) -> None:
    """The packed model's logits in float32 and bfloat16 against its dequantized run's."""
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        packed = load_model(path, dtype, CUDA, 128)
        dense = load_model(path, dtype, CUDA, 128, dequantize=True)
        _close(_logits(packed, TOKENS, dtype), _logits(dense, TOKENS, dtype), rel)


@pytest.mark.parametrize("case", ["awq-llama-g32", "gptq4-asym-v2-act-order", "fp8-channel-qwen3"])
def test_quantized_checkpoints_on_cuda_compute_what_their_dequantized_weights_do(checkpoints, case):  # noqa: F811
    path = checkpoints(case)
    packed = load_model(path, torch.float32, CUDA, 128)
    dense = load_model(path, torch.float32, CUDA, 128, dequantize=True)
    assert _kernels(packed) <= {IntGroupMatmul, TritonFP8Matmul} and _kernels(packed)
    _close(_logits(packed, TOKENS, torch.float32), _logits(dense, TOKENS, torch.float32), 1e-4)


def test_act_order_groups_padded_to_whole_blocks_on_cuda(checkpoints, tmp_path):  # noqa: F811
    """GPTQ act-order groups of 31 and 33 columns, each group's run padded with zero
    weights (quant/int_groups.py): x's columns gathered in the padded order on CUDA too."""
    from test_quantized_checkpoints import _edited, uneven_groups

    path = _edited(checkpoints("gptq4-asym-v2-act-order"), tmp_path / "uneven", None, uneven_groups)
    packed = load_model(path, torch.float32, CUDA, 128)
    dense = load_model(path, torch.float32, CUDA, 128, dequantize=True)
    assert _kernels(packed) == {IntGroupMatmul}
    _close(_logits(packed, TOKENS, torch.float32), _logits(dense, TOKENS, torch.float32), 1e-4)


def test_fp8_in_bf16_runs_w8a8_on_hopper_within_activation_rounding(checkpoints):  # noqa: F811
    """bf16 on compute capability 9.0: activations quantized to e4m3 per token
    (fp8_scaled_mm). Each W8A8 layer, on the inputs the model gave it, computes what its
    dequantized twin computes on those inputs rounded the same way (quantize_rows, then
    back): equal up to bf16 rounding. The whole model's logits only stay near the
    dequantized run's: on an H200 the e4m3 rounding moved this random model's logits
    14% from the plain dequantized run and 10% from one with its activations rounded
    (a rounding flipped by an earlier difference moves a value by 1/16, and the random
    layers carry it on), so that comparison guards only against gross errors."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 needs fp8 tensor cores (compute capability 9.0)")
    path = checkpoints("fp8-channel-qwen3")
    packed = load_model(path, torch.bfloat16, CUDA, 128)
    dense = load_model(path, torch.bfloat16, CUDA, 128, dequantize=True)
    _close(_logits(packed, TOKENS, torch.bfloat16), _logits(dense, TOKENS, torch.bfloat16), 0.25)
    w8a8 = {name: m for name, m in packed.named_modules()
            if isinstance(getattr(m, "kernel", None), TritonFP8Matmul) and m.kernel.w8a8.get(torch.bfloat16)}
    assert w8a8, "no layer ran W8A8"
    calls = []
    hooks = [m.register_forward_hook(  # copies: a later fused op may write into a buffer in place
        lambda m, args, out, name=name: calls.append((name, args[0].detach().clone(), out.detach().clone())))
        for name, m in w8a8.items()]
    try:
        _logits(packed, TOKENS, torch.bfloat16)
    finally:
        for hook in hooks:
            hook.remove()
    assert {name for name, _, _ in calls} == set(w8a8)
    twins = dict(dense.named_modules())
    with torch.no_grad():
        for name, x, out in calls:
            codes, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
            _close(out.float(), twins[name]((codes.float() * scale).to(x.dtype).view(x.shape)).float(), 2e-2)


@pytest.mark.parametrize("case", ["gguf-qwen3-moe-q4_0", "gguf-qwen3-moe-kquants", "awq-g32", "gptq4-act-order",
                                  "fp8-block"])
def test_packed_experts_on_cuda_compute_what_their_dequantized_weights_do(hf_moe, checkpoints, tmp_path,  # noqa: F811
                                                                         case):
    """A MoE GGUF's experts (Q4_0; Q4_K / Q5_K / Q6_K parts) and a Qwen3-MoE checkpoint's
    AWQ, GPTQ act-order (gate and up in their own orders) and FP8 experts through the
    grouped kernel (TritonPackedExperts), in float32 and bfloat16, against the same files
    dequantized at load."""
    if case.startswith("gguf"):
        k_quants = (T.Q4_K, T.Q6_K, T.Q5_K) if case.endswith("kquants") else ()
        name = "qwen3-moe-256" if k_quants else "qwen3-moe"
        path = write_gguf(hf_moe(name), tmp_path / f"{case}.gguf", T.Q4_0, k_quant_types=k_quants)
    else:
        options = {"awq-g32": dict(method="awq", group_size=32),
                   "gptq4-act-order": dict(method="gptq", group_size=32, sym=False, gptq_v2=True, act_order=True,
                                           order_per_module=True),
                   "fp8-block": dict(method="fp8", fp8_style="block", block=(32, 32))}[case]
        path = checkpoints("qwen3-moe", **options)
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        packed = load_model(path, dtype, CUDA, 128)
        experts = [m for m in packed.modules() if isinstance(m, ExpertWeights)]
        assert experts and all(isinstance(e.fused, TritonPackedExperts) for e in experts)
        dense = load_model(path, dtype, CUDA, 128, dequantize=True)
        _close(_logits(packed, TOKENS, dtype), _logits(dense, TOKENS, dtype), rel)


def test_a_packed_moe_gguf_served_on_cuda_generates_the_dequantized_runs_tokens(hf_moe, tmp_path):  # noqa: F811
    """The engine (CUDA graphs over the grouped kernel) on a MoE GGUF whose experts stay
    packed: the dequantized run's greedy tokens, in fp32, one and four sequences a step."""
    path = write_gguf(hf_moe("qwen3-moe"), tmp_path / "moe.gguf", T.Q8_0)
    _assert_served_as_dequantized(path, [TOKENS[:5], TOKENS[3:14], TOKENS[1:4], TOKENS[6:16]])


def _assert_served_as_dequantized(path, prompts: list[list[int]]) -> None:
    settings = dict(device="cuda", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for dequantize in (False, True):
        llm = LLM(model=str(path), dequantize=dequantize, **settings)
        try:
            outputs[dequantize] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            graphs = llm.engine.executor.runner.decode_graphs  # captured, and the decode steps replayed them
            assert graphs is not None and graphs.num_replays > 0
        finally:
            llm.engine.shutdown()
    assert outputs[False] == outputs[True]


def test_a_packed_gguf_served_on_cuda_generates_the_dequantized_runs_tokens(hf_dirs, tmp_path):  # noqa: F811
    """The engine (CUDA graphs, the Triton attention backend) on a packed Q4_0 file:
    greedy tokens of the dequantized run, in fp32."""
    path = write_gguf(hf_dirs("llama-tied"), tmp_path / "tied.gguf", T.Q4_0)
    _assert_served_as_dequantized(path, [TOKENS[:5], TOKENS[3:14]])
