"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF transformers, and
the fused MoE kernel against the reference path.

Fixtures (llmd_tools.make_model: transformers' Qwen3MoeConfig, Qwen2MoeConfig and
MixtralConfig, random weights saved per expert as real checkpoints are): 8 experts, 2 per
token, experts of intermediate size 32, hidden 64, 3 layers.
- tiny-qwen3-moe: top-2 weights renormalised (norm_topk_prob), layer 1 a dense MLP
  (mlp_only_layers), q/k norms;
- tiny-qwen2-moe: a shared expert (size 64) behind its sigmoid gate, weights not
  renormalised, q/k/v bias;
- tiny-mixtral: weights renormalised, checkpoint names block_sparse_moe.experts.{e}.w1/w3/w2.

Whole requests give transformers' greedy tokens and top-5 logprobs (fp32) in plain
batches, prefix-cache hits, chunked prefill, preemption, an emulated decode graph and
TP=2 over gloo (each rank a half of every expert). The fused Triton kernel runs in
Triton's interpreter in a subprocess (fused_moe_cases.py) against moe_reference on
ragged loads, experts with no token included, with act(gate) * up between its GEMMs in
torch and as the fused layer ops' Triton kernel (the "fused-" cases, fp32 and bf16, and
"model-fused": a model built with fused ops); the reference is checked against a plain
per-token loop. Each comparison can fail: with routing or the shared expert changed,
transformers no longer agrees.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fused_moe_cases import CASES
from kernel_runs import DEVICES, case_result, run_case_scripts
from hf_ref import check_logprobs_close, engine_result, hf_greedy
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, Qwen3MoeConfig

from llmd import LLM, SamplingParams
from llmd.gpu.layers.fused_moe import moe_reference
from llmd.gpu.layers.fused_ops import select_experts
from llmd.gpu.models.loader import load_hf_config, load_model
from llmd.gpu.layers.cpu.cpu_linear import checkpoint_weight
from llmd.gpu.layers.mlp import GatedMLP, SparseMoeBlock
from llmd.gpu.layers import moe_align
from llmd.gpu.layers.moe_align import moe_align_block_size, padded_capacity
from llmd.gpu.layers.tp import check_tp_config, split_share
from llmd_tools.make_model import fixture_path

QWEN3_MOE, QWEN2_MOE, MIXTRAL = "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"
MODELS = (QWEN3_MOE, QWEN2_MOE, MIXTRAL)
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
PROMPT_LENGTHS = (41, 19, 56)  # token ids 5 and up; 2, 1 and 3 full 16-token blocks
CASES_SCRIPT = Path(__file__).with_name("fused_moe_cases.py")
CPU = torch.device("cpu")


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(tuple(torch.randint(5, 1000, (n,), generator=gen).tolist()) for n in PROMPT_LENGTHS)


@functools.cache
def reference(name: str, prompt: tuple[int, ...]):
    return hf_greedy(str(fixture_path(name)), list(prompt), MAX_TOKENS)


def check_against_hf(name: str, outputs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts(), outputs)):
        assert out.prompt_token_ids == list(prompt)
        compared = check_logprobs_close(reference(name, prompt), engine_result(out), f"{name} prompt {i}")
        assert compared == MAX_TOKENS, (name, i, compared)


def matches_hf(name: str, outputs) -> list[bool]:
    def one(prompt, out) -> bool:
        try:
            return check_logprobs_close(reference(name, prompt), engine_result(out), name) == MAX_TOKENS
        except AssertionError:
            return False
    return [one(p, o) for p, o in zip(prompts(), outputs)]


def generate(llm: LLM):
    return llm.generate([list(p) for p in prompts()], GREEDY)


MODES = {
    "default": {},
    # Chunks of at most 12 tokens: every prompt is prefilled over several steps. No prefix
    # cache: the mutations below run on these engines and must leave no KV for others.
    "chunked": {"max_num_batched_tokens": 20, "long_prefill_token_threshold": 12, "enable_prefix_caching": False},
    # 6 blocks of 16 tokens for requests needing 4, 3 and 5 by their end: the first two run,
    # and when both grow one is preempted and later recomputed.
    "preempt": {"num_gpu_blocks_override": 6, "max_model_len": 96},
    "tp2": {"tensor_parallel_size": 2, "max_num_batched_tokens": 48, "device": "cpu"},
}


