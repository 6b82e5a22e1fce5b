"""A quantized KV cache (engine setting kv_cache_dtype, llmd.gpu.layers.kv_quant) on CPU:
the quantizer against the formats' definitions, the torch backend and the C++ kernels
against attention over the dequantized K/V, the pool's size, and whole requests against
the same engine with a float32 cache. The Triton kernels run the same layer cases in
tests/test_triton_attention.py (the `fp8-*` and `int8-*` cases of
triton_attention_cases.py) and the fused K/V write in tests/test_fused_ops.py."""
from __future__ import annotations

import math

import msgspec
import pytest
import torch
from triton_attention_cases import CASES, STORED_CASES, attend, build, layer_args, stored_reference

from llmd import LLM, SamplingParams
from llmd.config import EngineConfig, load_engine_config, resolved_kv_cache_dtype
from llmd.gpu.layers.attention import TorchAttention
from llmd.gpu.layers.attention_backends import resolve_attention_backend
from llmd.gpu.layers.cpu.cpu_kernels import paged_decode_op
from llmd.gpu.layers.fused_ops import attention_inputs_reference
from llmd.pool.estimate import kv_element_bytes
from llmd.gpu.layers.kv_quant import (FP8_E4M3, INT8, KVScales, cache_dtype, calibrated_scale, dequantize,
                                      kv_cache_format, quantize)

CPU = torch.device("cpu")


def e4m3_values() -> torch.Tensor:
    """The 256 values of e4m3fn bytes, from the format's definition (sign, 4 exponent
    bits biased by 7 with 0 subnormal, 3 mantissa bits; 0x7F and 0xFF NaN)."""
    values = []
    for b in range(256):
        exponent, mantissa = (b >> 3) & 0xF, b & 7
        v = math.ldexp(mantissa / 8, -6) if exponent == 0 else math.ldexp(1 + mantissa / 8, exponent - 7)
        values.append(float("nan") if b & 0x7F == 0x7F else -v if b & 0x80 else v)
    return torch.tensor(values, dtype=torch.float64)


