"""AWQ and GPTQ mixture-of-experts experts kept packed on CPU (quant_plan.plan_quantized_experts:
each expert's codes transcoded into GGUF blocks as it is read, held in mlp.ExpertWeights
as a GGUF's experts are): greedy tokens and logprobs equal transformers' on the
dequantized weights (tests/quant_reference.py, written from the formats' layouts), for
AWQ (Q5_0 blocks), symmetric 4-bit GPTQ (Q4_0), 8-bit GPTQ (Q8_0), asymmetric 4-bit GPTQ
with act-order (an input order per module: gate and up of an expert in different
orders), and FP8 experts (their e4m3 bytes, scales per channel and per 32x32 block), a
Qwen3-MoE fixture whose layer 1 is a dense MLP (quantized too); TP=2 ranks keep their
shares. On CUDA the plan keeps them packed (the grouped kernel: test_triton_quant_moe.py);
dequantize=True loads them dense.
"""
from __future__ import annotations

import pytest
import torch

from llmd import LLM
from llmd.gpu.layers.mlp import ExpertWeights
from llmd.gpu.models.loader import load_model
from llmd.gpu.worker.memory_profile import weight_storage
from quant_reference import write_dequantized
from test_quantized_checkpoints import SETTINGS, _compare, _quantized_layers, checkpoints  # noqa: F401

pytestmark = pytest.mark.usefixtures("float32_products")
CPU = torch.device("cpu")
CASES = {
    "awq-g32": (dict(method="awq", group_size=32), "Q5_0", "awq-int4"),
    "gptq4-sym": (dict(method="gptq", group_size=32), "Q4_0", "gptq-int4"),
    "gptq8-g64": (dict(method="gptq", bits=8, group_size=64), "Q8_0", "gptq-int8"),
    "gptq4-act-order": (dict(method="gptq", group_size=32, sym=False, gptq_v2=True, act_order=True,
                             order_per_module=True), "Q5_0", "gptq-int4"),
    "fp8-channel": (dict(method="fp8", fp8_style="channel"), "FP8", "fp8-e4m3"),
    "fp8-block": (dict(method="fp8", fp8_style="block", block=(32, 32)), "FP8", "fp8-e4m3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_experts_stay_packed_and_compute_what_their_weights_do(checkpoints, tmp_path, case):  # noqa: F811
    options, held, label = CASES[case]
    path = checkpoints("qwen3-moe", **options)
    llm = LLM(model=str(path), **SETTINGS)
    try:
        model = llm.engine.executor.runner.model
        experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
        assert len(experts) == 2  # layers 0 and 2 (layer 1 is a dense MLP)
        for e in experts:
            assert e.quant == label and e.packed_types == {"w13": (held, held), "w2": (held,)}
            assert e.w13.dtype == torch.uint8 and e.products is not None
            if held == "FP8":  # e4m3 bytes [experts, rows, cols], a scale a row (channel) or a block of 32 columns
                assert e.w13.shape == (4, 128, 64) and e.w13_scales.shape[2] == (2 if "block" in case else 1)
            assert e.ordered == ("act-order" in case)
        if "act-order" in case:  # gate and up of an expert in their own orders: two units of one product
            assert len(experts[0].products.gate_up[0].units) == 2 and experts[0].products.gate_up[0].units[0][0]
        layers = _quantized_layers(llm)
        assert layers["layers.1.mlp.down_proj"] == label and layers["layers.0.mlp.experts"] == label
        storage = weight_storage(model)
        assert storage[label] >= sum(e.w13.nbytes + e.w2.nbytes for e in experts)
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, f"{case} moe")
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("case", ["awq-g32", "fp8-block"])
def test_tensor_parallel_ranks_keep_their_experts_shares(checkpoints, tmp_path, case):  # noqa: F811
    """TP=2: each rank keeps its share of every quantized expert packed (w13's rows; w2's
    columns as whole blocks, an FP8 expert's with their scale groups) and computes what
    transformers does on the dequantized weights; the ranks' packed bytes add up to one
    rank's model's."""
    options, _, label = CASES[case]
    path = checkpoints("qwen3-moe", **options)
    whole = weight_storage(load_model(path, torch.float32, CPU, 128))
    llm = LLM(model=str(path), tensor_parallel_size=2, **SETTINGS)
    try:
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, f"{case} moe tp=2")
        shares = llm.engine.executor.weight_bytes()
    finally:
        llm.engine.shutdown()
    assert whole[label] == shares[label], (whole, shares)