@pytest.fixture(scope="module")
def engines():
    """(name, mode) -> LLM, built on first use; TP engines shut down at the end."""
    built: dict[tuple[str, str], LLM] = {}

    def get(name: str, mode: str) -> LLM:
        if (name, mode) not in built:
            settings = {"num_gpu_blocks_override": 64, "max_model_len": 128, "dtype": "float32", **MODES[mode]}
            built[name, mode] = LLM(model=str(fixture_path(name)), **settings)
        return built[name, mode]

    yield get
    for (_, mode), llm in built.items():
        if mode == "tp2":
            llm.engine.shutdown()


def assert_all_free(llm: LLM) -> None:
    llm.engine.kv_cache_manager.check_integrity()
    llm.engine.kv_cache_manager.assert_all_free()


# --- whole requests against HF transformers -------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_greedy_batch_and_prefix_cache_hits_match_hf(engines, name: str) -> None:
    llm = engines(name, "default")
    check_against_hf(name, generate(llm))
    again = generate(llm)  # the same prompts: their full blocks come from the cache
    assert [o.num_cached_tokens for o in again] == [n // 16 * 16 for n in PROMPT_LENGTHS]
    check_against_hf(name, again)
    assert_all_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_matches_hf(engines, name: str) -> None:
    llm = engines(name, "chunked")
    check_against_hf(name, generate(llm))
    assert_all_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_preemption_matches_hf(engines, name: str) -> None:
    llm = engines(name, "preempt")
    check_against_hf(name, generate(llm))
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert_all_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_matches_hf(engines, name: str) -> None:
    """TP=2 over gloo: each rank holds half of every expert's intermediate dimension (and
    of the shared expert), the router whole; one all-reduce per sparse layer."""
    llm = engines(name, "tp2")
    assert len(llm.engine.executor.pids) == 2
    check_against_hf(name, generate(llm))
    assert_all_free(llm)


def test_emulated_decode_graphs_match_hf() -> None:
    """Decode steps through the graph path (static buffers, rows padded to a captured
    size, emulated on CPU): the padded rows are routed too and change nothing."""
    llm = LLM(model=str(fixture_path(QWEN2_MOE)), num_gpu_blocks_override=64, max_model_len=128, dtype="float32",
              max_num_seqs=8)
    runner = llm.engine.executor.runner
    runner.init_decode_graphs(emulate=True)
    check_against_hf(QWEN2_MOE, generate(llm))
    assert runner.decode_graphs.num_replays >= MAX_TOKENS - 1
    assert 4 in runner.decode_graphs.padded_sizes  # three requests padded to four rows


# --- what the models read from the config and checkpoint ----------------------------------------


def test_layers_follow_the_config(engines) -> None:
    def blocks(name: str) -> list[torch.nn.Module]:
        return [layer.mlp for layer in engines(name, "default").engine.executor.runner.model.layers]

    qwen3 = blocks(QWEN3_MOE)
    assert [type(m) for m in qwen3] == [SparseMoeBlock, GatedMLP, SparseMoeBlock]  # mlp_only_layers=[1]
    assert qwen3[0].experts.w13.shape == (8, 64, 64) and qwen3[0].experts.w2.shape == (8, 64, 32)
    assert [(m.top_k, m.renormalize, m.shared_expert) for m in (qwen3[0], qwen3[2])] == [(2, True, None)] * 2
    qwen2 = blocks(QWEN2_MOE)
    assert all(checkpoint_weight(m.shared_expert.gate_up_proj).shape == (128, 64) and not m.renormalize
               for m in qwen2)
    mixtral = blocks(MIXTRAL)
    assert all(isinstance(m, SparseMoeBlock) and m.renormalize and m.shared_expert is None for m in mixtral)


def test_a_missing_expert_is_refused(tmp_path: Path) -> None:
    source = fixture_path(MIXTRAL)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint is missing 1 weight\(s\), e.g. "
                                         r"'layers.2.mlp.experts.w13' \(shard \(5, 1\)\)"):
        load_model(tmp_path, torch.float32, CPU, 128)


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64)
REFUSED = {
    "top-k-above-experts": (lambda: MixtralConfig(**SMALL, num_local_experts=2, num_experts_per_tok=3),
                            "MixtralForCausalLM",
                            r"MixtralForCausalLM: config num_experts_per_tok=3 exceeds the number of experts \(2\)"),
    "dense-layer-out-of-range": (lambda: Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=16, mlp_only_layers=[2]),
                                 "Qwen3MoeForCausalLM",
                                 r"Qwen3MoeForCausalLM: config mlp_only_layers=\[2\] must list layer indices in"),
    "qwen3-shared-expert": (lambda: Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=16, shared_expert_intermediate_size=32),
                            "Qwen3MoeForCausalLM",
                            r"Qwen3MoeForCausalLM: config shared_expert_intermediate_size=32 asks for a shared"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_configs_llmd_cannot_run_are_refused(case: str, tmp_path: Path) -> None:
    make, arch, message = REFUSED[case]
    config = make()
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_hf_config(tmp_path)