def test_fp8_quantize_stores_the_nearest_e4m3_value_and_clamps() -> None:
    """Every stored byte holds the e4m3 value nearest x / scale (ties to the even
    mantissa), and values past +-448 (x 2 scale) store +-448, never NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(3000, generator=gen) * s for s in (1e-3, 0.1, 3.0, 200.0)] +
                  [torch.tensor([0.0, 450.0, -1e6, 2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875])])
    scale = 0.5
    stored = quantize(x, FP8_E4M3, KVScales(scale, 1.0).k_inv)
    table = e4m3_values()
    target = (x.double() / scale).clamp(-448, 448)
    finite = ~table.isnan()
    distance = (target[:, None] - table[None, finite]).abs()
    best = distance.min(dim=1).values
    got = table[stored.long()]
    assert not got.isnan().any()
    assert torch.equal((got - target).abs(), best)  # nearest (a tie: either neighbour's distance)
    ties = (distance == best[:, None]).sum(dim=1) > 1
    assert ties.sum() >= 2 and (stored[ties] & 1 == 0).all()  # 1.0625 and 1.1875 are ties: even mantissa
    assert dequantize(stored, FP8_E4M3, scale, torch.float32)[x.numel() - 5].item() == -448 * scale


def test_int8_quantize_rounds_and_clamps_symmetrically() -> None:
    x = torch.tensor([0.0, 0.26, -0.26, 0.75, 1.25, -1.25, 31.74, 1000.0, -1000.0])
    stored = quantize(x, INT8, KVScales(0.25, 1.0).k_inv)
    assert stored.tolist() == [0, 1, -1, 3, 5, -5, 127, 127, -127]  # ties (1.25/0.25 = 5 exactly) stay; -128 never
    assert dequantize(stored, INT8, 0.25, torch.float32).tolist()[:4] == [0.0, 0.25, -0.25, 0.75]


def test_calibrated_scales_put_the_calibration_amax_at_half_the_range() -> None:
    assert calibrated_scale(10.0, INT8) == pytest.approx(20.0 / 127)
    assert calibrated_scale(0.1, FP8_E4M3) == pytest.approx(0.2 / 448)


@pytest.mark.parametrize("value", ["fp4", "FP8", "float8", "", 8])
def test_bad_kv_cache_dtype_is_refused_naming_the_field(value) -> None:
    with pytest.raises((ValueError, msgspec.ValidationError), match="kv_cache_dtype"):
        load_engine_config(kv_cache_dtype=value)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=value)


def test_flash_attn_with_a_quantized_cache_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not read by attention_backend 'flash_attn'"):
        EngineConfig(kv_cache_dtype="fp8", attention_backend="flash_attn")
    # "auto" on CUDA never picks flash-attn for a quantized cache (no flash-attn here: triton or torch).
    assert resolve_attention_backend("auto", CPU, 256, torch.bfloat16, "int8") == "torch"
    assert kv_cache_format("fp8") is kv_cache_format("fp8_e4m3") is FP8_E4M3
    assert [resolved_kv_cache_dtype(s, "bfloat16") for s in ("auto", "fp8", "fp8_e4m3", "int8")] == \
        ["bfloat16", "fp8_e4m3", "fp8_e4m3", "int8"]


@pytest.mark.parametrize("name", STORED_CASES)
def test_torch_backend_over_a_quantized_or_16_bit_cache_is_attention_over_the_stored_kv(name: str) -> None:
    """TorchAttention (the gather path: no decode kernel) over a quantized cache, with
    the layer's scales: the output of the torch reference over the dequantized cache and
    quantized-dequantized K/V, and the cache torch's quantizer writes, byte for byte."""
    case = CASES[name]
    q, k, v, kv_cache, md = build(case)
    ref, ref_cache = stored_reference(case, q, k, v, kv_cache, md)
    layer = TorchAttention(*layer_args(case))
    layer.kv_scales = case.kv_scales
    out = attend(layer, q, k, v, kv_cache, md)
    assert torch.equal(kv_cache, ref_cache)
    tol = {"float32": 1e-5, "bfloat16": 4e-2, "float16": 4e-3}[case.dtype]
    assert (out.float() - ref.float()).abs().max().item() <= tol


def test_the_reference_itself_sees_quantization() -> None:
    """Guard against a vacuous comparison: with the scales ignored (read as 1) the torch
    backend's output is far from the reference."""
    case = CASES["int8-mixed"]
    q, k, v, kv_cache, md = build(case)
    ref, _ = stored_reference(case, q, k, v, kv_cache, md)
    out = attend(TorchAttention(*layer_args(case)), q, k, v, kv_cache, md)  # unit scales
    assert (out - ref).abs().max().item() > 1.0


@pytest.fixture(scope="module")
def decode_kernel():
    op = paged_decode_op()
    if op is None:
        pytest.skip("llmd's CPU kernels cannot be built here")
    return op


@pytest.mark.parametrize("name", ["fp8-mixed", "fp8-mixed-bf16", "int8-mixed", "int8-mixed-fp16",
                                  "int8-sliding-softcap-bf16", "fp8-decode-split3-padded", "fp16-cache-mixed",
                                  "bf16-cache-sliding-softcap", "fp16-cache-decode-split3-padded",
                                  "bf16-cache-head-dim-24-bs8"])
def test_cpu_paged_decode_kernel_reads_a_quantized_or_16_bit_cache(decode_kernel, name: str) -> None:
    """The C++ decode kernel over the quantized cache in place: the reference's output
    on the decode rows."""
    case = CASES[name]
    q, k, v, kv_cache, md = build(case)
    ref, ref_cache = stored_reference(case, q, k, v, kv_cache, md)
    layer = TorchAttention(*layer_args(case))
    layer.kv_scales = case.kv_scales
    layer.decode_kernel = decode_kernel
    out = attend(layer, q, k, v, kv_cache, md)
    assert torch.equal(kv_cache, ref_cache)
    n = md.num_decodes
    tol = {"float32": 1e-5, "bfloat16": 4e-2, "float16": 4e-3}[case.dtype]
    assert (out[:n].float() - ref[:n].float()).abs().max().item() <= tol


