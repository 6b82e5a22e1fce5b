"""AWQ and GPTQ mixture-of-experts experts kept packed on CPU (quant_plan.plan_quantized_experts:
each expert's codes transcoded into GGUF blocks as it is read, held in mlp.ExpertWeights
as a GGUF's experts are): greedy tokens and logprobs equal transformers' on the
dequantized weights (tests/quant_reference.py, written from the formats' layouts), for
AWQ (Q5_0 blocks), symmetric 4-bit GPTQ (Q4_0), 8-bit GPTQ (Q8_0), asymmetric 4-bit GPTQ
with act-order (an input order per module: gate and up of an expert in different
orders; the intermediate dimension in the order down's columns sort into by group, so
that down takes no order of its own: expert_sources.py), and FP8 experts (their e4m3
bytes, scales per channel and per 32x32 block), a Qwen3-MoE fixture whose layer 1 is a
dense MLP (quantized too); TP=2 ranks keep their shares, act-order experts' too. On CUDA
the plan keeps them packed (the grouped kernel: test_triton_quant_moe.py);
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
            _assert_down_takes_no_order(path, experts)
        layers = _quantized_layers(llm)
        assert layers["layers.1.mlp.down_proj"] == label and layers["layers.0.mlp.experts"] == label
        storage = weight_storage(model)
        assert storage[label] >= sum(e.w13.nbytes + e.w2.nbytes for e in experts)
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, f"{case} moe")
    finally:
        llm.engine.shutdown()


def _assert_down_takes_no_order(path, experts: list[ExpertWeights]) -> None:
    """The fixture's act-order is a real one (down's g_idx unsorted), and every expert's
    down projection takes x as it comes: its intermediate dimension was reordered, not
    x (without gate's and up's rows in that order too, the comparison with transformers
    fails)."""
    from safetensors import safe_open

    from llmd.gpu.layers.quant.int_groups import group_order
    from llmd.gpu.models.quant_plan import safetensors_index

    name = "model.layers.0.mlp.experts.1.down_proj.g_idx"
    with safe_open(safetensors_index(path)[name][2], framework="pt") as f:
        order = group_order(f.get_tensor(name).to(torch.int64))
    assert not torch.equal(order, torch.arange(order.numel()))
    for e in experts:
        assert torch.equal(e.w2_order, torch.arange(e.inter, dtype=torch.int32).expand_as(e.w2_order))
        assert all(order is None for down in e.products.down for order, _ in down.units)


@pytest.mark.parametrize("case", ["awq-g32", "fp8-block", "gptq4-act-order"])
def test_tensor_parallel_ranks_keep_their_experts_shares(checkpoints, tmp_path, case):  # noqa: F811
    """TP=2: each rank keeps its share of every quantized expert packed (w13's rows; w2's
    columns as whole blocks, an FP8 expert's with their scale groups, an act-order one's
    in its intermediate order) and computes what transformers does on the dequantized
    weights; the ranks' packed bytes add up to one rank's model's (act-order: o_proj's
    shares pad their groups, so the experts' bytes alone, which do not)."""
    options, _, label = CASES[case]
    path = checkpoints("qwen3-moe", **options)
    whole_model = load_model(path, torch.float32, CPU, 128)
    whole = weight_storage(whole_model)
    llm = LLM(model=str(path), tensor_parallel_size=2, **SETTINGS)
    try:
        _compare(str(write_dequantized(path, tmp_path / "dense")), llm, f"{case} moe tp=2")
        shares = llm.engine.executor.weight_bytes()
    finally:
        llm.engine.shutdown()
    if "act-order" not in case:
        assert whole[label] == shares[label], (whole, shares)
        return

    def expert_bytes(model) -> int:
        return sum(e.w13.nbytes + e.w2.nbytes for e in model.modules() if isinstance(e, ExpertWeights))

    ranks = [load_model(path, torch.float32, CPU, 128, tp_rank=r, tp_size=2) for r in range(2)]
    assert sum(expert_bytes(m) for m in ranks) == expert_bytes(whole_model) > 0


def test_act_order_down_projections_split_only_beside_their_gate_and_up(checkpoints):  # noqa: F811
    """Under TP an act-order down projection's columns are split in its expert's
    intermediate order, which gate's and up's rows must follow: where the file holds
    them dense, the plan refuses it by name (at TP=1 it keeps its own input order)."""
    from llmd.gpu.layers.quant.scheme import quant_scheme
    from llmd.gpu.models.decoder import CausalLM
    from llmd.gpu.models.loader import checkpoint_target, load_hf_config
    from llmd.gpu.models.quant_plan import plan_quantized_experts, resolve_scheme, safetensors_index

    path = checkpoints("qwen3-moe", **CASES["gptq4-act-order"][0])
    config, index = load_hf_config(path), safetensors_index(path)
    gate = "model.layers.2.mlp.experts.3.gate_proj"
    file = index[f"{gate}.qweight"][2]
    index = {k: v for k, v in index.items() if not k.startswith(gate + ".")}
    index[f"{gate}.weight"] = ("F32", (config.moe_intermediate_size, config.hidden_size), file)
    scheme = resolve_scheme(quant_scheme(config), index)

    def plan(rank: int, world: int) -> dict[str, str]:
        with torch.device("meta"):
            model = CausalLM(config, 128, rank, world, device=CPU)
        return plan_quantized_experts(model, scheme, index, checkpoint_target, "cpu")

    assert gate not in plan(0, 1) and "model.layers.2.mlp.experts.3.down_proj" in plan(0, 1)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.3\.down_proj is quantized "
                                         r"\(gptq-int4\): a GPTQ act-order \(desc_act\) down projection is split "
                                         r"by input columns \(tensor_parallel_size > 1\) only beside its expert's "
                                         r"quantized gate and up projections"):
        plan(0, 2)


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