def test_tp_size_must_divide_the_expert_size() -> None:
    config = Qwen3MoeConfig(**{**SMALL, "num_attention_heads": 4, "num_key_value_heads": 4}, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=18)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide the model's moe_intermediate_size"):
        check_tp_config(config, 4)
    check_tp_config(config, 2)


def test_intermediate_shares_hold_whole_blocks_as_even_as_they_go() -> None:
    """split_share: equal shares where they hold whole units; else whole units, the
    first ranks one more, covering the dimension once; refused where a rank gets none."""
    assert [split_share(1024, r, 2, 256) for r in range(2)] == [(0, 512), (512, 1024)]
    assert [split_share(768, r, 2) for r in range(2)] == [(0, 384), (384, 768)]  # no unit: equal
    assert [split_share(768, r, 2, 256) for r in range(2)] == [(0, 512), (512, 768)]  # Qwen3-30B-A3B's experts
    assert [split_share(18944, r, 4, 256) for r in range(4)] == [(0, 4864), (4864, 9728), (9728, 14336),
                                                                 (14336, 18944)]  # Qwen2.5-7B's MLP, 19/19/18/18
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 cannot split the experts dimension \(768\) in "
                                         r"whole blocks of 256 weights.*--dequantize"):
        split_share(768, 0, 4, 256, "experts")


# --- routing and the experts ----------------------------------------------------------------------


def test_routing_is_transformers_routing() -> None:
    """select_experts against transformers' own routers on the same logits."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    for router, renormalize in ((MixtralTopKRouter(MixtralConfig(**SMALL, num_local_experts=8)), True),
                                *((Qwen3MoeTopKRouter(Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2,
                                                                     norm_topk_prob=norm)), norm)
                                  for norm in (False, True))):
        torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(4))
        logits, want_weights, want_ids = router(hidden)
        weights, ids = select_experts(logits, 2, renormalize)
        assert torch.equal(ids, want_ids)
        assert torch.allclose(weights, want_weights.float(), atol=1e-7)


def per_token_loop(x, w13, w2, weights, ids) -> torch.Tensor:
    """The definition: each token's experts one by one."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("case", ["decode-batch-4", "ragged-empty-experts", "ragged-top1", "odd-sizes"])
def test_reference_equals_a_per_token_loop(case: str) -> None:
    from fused_moe_cases import build

    x, w13, w2, weights, ids = build(CASES[case])
    assert torch.allclose(moe_reference(x, w13, w2, weights, ids), per_token_loop(x, w13, w2, weights, ids),
                          atol=1e-5)