@pytest.mark.parametrize("head_dim", [16, 24])  # 24: a row widened partly by vector, partly by the table
def test_cpu_paged_decode_kernel_reads_every_e4m3_byte_exactly(decode_kernel, head_dim: int) -> None:
    """Each finite e4m3 byte in a value row of its own, attended alone (one cached token
    per request): the output is the byte's value from the format's definition, exactly,
    times v_scale."""
    values = e4m3_values()
    finite = torch.tensor([b for b in range(256) if not math.isnan(values[b])], dtype=torch.uint8)
    n = finite.numel()
    cache = torch.zeros(2, 1, n, 1, head_dim, dtype=torch.uint8)  # K all zero; block size 1
    cache[1, 0, :, 0, :] = finite.view(-1, 1)
    out = decode_kernel(torch.zeros(n, 1, head_dim), cache, torch.arange(n).view(n, 1), torch.ones(n, dtype=torch.int64),
                        1.0, 0.0, 0, 1.0, 0.5)
    expected = (values[finite.long()] * 0.5).float().view(-1, 1).expand(n, head_dim)
    assert torch.equal(out[:, 0], expected)


@pytest.mark.parametrize("kv_cache_dtype, dtype", [("fp8", torch.float32), ("fp8", torch.bfloat16),
                                                   ("int8", torch.float32), ("int8", torch.bfloat16),
                                                   ("float16", torch.float32), ("bfloat16", torch.float32)])
def test_cpu_fused_rope_cache_write_quantizes_as_torch_does(decode_kernel, kv_cache_dtype: str,
                                                            dtype: torch.dtype) -> None:
    """The C++ q/k rotary + K/V write into a quantized or 16-bit float cache: the bytes
    torch's quantizer (or conversion) writes for the reference's rotated K and its V,
    every other byte untouched."""
    fmt = kv_cache_format(kv_cache_dtype)
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, d = 7, 4, 2, 32
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 3).to(dtype)
    freqs = torch.outer(torch.arange(tokens).float() * 3, torch.rand(d // 2, generator=gen))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
    if fmt is None:  # float16 / bfloat16: no scales
        scales = KVScales()
        cache = torch.randn(2, kv_heads, 5, 4, d, generator=gen).to(cache_dtype(kv_cache_dtype, dtype))
    else:
        scales = KVScales(0.03, 0.05) if fmt is INT8 else KVScales(0.5, 2.0)
        cache = quantize(torch.randn(2, kv_heads, 5, 4, d, generator=gen), fmt, 1.0)
    slots = torch.randperm(20, generator=gen)[:tokens]
    fused, ref = cache.clone(), cache.clone()
    fused_qkv = qkv.clone()
    torch.ops.llmd_cpu.qk_rope_cache_(fused_qkv, heads, kv_heads, cos, sin, fused, slots, None, None, 1e-6, False,
                                      scales.k_inv, scales.v_inv)
    ref_q = attention_inputs_reference(qkv, heads, kv_heads, d, None, None, cos, sin, ref, slots, scales)
    assert torch.equal(fused, ref)
    assert torch.equal(fused_qkv[:, :heads * d].view(tokens, heads, d), ref_q)


def test_pool_holds_four_times_the_blocks_of_float32_in_the_same_bytes(tiny_llama) -> None:
    """kv_cache_memory_bytes buys 1-byte elements: four times the fp32 blocks, 2-byte
    ones twice (and the runner's bytes per block say so, as the pool's estimate does)."""
    budget = 40 * 2 ** 16
    blocks, per_block = {}, {}
    for kv in ("auto", "fp8", "int8", "float16", "bfloat16"):
        llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=budget,
                  kv_cache_dtype=kv)
        try:
            blocks[kv], per_block[kv] = llm.engine.num_blocks, llm.engine.memory().bytes_per_block
            caches = llm.engine.executor.runner.kv_caches
            assert sum(c.numel() * c.element_size() for c in caches) == (blocks[kv] + 1) * per_block[kv]
        finally:
            llm.engine.shutdown()
    assert per_block["auto"] == 4 * per_block["fp8"] == 4 * per_block["int8"] == 2 * per_block["float16"] \
        == 2 * per_block["bfloat16"]
    assert blocks["fp8"] == blocks["int8"] == budget // per_block["fp8"] >= 4 * blocks["auto"]
    assert blocks["float16"] == blocks["bfloat16"] == budget // per_block["float16"] >= 2 * blocks["auto"]
    assert [kv_element_bytes(kv, 4) for kv in ("auto", "fp8", "int8", "float16", "bfloat16")] == [4, 1, 1, 2, 2]


def test_a_16_bit_cache_under_a_16_bit_model_of_another_kind_is_refused(tiny_llama) -> None:
    """float16 / bfloat16 narrow a float32 model's K/V (or are its own dtype); a bfloat16
    model with a float16 cache would round twice: refused, naming the setting."""
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' with dtype 'bfloat16'"):
        LLM(model=str(tiny_llama), device="cpu", dtype="bfloat16", max_model_len=64, kv_cache_dtype="float16")
    llm = LLM(model=str(tiny_llama), device="cpu", dtype="bfloat16", max_model_len=64, num_gpu_blocks_override=8,
              kv_cache_dtype="bfloat16")  # the model's own dtype: as "auto"
    try:
        assert llm.engine.kv_cache_dtype == "bfloat16"
        assert all(c.dtype == torch.bfloat16 for c in llm.engine.executor.runner.kv_caches)
    finally:
        llm.engine.shutdown()


# Long enough for whole 16-token blocks, which the prefix cache keeps.
PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill.",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,",
           "Once upon a time in a land far away, there lived a king who had three daughters and a dragon."]


