"""The flash-attn backend (llmd.gpu.layers.flash_attention) against the PyTorch reference, and
its choice at start-up.

flash-attn has no CPU build, so on CPU the backend calls a stand-in written from
flash-attn's documented contract (tests/fakes/flash_attn): it refuses what the real
kernel refuses (dtypes, int32 index tensors, 256-token pages, strides, table shape) and
computes attention row by row in fp32. That checks what our side is responsible for:
the cache views, the cumulative lengths, the block table, the causal alignment over a
cached prefix, the step's row order. With CUDA and the real flash-attn installed the
same cases run against it (the last test).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hf_ref import check_logprobs_close, engine_result
from triton_attention_cases import TOLERANCE, Case, attend, build, step_metadata

from llmd import LLM, SamplingParams
from llmd.gpu.layers import attention_backends
from llmd.gpu.layers.attention import TorchAttention
from llmd.gpu.layers.attention_backends import resolve_attention_backend
from llmd.gpu.worker.model_runner import ModelRunner
from llmd.gpu.worker.runner_types import RunnerSettings

FAKES = str(Path(__file__).with_name("fakes"))
CPU = torch.device("cpu")
BS = 256

# Contexts cross page boundaries (256, 257, 600) and prefix chunks end mid-page.
DECODES = (1, 256, 257, 600, 40)
PREFILLS = ((0, 40), (300, 17), (255, 3), (512, 1 + 4))
CASES: dict[str, Case] = {
    "decode": Case(4, 2, decodes=DECODES, block_size=BS, dtype="bfloat16"),
    "prefill-no-cache": Case(4, 2, prefills=((0, 300), (0, 7)), block_size=BS, dtype="bfloat16"),
    "chunked-prefill": Case(4, 1, prefills=PREFILLS, block_size=BS, dtype="float16"),
    "decode-padded-graph": Case(8, 2, decodes=(9, 300), pad_rows=2, table_blocks=4, block_size=BS,
                                dtype="float16"),
    "mixed-bs512": Case(4, 4, decodes=DECODES, prefills=PREFILLS, block_size=512, dtype="float16"),
}
# Sliding windows (window_size=(W - 1, 0)): windows inside one page, across a page
# boundary, and wider than some contexts; chunks whose window reaches into the prefix.
CASES.update({
    "sliding-decode": Case(4, 2, decodes=DECODES, block_size=BS, dtype="bfloat16", sliding_window=100),
    "sliding-mixed": Case(8, 2, decodes=DECODES, prefills=PREFILLS, block_size=BS, dtype="float16",
                          sliding_window=7),
    "sliding-prefill-no-cache": Case(4, 1, prefills=((0, 300), (0, 7)), block_size=BS, dtype="bfloat16",
                                     sliding_window=260),
    "sliding-padded-graph": Case(8, 2, decodes=(9, 300), pad_rows=2, table_blocks=4, block_size=BS,
                                 dtype="float16", sliding_window=33),
})
CASES.update({  # soft-capped scores (Gemma 2), with and without a window
    "softcap-mixed": Case(8, 2, decodes=DECODES, prefills=PREFILLS, block_size=BS, dtype="float16", softcap=2.0),
    "softcap-sliding-mixed": Case(4, 1, decodes=DECODES, prefills=PREFILLS, block_size=BS, dtype="bfloat16",
                                  sliding_window=40, softcap=0.5),
})
for _group in (1, 4, 8):
    CASES[f"mixed-gqa{_group}"] = Case(8, 8 // _group, decodes=DECODES, prefills=PREFILLS, block_size=BS,
                                       dtype="bfloat16")


@pytest.fixture
def fake_flash(monkeypatch):
    """flash_attn importable (the stand-in) for this test only."""
    monkeypatch.syspath_prepend(FAKES)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    import flash_attn

    yield flash_attn
    sys.modules.pop("flash_attn", None)


@pytest.fixture
def flash_on_cpu(fake_flash, monkeypatch):
    """The backend allowed on CPU (its CUDA-only check skipped) over the stand-in."""
    real = attention_backends._flash_problem
    monkeypatch.setattr(attention_backends, "_flash_problem",
                        lambda device, *a: real(torch.device("cuda"), *a))
    return fake_flash


def compare(case: Case, device: torch.device) -> tuple[float, float]:
    """(output error, cache error) of FlashAttention against TorchAttention on one step."""
    from llmd.gpu.layers.flash_attention import FlashAttention

    q, k, v, kv_cache, md = (t.to(device) if isinstance(t, torch.Tensor) else t for t in build(case))
    md.slot_mapping = md.slot_mapping.to(device)
    if md.num_decodes:
        md.decode_block_table = md.decode_block_table.to(device)
        md.decode_seq_lens = md.decode_seq_lens.to(device)
        md.decode_mask = md.decode_mask.to(device)
    md.prefills = [(s, n, c, ids.to(device)) for s, n, c, ids in md.prefills]
    args = (case.heads, case.kv_heads, case.head_dim, case.head_dim ** -0.5, case.sliding_window, case.softcap)
    ref_cache = kv_cache.clone()
    ref = attend(TorchAttention(*args), q, k, v, ref_cache, md)
    out = attend(FlashAttention(*args), q, k, v, kv_cache, md)
    return (out.float() - ref.float()).abs().max().item(), (kv_cache.float() - ref_cache.float()).abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_flash_backend_matches_the_torch_reference(fake_flash, name: str) -> None:
    case = CASES[name]
    before = fake_flash.CALLS["count"]
    out_err, cache_err = compare(case, CPU)
    assert fake_flash.CALLS["count"] == before + 1  # one launch for the whole step
    assert cache_err == 0.0
    assert out_err <= TOLERANCE[case.dtype], out_err


def test_step_arguments_are_built_once_and_in_token_order(fake_flash) -> None:
    from llmd.gpu.layers.flash_attention import FlashMetadataBuilder, flash_rows

    gen = torch.Generator().manual_seed(0)
    md, _, _ = step_metadata((5, 300), ((256, 10), (0, 3)), BS, gen)
    FlashMetadataBuilder(BS, CPU).build(md)
    cu_q, cu_k, max_q, max_k, table = md.flash_rows
    assert cu_q.tolist() == [0, 1, 2, 12, 15] and cu_k.tolist() == [0, 5, 305, 571, 574]
    assert (max_q, max_k) == (10, 512) and table.dtype == torch.int32 and table.shape == (4, 2)
    assert table[2].tolist() == md.prefills[0][3].tolist() and table[3, 0] == md.prefills[1][3][0]
    built = md.flash_rows
    FlashMetadataBuilder(BS, CPU).build(md)
    assert md.flash_rows is built  # built once per step: a second build (a draft model's) keeps it
    md.prefills[1] = (11, *md.prefills[1][1:])  # a gap between rows: refused, never misread
    with pytest.raises(ValueError, match="token order"):
        flash_rows(md, BS, CPU)


def runner_settings(**kw) -> RunnerSettings:
    return RunnerSettings(block_size=BS, max_model_len=1024, valid_vocab_size=1024, eos_token_id=None, seed=0,
                          **kw)


# tiny-qwen2-sw24: layer 0 full, layers 1-2 with a 24-token window (window_size (23, 0)).
@pytest.mark.parametrize("fixture,windows", [("tiny-llama", [(-1, -1)] * 3),
                                             ("tiny-qwen2-sw24", [(-1, -1), (23, 0), (23, 0)])])
def test_model_runner_step_and_graph_path_match_torch(flash_on_cpu, model_dirs, fixture: str,
                                                      windows: list[tuple[int, int]]) -> None:
    """A mixed step of a fixture (fp16) through every layer, and a padded decode step
    through the emulated graph path: the torch backend's hidden states and caches."""
    from llmd.gpu.layers.flash_attention import FlashAttention

    gen = torch.Generator().manual_seed(1)
    md, num_blocks, positions = step_metadata(DECODES, PREFILLS, BS, gen)
    graph_rows = (3, 300, 257)
    graph_md, _, graph_pos = step_metadata(graph_rows, (), BS, torch.Generator().manual_seed(2))
    ids = torch.randint(1000, positions.shape, generator=gen)
    hidden, caches, graph_hidden = {}, {}, {}
    for backend in ("torch", "flash_attn"):
        runner = ModelRunner(str(model_dirs(fixture)), runner_settings(attention_backend=backend, max_num_seqs=8),
                             CPU, torch.float16)
        assert runner.attention_backend == backend
        assert isinstance(runner.model.layers[0].self_attn.attn, FlashAttention) == (backend == "flash_attn")
        if backend == "flash_attn":
            assert [layer.self_attn.attn.window_size for layer in runner.model.layers] == windows
        runner.initialize_kv_cache(num_blocks)
        for i, cache in enumerate(runner.kv_caches):
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(i)))
        md.flash_rows = None
        with torch.inference_mode():
            runner.attention_metadata.build(md)
            hidden[backend] = runner.model(ids, positions, runner.kv_caches, md)
            runner.init_decode_graphs(emulate=True)
            tables = [row[:-(-n // BS)] for row, n in zip(graph_md.decode_block_table.tolist(), graph_rows)]
            graph_hidden[backend] = runner.decode_graphs.run(
                ids[:len(graph_rows)].tolist(), graph_pos.tolist(), graph_md.slot_mapping.tolist(),
                list(graph_rows), tables)
        assert runner.decode_graphs.padded_sizes == {4: 1}
        caches[backend] = torch.stack(runner.kv_caches)[:, :, :, :num_blocks]
    # fp16 through three layers, rounded at different points: within 2% of the largest
    # value (|hidden| reaches ~16, where one fp16 ulp is 1/64); a wrong key, block or
    # mask moves values by their own size.
    for got in (hidden, graph_hidden, caches):
        scale = got["torch"].abs().max().item()
        assert (got["flash_attn"] - got["torch"]).abs().max().item() <= 0.02 * scale


def test_a_cpu_model_on_a_machine_with_a_gpu_runs_the_unfused_ops(flash_on_cpu, model_dirs, monkeypatch) -> None:
    """With a GPU present, layer_ops hands a kernel backend's layers the compiled fused
    ops; a model placed on the CPU (here with the flash-attn stand-in) is given the
    unfused ones at load (the compiled kernels refuse CPU tensors: on a machine with an
    H200 the model runner's step failed in its first RMSNorm)."""
    pytest.importorskip("triton")
    from llmd.gpu.layers import fused_ops, fused_ops_triton

    monkeypatch.setattr(fused_ops_triton, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(fused_ops.layer_ops("flash_attn"), fused_ops.FusedLayerOps)
    runner = ModelRunner(str(model_dirs("tiny-llama")), runner_settings(attention_backend="flash_attn"), CPU,
                         torch.float16)
    ops = [m.ops for m in runner.model.modules() if hasattr(m, "ops")]
    assert ops and not any(isinstance(o, fused_ops.FusedLayerOps) for o in ops)


def test_engine_greedy_tokens_match_torch(flash_on_cpu, tiny_llama: Path) -> None:
    """Whole requests through the engine: chunked prefill (64-token steps), a shared
    300-token prefix served from the prefix cache (one full 256-token page), decode
    over page boundaries; the torch backend's greedy tokens and logprobs (fp16 rounds
    at different points in the two, so a near-tie may flip: check_logprobs_close)."""
    prefix = [(7 * i) % 900 + 3 for i in range(300)]
    prompts = [prefix + [11, 12, 13], prefix + [40, 41], [5, 6, 7, 8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    results, cached = {}, {}
    for backend in ("torch", "flash_attn"):
        llm = LLM(model=str(tiny_llama), device="cpu", dtype="float16", block_size=BS, max_model_len=1024,
                  num_gpu_blocks_override=12, max_num_batched_tokens=64, attention_backend=backend)
        first = llm.generate(prompts[:1], params)  # fills the prefix cache
        rest = llm.generate(prompts[1:], params)
        results[backend] = [engine_result(o) for o in first + rest]
        cached[backend] = rest[0].num_cached_tokens
    assert cached["flash_attn"] == cached["torch"] == BS
    # atol: in fp16 this model's logprobs move up to 0.22 from fp32's with either backend
    # (measured); a context one token short, or a page out of place, changes the first
    # token outright.
    compared = [check_logprobs_close(ref, got, f"prompt {i}", atol=0.3)
                for i, (ref, got) in enumerate(zip(results["torch"], results["flash_attn"]))]
    assert sum(compared) >= 48, compared


def test_flash_attn_choice_and_refusals(fake_flash) -> None:
    from llmd.gpu.layers.flash_attention import FlashAttention

    cuda = torch.device("cuda")  # only the checks run: nothing is allocated there
    assert resolve_attention_backend("auto", CPU, BS, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' runs on CUDA devices, not cpu"):
        resolve_attention_backend("flash_attn", CPU, BS, torch.bfloat16)
    assert attention_backends._flash_problem(cuda, BS, torch.bfloat16) is None
    assert resolve_attention_backend("auto", cuda, BS, torch.bfloat16) == "flash_attn"  # installed and fits
    assert resolve_attention_backend("auto", cuda, 16, torch.bfloat16) in ("triton", "torch")
    assert attention_backends._flash_problem(cuda, 512, torch.float16) is None
    assert "block_size is 16 (set block_size = 256)" in attention_backends._flash_problem(cuda, 16, torch.bfloat16)
    assert "float16 or bfloat16, not float32" in attention_backends._flash_problem(cuda, BS, torch.float32)
    with pytest.raises(ValueError, match="head_dim a multiple of 8 up to 256, not 12"):
        FlashAttention(4, 2, 12, 0.3)
    # A quantized KV cache: "auto" goes past flash-attn, which refuses it by name.
    assert resolve_attention_backend("auto", cuda, BS, torch.bfloat16, "fp8") in ("triton", "torch")
    with pytest.raises(ValueError, match="reads no quantized KV cache \\(kv_cache_dtype 'int8'"):
        resolve_attention_backend("flash_attn", cuda, BS, torch.bfloat16, "int8")
    layer = FlashAttention(4, 2, 64, 0.125)
    with pytest.raises(ValueError, match="does not read a quantized KV cache"):
        layer(torch.zeros(1, 4, 64), None, None, torch.zeros(2, 2, 1, BS, 64, dtype=torch.uint8), None, kv_written=True)


def test_flash_attn_missing_or_too_old(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as when not installed
    with pytest.raises(ValueError, match=r"'flash_attn' needs flash-attn \(pip install 'llmd\[gpu\]'\)"):
        resolve_attention_backend("flash_attn", torch.device("cuda"), BS, torch.bfloat16)
    old = type(sys)("flash_attn")
    old.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: q
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    with pytest.raises(ValueError, match=r"needs flash-attn >= 2.6"):
        resolve_attention_backend("flash_attn", torch.device("cuda"), BS, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_real_flash_attn_matches_the_torch_reference(name: str) -> None:
    pytest.importorskip("flash_attn")
    if attention_backends._flash_problem(torch.device("cuda"), BS, torch.bfloat16):
        pytest.skip(attention_backends._flash_problem(torch.device("cuda"), BS, torch.bfloat16))
    case = CASES[name]
    out_err, cache_err = compare(case, torch.device("cuda"))
    assert cache_err == 0.0 and out_err <= TOLERANCE[case.dtype], (out_err, cache_err)