def test_act_order_experts_are_not_split_across_ranks(checkpoints):  # noqa: F811
    from llmd.gpu.layers.quant.scheme import quant_scheme
    from llmd.gpu.models.decoder import CausalLM
    from llmd.gpu.models.loader import checkpoint_target, load_hf_config
    from llmd.gpu.models.quant_plan import plan_quantized_experts, resolve_scheme, safetensors_index

    path = checkpoints("qwen3-moe", **CASES["gptq4-act-order"][0])
    config, index = load_hf_config(path), safetensors_index(path)
    scheme = resolve_scheme(quant_scheme(config), index)
    with torch.device("meta"):
        rank0 = CausalLM(config, 128, 0, 2, device=CPU)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.\d+\.\w+_proj is quantized "
                                         r"\(gptq-int4\): GPTQ act-order \(desc_act\) experts cannot be split by "
                                         r"input columns \(tensor_parallel_size > 1\); "):
        plan_quantized_experts(rank0, scheme, index, checkpoint_target, "cpu")


def test_dequantize_loads_quantized_experts_dense(checkpoints, tmp_path):  # noqa: F811
    path = checkpoints("qwen3-moe", method="gptq", group_size=32)
    llm = LLM(model=str(path), dequantize=True, **SETTINGS)
    try:
        assert _quantized_layers(llm) == {}
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, "gptq moe, dequantized")
    finally:
        llm.engine.shutdown()


def test_quantized_experts_are_planned_packed_on_cuda(checkpoints):  # noqa: F811
    """On CUDA the plan keeps AWQ / GPTQ (act-order too) / FP8 experts packed as on CPU
    (the grouped kernel: test_triton_quant_moe.py) and refuses a device without a packed
    MoE kernel, naming the expert."""
    from llmd.gpu.layers.quant.scheme import quant_scheme
    from llmd.gpu.models.decoder import CausalLM
    from llmd.gpu.models.loader import checkpoint_target, load_hf_config
    from llmd.gpu.models.quant_plan import plan_quantized_experts, resolve_scheme, safetensors_index

    def plan(options: dict, device: str) -> dict[str, str]:
        path = checkpoints("qwen3-moe", **options)
        config, index = load_hf_config(path), safetensors_index(path)
        with torch.device("meta"):
            model = CausalLM(config, 128, 0, 1, device=CPU)
        return plan_quantized_experts(model, resolve_scheme(quant_scheme(config), index), index, checkpoint_target,
                                      device)

    awq = CASES["awq-g32"][0]
    assert set(plan(awq, "cuda").values()) == {"Q5_0"} and plan(awq, "cuda") == plan(awq, "cpu")
    assert set(plan(CASES["fp8-block"][0], "cuda").values()) == {"FP8"}
    act_order = CASES["gptq4-act-order"][0]
    assert plan(act_order, "cuda") == plan(act_order, "cpu")
    with pytest.raises(ValueError, match=r"llmd keeps quantized experts packed on CPU and CUDA only \(no packed MoE "
                                         r"kernel for mps\)"):
        plan(awq, "mps")


def test_an_expert_whose_zero_points_contradict_sym_is_refused_by_name(checkpoints, tmp_path):  # noqa: F811
    """The experts' type is chosen from `sym` before any zero point is read (Q4_0): an
    expert with one zero point other than 8 cannot be held so, and is named."""
    from test_quantized_checkpoints import _edited

    def one_zero_point_off(tensors: dict) -> None:
        name = "model.layers.2.mlp.experts.1.up_proj.qzeros"
        tensors[name] = tensors[name] ^ 1  # v1 stores zero - 1 = 7 in every nibble: one becomes 6 (zero 7)

    path = _edited(checkpoints("qwen3-moe", method="gptq", group_size=32), tmp_path / "off",
                   tensor_edit=one_zero_point_off)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.1\.up_proj: its zero points make its "
                                         r"blocks Q5_0, not Q4_0 \(quantization_config's sym says every zero point "
                                         r"is 8\)"):
        LLM(model=str(path), **SETTINGS)