@pytest.fixture(scope="module")
def runs(tiny_llama) -> dict[str, dict]:
    """Each kv_cache_dtype on the same engine otherwise (float32 model, CPU kernels,
    prefix caching): greedy completions of PROMPTS, sent twice (the second time a
    prefix-cache hit), and the logprobs of every position of the float32-cache run's
    prompt + completion read back as prompt logprobs (teacher forcing: each position's
    prediction from the same context)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    runs: dict[str, dict] = {}
    for kv in ("auto", "fp8", "int8", "float16", "bfloat16"):
        llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                  kv_cache_dtype=kv)
        try:
            first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
            again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
            hits = llm.engine.get_stats()["prefix_cache_hits"]
            if kv == "auto":
                texts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                         for o in llm.generate(PROMPTS, greedy)]
            positions = [(token, pos) for seq, o in zip(texts, llm.generate(texts, forced))
                         for token, pos in zip(seq[1:], o.prompt_logprobs[1:])]
            runs[kv] = {"first": first, "again": again, "hits": hits,
                        "logprob": [pos[token].logprob for token, pos in positions],
                        "top": [max(pos, key=lambda t: pos[t].logprob) for _, pos in positions]}
        finally:
            llm.engine.shutdown()
    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              kv_cache_dtype="fp8", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        runs["fp8-ngram"] = {"first": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]}
    finally:
        llm.engine.shutdown()
    return runs


# Bounds measured on tiny-llama (277 positions): fp8 72% top-1 agreement, mean |dlogprob|
# 1.06; int8 84%, 0.66; float16 98.9%, 0.0064; bfloat16 97.8%, 0.052. The fixture is a worst case by construction (make_model's peaked
# init: attention scores of std 4, logits of std 8, so a 3% error in a key moves a score
# by ~0.1 and the logits by far more); docs/models.md has the real SmolLM2's figures.
QUALITY = {"fp8": (0.65, 1.3), "int8": (0.75, 0.85), "float16": (0.96, 0.02), "bfloat16": (0.93, 0.12)}


@pytest.mark.parametrize("kv", ["fp8", "int8", "float16", "bfloat16"])
def test_quantized_cache_predicts_the_float32_cache_tokens(runs, kv: str) -> None:
    """Teacher-forced over the float32-cache run's greedy text: the quantized cache's
    greedy token (top-1) is the float32 cache's at most positions, and the text's
    logprobs stay within the stated mean distance (QUALITY)."""
    ref, got = runs["auto"], runs[kv]
    agree = sum(a == b for a, b in zip(ref["top"], got["top"])) / len(ref["top"])
    mean_delta = sum(abs(a - b) for a, b in zip(ref["logprob"], got["logprob"])) / len(ref["logprob"])
    min_agree, max_delta = QUALITY[kv]
    assert len(ref["top"]) > 200
    assert agree >= min_agree and mean_delta <= max_delta, (kv, agree, mean_delta)


@pytest.mark.parametrize("kv", ["fp8", "int8", "float16", "bfloat16"])
def test_a_prefix_cache_hit_reads_what_a_fresh_prefill_computed(runs, kv: str) -> None:
    """The second pass of every prompt hits the prefix cache (its blocks hold quantized
    K/V) and decodes the first pass's tokens exactly: a quantized prompt attends over the
    stored K/V whether they were computed in the step or read back."""
    assert runs[kv]["hits"] > 0
    assert runs[kv]["first"] == runs[kv]["again"]


def test_speculative_decoding_verifies_over_a_quantized_cache(runs) -> None:
    """n-gram speculation with an fp8 cache: the verify rows (several new tokens over the
    cached context, a prefill row to the kernels) read the same stored K/V as the plain
    decode steps, so greedy output is the same text."""
    assert runs["fp8-ngram"]["first"] == runs["fp8"]["first"]


def test_the_daemon_takes_the_flag_and_status_shows_the_format(tiny_llama, tmp_path) -> None:
    """`llmd serve --kv-cache-dtype fp8`: the status reply and `llmctl status` say what
    the cache stores and where its scales come from (this checkpoint has none of its own:
    calibrated; tests/test_checkpoint_kv_scales: "checkpoint"); a bad value stops the
    daemon with the field's name."""
    from daemon_util import Daemon, RawConn

    from llmd_client.llmctl import format_status
    from llmd_client.protocol import StatusReply

    d = Daemon(str(tiny_llama), tmp_path / "kv.sock", "--kv-cache-dtype", "fp8").wait_ready()
    try:
        with RawConn(d.sock) as conn:
            conn.send({"type": "status"})
            reply = conn.recv()
        assert reply["kv_cache_dtype"] == "fp8_e4m3"
        assert reply["models"][0]["kv_cache_dtype"] == "fp8_e4m3"
        assert reply["kv_cache_scales"] == reply["models"][0]["kv_cache_scales"] == "calibrated"
        assert "blocks (0.0%), fp8_e4m3 (calibrated scales)" in format_status(msgspec.convert(reply, StatusReply))
    finally:
        assert d.stop() == 0, d.log.read_text()
    bad = Daemon(str(tiny_llama), tmp_path / "bad.sock", "--kv-cache-dtype", "fp4")
    assert bad.proc.wait(timeout=60) != 0
    assert "kv-cache-dtype" in bad.log.read_text()