@pytest.mark.parametrize("rank_by", ["one-hot scan", "stable sort"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_align_block_size_groups_pairs_by_expert(block_size: int, rank_by: str, monkeypatch) -> None:
    from fused_moe_cases import build

    if rank_by == "stable sort":  # the path of batches too large for the one-hot scan
        monkeypatch.setattr(moe_align, "ONE_HOT_CELLS", 0)
    case = CASES["ragged-empty-experts"]
    _, _, _, _, ids = build(case)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, block_size, case.experts)
    pairs = ids.numel()
    assert sorted_ids.numel() == padded_capacity(pairs, case.experts, block_size)  # fixed by the batch size
    total = int(num_padded)
    assert total % block_size == 0 and (sorted_ids[total:] == pairs).all()
    real = sorted_ids[:total][sorted_ids[:total] < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    flat = ids.flatten()
    for block in range(total // block_size):
        rows = sorted_ids[block * block_size:(block + 1) * block_size]
        rows = rows[rows < pairs]
        assert (flat[rows] == expert_ids[block]).all()  # a block is one expert's
        assert rows.tolist() == sorted(rows.tolist())  # in token order
    counts = torch.bincount(flat, minlength=case.experts)
    assert total == int(((counts + block_size - 1) // block_size * block_size).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_the_one_launch_work_list_is_the_torch_ops(device: str) -> None:
    """moe_align_triton (what CUDA runs up to TRITON_MAX_PAIRS pairs) gives moe_align's
    torch ops' three tensors exactly (tests/moe_align_cases.py: empty experts, one
    expert, odd expert counts, int32 ids, chunk tails, blocks of 64), in Triton's
    interpreter, or compiled on a GPU."""
    from moe_align_cases import CASES as ALIGN_CASES

    results = run_case_scripts([(Path(__file__).with_name("moe_align_cases.py"), [])], device, timeout=120)
    assert sorted(results) == sorted(ALIGN_CASES)
    for name, result in results.items():
        assert result.get("equal") is True, (name, result)


def test_the_one_launch_work_list_compiles_for_hopper_without_spilling() -> None:
    """moe_align_triton's kernel compiled for sm_90 as its launcher specializes it
    (tools/quant_kernel_resources.py): one token at top-8 of Qwen3-30B-A3B's 128 experts,
    TRITON_MAX_PAIRS pairs at row blocks of 64, 60 experts: within the register file, no
    local memory."""
    import os

    import triton

    from llmd.gpu.layers import moe_align_triton as mat
    from llmd_tools.quant_kernel_resources import compile_for_hopper, resources

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no CUDA tools")
    for pairs, experts, block in ((8, 128, 16), (moe_align.TRITON_MAX_PAIRS, 128, 64), (3, 60, 16)):
        capacity = padded_capacity(pairs, experts, block)
        tensors = [torch.zeros(n, dtype=torch.int64) for n in (pairs, capacity, capacity // block, 1)]
        kernel = compile_for_hopper(mat._moe_align_kernel, (*tensors, pairs, capacity, experts),
                                    dict(BS=block, EP=triton.next_power_of_2(experts), C=mat.CHUNK, FILL=mat.FILL,
                                         BLOCKS=mat.BLOCKS, num_warps=4))
        found = resources(kernel)
        assert 0 < found["registers"] <= 255 and found["local_ops"] == 0, (pairs, experts, block, found)


@pytest.fixture(scope="module", params=DEVICES)
def interpreted(request) -> dict[str, dict]:
    """case name -> its result in Triton's interpreter ("cpu", one fresh process), or
    compiled on a GPU ("cuda", skipped without one)."""
    return run_case_scripts([(CASES_SCRIPT, ["--model", str(fixture_path(QWEN2_MOE)), *CASES])], request.param,
                            timeout=300)


@pytest.mark.parametrize("name", ["model", "model-fused", *CASES])
def test_fused_triton_kernel_matches_the_reference(interpreted: dict[str, dict], name: str) -> None:
    """The grouped-GEMM kernel over the expert-sorted, block-padded pairs equals
    moe_reference: experts with no token, an expert spanning several row blocks, a single
    decode token, sizes off the tiles, bf16/fp16, the activation in torch or fused; "model"
    runs every sparse block of tiny-qwen2-moe (router, experts, shared expert) both ways,
    "model-fused" the same blocks of the model built with fused ops."""
    result = case_result(interpreted, name)
    assert result["err"] <= result["tol"], result
    if name in CASES and CASES[name].load is not None:
        assert 0 in result["expert_counts"], result  # the case has experts that get no token
    if name in CASES:  # the Triton path applied the activation once, through the case's ops
        assert result["fused"] == CASES[name].fused_activation and result["act_calls"] == 1, result
    if name in CASES and CASES[name].fused_activation:
        assert result["act_err"] <= result["act_tol"], result  # the kernel vs the torch activation, same GEMMs
    if name.startswith("model"):
        assert result["fused_blocks"] == (result["blocks"] if name == "model-fused" else 0), result


# --- each comparison can fail -----------------------------------------------------------------------


def _no_renormalize(block: SparseMoeBlock, monkeypatch) -> None:
    monkeypatch.setattr(block, "renormalize", False)


def _top_1(block: SparseMoeBlock, monkeypatch) -> None:
    monkeypatch.setattr(block, "top_k", 1)


def _constant_shared_expert_gate(block: SparseMoeBlock, monkeypatch) -> None:
    """sigmoid(0) = 1/2 for every token instead of the token's own gate."""
    monkeypatch.setattr(block.shared_expert_gate, "weight", torch.nn.Parameter(torch.zeros(1, 64)))


MUTATIONS = {
    "qwen3-moe-no-renormalize": (QWEN3_MOE, _no_renormalize),
    "qwen2-moe-constant-shared-expert-gate": (QWEN2_MOE, _constant_shared_expert_gate),
    "mixtral-top-1": (MIXTRAL, _top_1),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_comparison_fails_without_each_feature(engines, mutation: str, monkeypatch) -> None:
    name, mutate = MUTATIONS[mutation]
    llm = engines(name, "chunked")
    for layer in llm.engine.executor.runner.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            mutate(layer.mlp, monkeypatch)
    assert not all(matches_hf(name, generate(llm))), f"{mutation}: every prompt still matches transformers"