def test_the_benchmark_runs_every_setting(tiny_llama, capsys, monkeypatch) -> None:
    """tools/bench_kv_cache_dtype (docs/benchmarks.md's figures) at a tiny size: the
    bytes per token of each setting and one timed decode call over each cache."""
    from llmd_tools import bench_kv_cache_dtype

    monkeypatch.setattr("sys.argv", ["bench", "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu",
                                     "--batch", "2", "--context", "40", "--heads", "4", "--kv-heads", "2",
                                     "--rounds", "1", "--calls", "1", "--threads", "1", "--clock", "cpu"])
    bench_kv_cache_dtype.main()
    out = capsys.readouterr().out
    per_token = {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if "B/token" in line}
    assert per_token["auto"] == 4 * per_token["fp8"] == 4 * per_token["int8"]
    assert all(f"  {s} " in out and "ms/call" in out for s in ("auto", "fp8", "int8"))


def test_the_attention_benchmark_times_the_kernel_alone_for_every_case(capsys, monkeypatch) -> None:
    """bench_kv_cache_dtype --attention (docs/benchmarks.md, "Paged decode at batch 32 on
    the CPU") at a tiny size: a timed row for every setting x batch x context."""
    from llmd_tools import bench_kv_cache_dtype

    if paged_decode_op() is None:
        pytest.skip("llmd's CPU kernels cannot be built here")
    monkeypatch.setattr("sys.argv", ["bench", "--attention", "--dtype", "float32", "--device", "cpu", "--batch", "1",
                                     "3", "--context", "20", "33", "--heads", "4", "--kv-heads", "2", "--layers", "2",
                                     "--rounds", "1", "--calls", "1", "--threads", "1", "--clock", "cpu"])
    bench_kv_cache_dtype.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["auto"], ["fp8"],
                                                                                                   ["int8"])]
    assert sorted((r[0], int(r[1]), int(r[2])) for r in rows) == sorted(
        (s, b, c) for s in ("auto", "fp8", "int8") for b in (1, 3) for c in (20, 33))
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)  # microseconds, GMAC/s


def test_the_benchmark_baseline_is_the_old_kernel_under_a_namespace_of_its_own() -> None:
    """--baseline REV's source: that commit's cpu_kernels.cpp and the headers it includes
    (transitively), its operators registered under another namespace (two libraries may
    not share one), its code otherwise untouched."""
    import subprocess

    from llmd_tools.bench.kernel_revision import NAMESPACE, repo_root, revision_sources

    try:
        repo = repo_root()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    rev = revision_sources("HEAD", repo)
    head = subprocess.run(["git", "-C", str(repo), "show", "HEAD:daemon/gpu/layers/cpu/cpu_kernels.cpp"],
                          capture_output=True, text=True, check=True).stdout
    assert rev.namespace.startswith(f"{NAMESPACE}_rev_")
    assert f"TORCH_LIBRARY({rev.namespace}, m)" in rev.source and f"TORCH_LIBRARY_IMPL({rev.namespace}, CPU, m)" in rev.source
    assert f"TORCH_LIBRARY({NAMESPACE}," not in rev.source
    assert rev.source.replace(rev.namespace, NAMESPACE) == head
    assert {"cpu_vec.h", "cpu_e4m3.h"} <= set(rev.headers)
    with pytest.raises(ValueError, match="--baseline"):
        revision_sources("no-such-revision", repo)


def test_the_decode_step_benchmark_swaps_the_kernel_in_turns(tiny_llama, capsys) -> None:
    """tools/bench_decode_step (docs/benchmarks.md's end-to-end figure) at a tiny size,
    A/A: both sides run this checkout's kernel, in turns, every step timed."""
    from llmd_tools import bench_decode_step

    if paged_decode_op() is None:
        pytest.skip("llmd's CPU kernels cannot be built here")
    assert bench_decode_step.main(["--model", str(tiny_llama), "--batch", "2", "--input-len", "8", "--warmup", "1",
                                   "--against", "this", "--rounds", "2", "--steps-per-round", "2", "--json"]) == 0
    r = msgspec.json.decode(capsys.readouterr().out)
    assert r["layers"] > 0
    assert [s["steps"] for s in r["ms_per_step"].values()] == [4, 4]
    assert all(s["median"] > 0 for s in r["ms_per_step"].values()) and r["speedup"] > 0
