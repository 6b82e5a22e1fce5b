"""GGUF checkpoints: llmd loading a .gguf gives the greedy tokens and logprobs of
transformers loading the same file (`gguf_file=`, fp32), for llama (q/k rows in
llama.cpp's rotary order), tied embeddings, qwen2 (qkv bias) and qwen3 (q/k norm), in F32
and quantized types; K-quant tensors load as an independent dequantizer reads them; TP=2
ranks keep their shares packed; a BF16 file runs in bfloat16 under `--dtype auto`, its
weights as the file holds them; bad files and what llmd does not implement are clear errors;
Gemma 3's metadata read as llama.cpp reads it. The real files against transformers:
test_gguf_real_models.py."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as T
from gguf_fixtures import gguf_with, write_gguf
from hf_ref import check_logprobs_close, engine_result, hf_greedy, hf_model
from llmd import LLM, SamplingParams
from llmd.gpu.layers.cpu.cpu_linear import checkpoint_weight
from llmd.gpu.layers.linear import LinearBase
from llmd.gpu.models.gguf_arch import gemma3_config_fields
from llmd.gpu.models.gguf_summary import gguf_summary
from llmd.gpu.models.loader import load_hf_config, load_model, load_tokenizer
from tiny_models import tiny_models
from test_engine_vs_hf import TEXTS, _deviation

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SETTINGS = dict(device="cpu", dtype="float32", num_gpu_blocks_override=128, max_model_len=256)

# HF fixtures llama.cpp's converter could take: llama without llama3 rope scaling (that
# becomes a rope_freqs tensor, which transformers' GGUF loader, the reference here, skips:
# tests/test_gguf_rope_freqs.py checks it), no vocab padding, and an intermediate size
# Q8_0's 32-wide blocks fit. transformers' qwen3 GGUF config ignores key_length (its
# Qwen3Config defaults head_dim to 128), so the qwen3 fixture has head_dim 128.
HF_FIXTURES = {
    "llama": dict(arch="llama", llama3_rope=False, intermediate_size=192),
    "llama-tied": dict(arch="llama", llama3_rope=False, intermediate_size=192, tie_word_embeddings=True),
    # llama3 rope scaling (x8 from 64 positions): the file carries it as rope_freqs
    "llama3-rope": dict(arch="llama", intermediate_size=192),
    "qwen2": dict(arch="qwen2", pad_vocab=False, intermediate_size=192),
    "qwen3": dict(arch="qwen3", intermediate_size=192, head_dim=128),
    # rows of 256 and 512: every K-quant block fits
    "llama-256": dict(arch="llama", llama3_rope=False, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, head_dim=64),
    "llama-512": dict(arch="llama", llama3_rope=False, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=2, head_dim=64, num_attention_heads=8, num_key_value_heads=2),
    # intermediate 768: a K-quant's equal share (384) cuts a block; rank shares 512 / 256
    "llama-512-768": dict(arch="llama", llama3_rope=False, hidden_size=512, intermediate_size=768,
                          num_hidden_layers=2, head_dim=64, num_attention_heads=8, num_key_value_heads=2),
    "llama-256-tied": dict(arch="llama", llama3_rope=False, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, head_dim=64, tie_word_embeddings=True),
}
CASES = [("llama", T.F32), ("llama", T.Q8_0), ("llama-tied", T.Q4_1), ("qwen2", T.F16), ("qwen3", T.BF16)]
# TP=2 packed: 32-weight blocks with a tied table; K-quants, whose 256-weight blocks every
# row-parallel share of hidden 512 / intermediate 1024 holds whole; intermediate 768 split
# in whole blocks (512 / 256: tp.split_share)
TP_CASES = [("llama-tied", T.Q4_1, ()), ("llama-512", T.F32, (T.Q4_K, T.Q6_K)),
            ("llama-512-768", T.F32, (T.Q6_K, T.Q4_K))]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("gguf-hf"), HF_FIXTURES)


@pytest.fixture(scope="module")
def ggufs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")

    @functools.cache
    def get(name: str, qtype: T = T.F32, k_quants: tuple[T, ...] = ()) -> str:
        tag = "-".join(q.name for q in k_quants) or qtype.name
        return str(write_gguf(hf_dirs(name), root / f"{name}-{tag}.gguf", qtype, k_quant_types=k_quants))

    return get


def _compare_with_transformers(path: str, llm: LLM, texts=TEXTS[:3]) -> None:
    _, tokenizer = hf_model(path)
    prompts = [tokenizer(t).input_ids for t in texts]
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, GREEDY))):
        compared = check_logprobs_close(hf_greedy(path, prompt, MAX_TOKENS), engine_result(out), f"{path} #{i}")
        assert compared >= MAX_TOKENS // 2, f"{path} #{i}: diverged at token {compared}"


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("name,qtype", CASES, ids=[f"{n}-{q.name}" for n, q in CASES])
def test_gguf_matches_transformers(ggufs, name, qtype):
    path = ggufs(name, qtype)
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert qtype in types  # the file really holds the quantized type
    llm = LLM(model=path, **SETTINGS)
    assert llm.engine.tokenizer.chat_template is not None
    _compare_with_transformers(path, llm)


def test_a_gguf_names_its_dtype_as_its_matrices_are(ggufs):
    """A GGUF's config carries the dtype of its matrices as an HF checkpoint's does, F32
    ones beside (llama.cpp's converter keeps a mixture of experts' routers F32 in a BF16
    file); none where a matrix is packed or two 16-bit types meet. `--dtype auto` on CPU
    runs an F16, F32 or quantized file in float32 (a BF16 one: the next test)."""
    from llmd.gpu.layers.gguf_types import matrices_dtype
    from llmd.gpu.models.loader import resolve_dtype

    def record(kind: str, dims: int) -> SimpleNamespace:
        return SimpleNamespace(tensor_type=SimpleNamespace(name=kind), shape=(64,) * dims)

    assert matrices_dtype([record("BF16", 3), record("F32", 2), record("F32", 1)]) == "bfloat16"
    assert matrices_dtype([record("F32", 2), record("F32", 1)]) == "float32"
    assert all(matrices_dtype([record(a, 2), record(b, 2)]) is None for a, b in (("BF16", "Q8_0"), ("BF16", "F16")))
    for name, qtype, named in (("qwen2", T.F16, "float16"), ("llama", T.F32, "float32"), ("llama", T.Q8_0, None),
                               ("qwen3", T.BF16, "bfloat16")):
        config = load_hf_config(ggufs(name, qtype))
        assert str(config.dtype).removeprefix("torch.") == str(named)  # as engine_setup reads it
        expected = torch.bfloat16 if qtype == T.BF16 else torch.float32
        assert resolve_dtype("auto", torch.device("cpu"), named) == expected


def test_a_bf16_file_runs_in_bfloat16_as_the_file_holds_it(ggufs, hf_dirs):
    """`--dtype auto` on CPU runs a BF16 GGUF in bfloat16, as it runs an HF bf16
    checkpoint: every weight is the file's bf16 value (not a float32 copy at twice the
    bytes), the pool's estimate counts them so, and its tokens and logprobs part from the
    float32 reference no more than transformers' own bf16 model does."""
    from llmd.config import EngineConfig
    from llmd.gpu.worker.memory_profile import weight_storage
    from llmd.pool.estimate import estimate_need, read_shape

    path = ggufs("qwen3", T.BF16)
    llm = LLM(model=path, device="cpu", num_gpu_blocks_override=128, max_model_len=256)
    model = llm.engine.executor.runner.model
    assert llm.engine.dtype == torch.bfloat16
    in_file = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, tensor in (("embed_tokens", "token_embd"), ("layers.1.mlp.down_proj", "blk.1.ffn_down"),
                         ("layers.0.self_attn.o_proj", "blk.0.attn_output")):
        t = in_file[tensor + ".weight"]
        expected = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        got = checkpoint_weight(model.get_submodule(name))
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected.reshape(got.shape)), name
    held = sum(weight_storage(model).values()) - sum(b.untyped_storage().nbytes() for b in model.buffers())
    engine = EngineConfig(model=path, kv_cache_memory_bytes=1)
    assert estimate_need(engine, read_shape(path), "cpu", available_ram=0) == {"cpu": held + 1}
    # bf16 keeps ~3 digits: the reference is transformers on the file's weights in float32,
    # the yardstick how far transformers' own bf16 model of them (the HF directory the file
    # was written from, rounded alike) is from it (test_engine_vs_hf's bfloat16 test)
    _, tokenizer = hf_model(path)
    ours_n = hf_n = 0
    ours_worst = hf_worst = 0.0
    for i, text in enumerate(TEXTS[:3]):
        prompt = tokenizer(text).input_ids
        ours, ref = engine_result(llm.generate([prompt], GREEDY)[0]), hf_greedy(path, prompt, MAX_TOKENS)
        check_logprobs_close(ref, ours, f"bf16 #{i}", atol=float("inf"))
        n, worst = _deviation(ref, ours)
        ours_n, ours_worst = ours_n + n, max(ours_worst, worst)
        n, worst = _deviation(ref, hf_greedy(str(hf_dirs("qwen3")), prompt, MAX_TOKENS, dtype=torch.bfloat16))
        hf_n, hf_worst = hf_n + n, max(hf_worst, worst)
    assert ours_worst <= 1.5 * hf_worst + 0.05 and ours_n >= 0.6 * hf_n, (ours_n, ours_worst, hf_n, hf_worst)
    llm.engine.shutdown()


@pytest.mark.usefixtures("float32_products")
def test_k_quants_load_as_an_independent_dequantizer_reads_them(ggufs):
    """Q2_K..Q6_K (random blocks; the gguf package cannot quantize them): every weight
    llmd loads dequantized equals transformers' torch dequantizer on the file's bytes,
    rows put back in HF order by transformers' own inverse of llama.cpp's permutation;
    the model kept packed (every projection, q, k and v each in its own type) then
    matches transformers loading the same file."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path = ggufs("llama-256", k_quants=K_QUANTS)
    config = load_hf_config(path)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} >= set(K_QUANTS)
    model = load_model(path, torch.float32, torch.device("cpu"), 256, dequantize=True)
    params = {name + ".weight": checkpoint_weight(m) for name, m in model.named_modules() if hasattr(m, "weight")}
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                             "num_key_value_heads": config.num_key_value_heads})
    attn = model.layers[0].self_attn
    rows = {"q": (0, attn.q_size), "k": (attn.q_size, attn.kv_size), "v": (attn.q_size + attn.kv_size, attn.kv_size)}
    for t in reader.tensors:
        if t.tensor_type not in K_QUANTS:
            continue
        shape = tuple(reversed(t.shape.tolist()))
        expected = torch_dequantize(torch.from_numpy(np.array(t.data)).reshape(-1), int(t.tensor_type)).reshape(shape)
        expected = torch.from_numpy(unpermute.process(expected.numpy(), t.name).weights)
        layer, kind = t.name.split(".")[1], t.name.split(".")[2]
        if kind in ("attn_q", "attn_k", "attn_v"):
            start, size = rows[kind[-1]]
            got = params[f"layers.{layer}.self_attn.qkv_proj.weight"][start:start + size]
        elif kind in ("ffn_gate", "ffn_up"):
            inter = config.intermediate_size
            start = 0 if kind == "ffn_gate" else inter
            got = params[f"layers.{layer}.mlp.gate_up_proj.weight"][start:start + inter]
        else:
            got = params[{"attn_output": f"layers.{layer}.self_attn.o_proj.weight",
                          "ffn_down": f"layers.{layer}.mlp.down_proj.weight"}[kind]]
        assert torch.equal(got, expected), f"{t.name} ({t.tensor_type.name})"
    llm = LLM(model=path, **SETTINGS)
    packed = {name: m.quant for name, m in llm.engine.executor.runner.model.named_modules()
              if isinstance(m, LinearBase)}
    assert all(quant is not None and "_K" in quant for quant in packed.values()), packed
    assert len({quant for name, quant in packed.items() if "qkv_proj" in name and "+" in quant}) > 0
    _compare_with_transformers(path, llm, texts=TEXTS[:2])


def test_tokenizer_is_the_one_transformers_builds(ggufs):
    """llmd builds the tokenizer without AutoTokenizer's slow config read; it must be
    the same tokenizer: vocabulary, special tokens, chat template, encodings."""
    path = ggufs("llama", T.Q8_0)
    ours = load_tokenizer(path)
    _, reference = hf_model(path)
    assert ours.get_vocab() == reference.get_vocab()
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert ours.chat_template == reference.chat_template
    for text in [*TEXTS, "<|im_start|>user\n你好, 123456 don't<|im_end|>"]:
        assert ours(text).input_ids == reference(text).input_ids


def test_gguf_config_from_metadata(ggufs, hf_dirs):
    """The config llmd reads from the GGUF's metadata is the HF fixture's, field by field."""
    from transformers import AutoConfig

    for name in ("llama-tied", "qwen3"):
        ours = load_hf_config(ggufs(name, T.F32))
        hf = AutoConfig.from_pretrained(hf_dirs(name))
        for field in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                      "tie_word_embeddings", "bos_token_id", "eos_token_id"):
            assert getattr(ours, field) == getattr(hf, field), (name, field)
        assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
        assert ours.rope_parameters["rope_theta"] == hf.rope_parameters["rope_theta"]
    summary = gguf_summary(ggufs("llama", T.F32))
    assert summary.architecture == "LlamaForCausalLM"
    assert summary.num_params == sum(p.numel() for p in hf_model(ggufs("llama", T.F32))[0].parameters())


def test_gguf_rope_scaling_metadata(hf_dirs, tmp_path):
    """llama.cpp's rope scaling keys (which transformers' GGUF loader drops) become
    rope_parameters; an unknown scaling type is refused naming the key."""
    a = "llama"
    linear = write_gguf(hf_dirs("llama"), tmp_path / "linear.gguf", extra_metadata={
        f"{a}.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
        f"{a}.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)})
    assert load_hf_config(linear).rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    yarn = write_gguf(hf_dirs("llama"), tmp_path / "yarn.gguf", extra_metadata={
        f"{a}.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
        f"{a}.rope.scaling.factor": (2.0, gguf.GGUFValueType.FLOAT32),
        f"{a}.rope.scaling.original_context_length": (512, gguf.GGUFValueType.UINT32)})
    assert load_hf_config(yarn).rope_parameters == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                    "original_max_position_embeddings": 512}
    odd = write_gguf(hf_dirs("llama"), tmp_path / "odd.gguf", extra_metadata={
        f"{a}.rope.scaling.type": ("longrope", gguf.GGUFValueType.STRING),
        f"{a}.rope.scaling.factor": (2.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(ValueError, match="rope.scaling.type='longrope' is not implemented"):
        load_hf_config(odd)


def test_rope_freqs_become_per_frequency_factors(hf_dirs, tmp_path):
    """llama.cpp divides each inverse frequency by its rope_freqs factor (and a linear
    scaling's factor on top): transformers' longrope with those factors, short and long
    alike, and no attention factor, which divides the same way."""
    factors = np.array([1.0, 1.25, 2.5, 4.0, 8.0, 8.0, 8.0, 8.0], np.float32)  # the tiny llama's 16 / 2
    plain = write_gguf(hf_dirs("llama"), tmp_path / "freqs.gguf", extra_tensors={"rope_freqs.weight": factors})
    longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=factors.tolist(),
                    long_factor=factors.tolist(), original_max_position_embeddings=1024, factor=1.0,
                    attention_factor=1.0)
    assert load_hf_config(plain).rope_parameters == longrope
    linear = write_gguf(hf_dirs("llama"), tmp_path / "freqs-linear.gguf", extra_tensors={"rope_freqs.weight": factors},
                        extra_metadata={"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
                                        "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)})
    scaled = (factors * 4).tolist()
    assert load_hf_config(linear).rope_parameters == {**longrope, "short_factor": scaled, "long_factor": scaled}
    # and the loaded model's tables turn by base^(-2i/d) / factor_i
    model = load_model(plain, torch.float32, torch.device("cpu"), 64)
    (table,) = model.rotary.values()
    expected = torch.arange(64.0)[:, None] * (10000.0 ** (-torch.arange(0, 16, 2) / 16) / torch.from_numpy(factors))
    torch.testing.assert_close(table.cos_cache[:, :8], expected.cos(), atol=1e-5, rtol=0)
    torch.testing.assert_close(table.sin_cache[:, 8:], expected.sin(), atol=1e-5, rtol=0)


def converter_rope_freqs(config: dict) -> np.ndarray:
    """The rope_freqs llama.cpp's converter writes for a llama3 rope scaling
    (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors), transcribed."""
    rope = config.get("rope_parameters") or config["rope_scaling"]
    base, dim = rope.get("rope_theta", config.get("rope_theta")), config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def test_a_llama3_file_runs_as_transformers_runs_its_model(hf_dirs, tmp_path):
    """A llama with llama3 rope scaling written as the converter writes it (no scaling
    keys, a rope_freqs tensor) against transformers on the HF directory, which computes
    llama3's frequencies itself: a 200-token prompt, far past the 64 original positions
    where the scaling matters, then greedy tokens and logprobs. (With llama-cpp-python,
    test_gguf_rope_freqs.py does the same on llama.cpp's own converter output.)"""
    hf_dir = hf_dirs("llama3-rope")
    config = json.loads((hf_dir / "config.json").read_text())
    factors = converter_rope_freqs(config)
    assert factors.min() == 1.0 and factors.max() == 8.0  # the three bands are all there
    path = write_gguf(hf_dir, tmp_path / "llama3.gguf", extra_tensors={"rope_freqs.weight": factors})
    prompt = np.random.default_rng(0).integers(5, config["vocab_size"], 200).tolist()
    llm = LLM(model=str(path), **SETTINGS)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))[0]
    assert check_logprobs_close(hf_greedy(str(hf_dir), prompt, 16), engine_result(out), "llama3 rope") == 16


def test_rope_freqs_llama_cpp_would_not_apply_are_refused(hf_dirs, tmp_path):
    """Refused naming the tensor: a length other than one factor per rotated frequency, a
    type other than F32 (ggml's rope reads only F32), a factor that is not a positive
    number, the tensor beside YaRN scaling (not implemented), or on an architecture
    llama.cpp does not read it for (it refuses the file)."""
    S, F32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32
    ones = np.ones(8, np.float32)
    cases = [
        ("llama", dict(extra_tensors={"rope_freqs.weight": np.ones(7, np.float32)}),
         r"'rope_freqs.weight' has shape \[7\]; it must hold one factor per rotated frequency: \[8\] for the 16 "
         r"rotated dimensions"),
        ("llama", dict(extra_tensors={"rope_freqs.weight": np.ones(8, np.float16)}),
         "'rope_freqs.weight' has type F16; llama.cpp reads per-frequency rope factors only as F32"),
        ("llama", dict(extra_tensors={"rope_freqs.weight": np.array([1, 1, 0, 1, 1, 1, 1, 1], np.float32)}),
         "'rope_freqs.weight' holds 0.0 at index 2: every per-frequency rope factor must be a positive finite"),
        ("llama", dict(extra_tensors={"rope_freqs.weight": np.full(8, np.nan, np.float32)}),
         "'rope_freqs.weight' holds nan at index 0"),
        ("llama", dict(extra_tensors={"rope_freqs.weight": ones},
                       extra_metadata={"llama.rope.scaling.type": ("yarn", S),
                                       "llama.rope.scaling.factor": (2.0, F32)}),
         r"'rope_freqs.weight' \(per-frequency rope factors\) together with llama.rope.scaling.type='yarn' is not "
         "implemented"),
        ("qwen2", dict(extra_tensors={"rope_freqs.weight": ones}),
         "'rope_freqs.weight' .* is not part of a 'qwen2' model: llama.cpp reads it only for the llama family"),
    ]
    for i, (name, extra, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            LLM(model=str(write_gguf(hf_dirs(name), tmp_path / f"refused-{i}.gguf", **extra)), device="cpu")


@pytest.mark.usefixtures("float32_products")
@pytest.mark.parametrize("name,qtype,k_quants", TP_CASES, ids=[f"{n}-{q.name}" for n, q, _ in TP_CASES])
def test_tp2_ranks_keep_their_packed_shares(ggufs, name, qtype, k_quants):
    """TP=2 over a GGUF: each rank keeps its share of every quantized weight packed (q/k/v
    and gate/up rows, o_proj and down_proj columns as whole blocks, the vocabulary's rows,
    a table tied to the LM head) and computes what transformers does reading the file;
    the ranks together hold each packed type's bytes of one rank's model, no more (the
    vocabulary padded to a whole share of rows on the last rank aside)."""
    path = ggufs(name, qtype, k_quants)
    one = LLM(model=path, **SETTINGS)
    whole = one.engine.executor.weight_bytes()
    one.engine.shutdown()
    tp = LLM(model=path, tensor_parallel_size=2, **SETTINGS)
    try:
        _compare_with_transformers(path, tp, TEXTS[:2])
        shares = tp.engine.executor.weight_bytes()
    finally:
        tp.engine.shutdown()
    packed = {kind for kind in whole if kind[:1] in "QI"}
    assert packed and packed == {kind for kind in shares if kind[:1] in "QI"}, (whole, shares)
    config = load_hf_config(path)
    for kind in packed:
        padding = config.hidden_size * 4 * (config.vocab_size % 2)  # one zero row a table, at most 4 bytes a weight
        assert whole[kind] <= shares[kind] <= whole[kind] + 2 * padding, (kind, whole, shares)


def test_tp2_refuses_a_share_that_cuts_blocks(ggufs):
    """A row-parallel share narrower than a K-quant's 256-weight blocks cannot stay packed:
    refused naming the tensor and the share, with the way to load it anyway."""
    path = ggufs("llama-256", T.F32, (T.Q4_K,))
    with pytest.raises(Exception, match=r"GGUF tensor 'blk\.0\.attn_output\.weight' of type Q4_K cannot stay "
                                        r"packed: its rows of 128 weights \(this rank's share of "
                                        r"tensor_parallel_size 2\) are not a whole number of Q4_K's 256-weight "
                                        r"blocks; dequantize=True \(--dequantize\)"):
        LLM(model=path, tensor_parallel_size=2, **SETTINGS)


# -- bad input: clear errors naming the problem ---------------------------------------------

def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is a text file, not a model\n")
    with pytest.raises(ValueError, match=r"is not a GGUF file: it starts with b'this'"):
        LLM(model=str(path))


def test_truncated_gguf(ggufs, tmp_path):
    data = Path(ggufs("llama", T.Q8_0)).read_bytes()
    cut_data = tmp_path / "cut-data.gguf"
    cut_data.write_bytes(data[:-1000])
    with pytest.raises(ValueError, match=r"cut-data.gguf' is truncated: tensor '[\w.]+' ends at byte \d+, the file "
                                         rf"has {len(data) - 1000}"):
        load_hf_config(cut_data)
    cut_header = tmp_path / "cut-header.gguf"
    cut_header.write_bytes(data[:300])
    with pytest.raises(ValueError, match=r"cut-header.gguf' is truncated: .* at byte \d+ needs \d+ bytes, the file "
                                         r"has 300"):
        load_hf_config(cut_header)


def test_unsupported_tensor_type(hf_dirs, tmp_path):
    """A type the gguf package cannot dequantize (Q8_1, llama.cpp's activation format)."""
    rows, cols = 32, 64  # blk.0.attn_v of the tiny llama: kv heads 2 x head dim 16, hidden 64
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[T.Q8_1]
    q81 = np.zeros((rows, cols // block_elems * block_bytes), dtype=np.uint8)
    path = write_gguf(hf_dirs("llama"), tmp_path / "q81.gguf", raw_tensors={"blk.0.attn_v.weight": (q81, T.Q8_1)})
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight' has type Q8_1, which llmd cannot dequantize "
                                         r"\(supported: F32, F16, Q4_0, Q4_1"):
        load_hf_config(path)


def test_unimplemented_architecture_and_features_are_refused(hf_dirs, tmp_path):
    U32 = gguf.GGUFValueType.UINT32
    other = gguf_with(tmp_path / "starcoder2.gguf", "starcoder2", {"starcoder2.block_count": (1, U32)},
                      {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(ValueError, match=r"GGUF architecture 'starcoder2' is not implemented by llmd "
                                         r"\(supported: gemma2, gemma3, granite, llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe, smollm3\)"):
        LLM(model=str(other))
    llama = hf_dirs("llama")
    refusals = [
        # experts make a llama file Mixtral (tests/test_gguf_moe.py), every layer sparse
        (dict(extra_metadata={"llama.expert_count": (8, U32), "llama.expert_used_count": (2, U32)}),
         r"'blk.0.ffn_(gate|up|down).weight' has no counterpart in llmd's llama model \(MixtralForCausalLM\)"),
        (dict(extra_metadata={"llama.attention.sliding_window": (16, U32)}),
         "llama.attention.sliding_window is not implemented by llmd"),
        (dict(extra_metadata={"llama.rope.dimension_count": (8, U32)}),
         r"llama.rope.dimension_count=8 differs from the head size 16 \(partial rotary\)"),
        (dict(extra_tensors={"blk.0.attn_gate.weight": np.ones((64, 64), np.float32)}),
         "'blk.0.attn_gate.weight' has no counterpart"),
    ]
    for i, (extra, message) in enumerate(refusals):
        with pytest.raises(ValueError, match=message):
            load_hf_config(write_gguf(llama, tmp_path / f"refused-{i}.gguf", **extra))


def test_http_model_description_of_a_gguf(ggufs):
    from llmd.http.context import describe_model

    path = ggufs("llama", T.Q8_0)
    engine = SimpleNamespace(model_dir=path, max_model_len=256, tokenizer=load_tokenizer(path), dtype=torch.float32)
    served = describe_model(engine)
    assert served.architecture == "LlamaForCausalLM" and served.num_params == gguf_summary(path).num_params
    assert served.format == "gguf"


def test_quantization_level_is_the_files_type(ggufs, hf_dirs, tmp_path):
    """What Ollama's /api/show and /api/tags call the file: general.file_type, which
    llama.cpp's converters write, else (these fixtures write none) the type of the
    matrices."""
    for qtype in (T.Q4_1, T.Q8_0, T.F16):
        assert gguf_summary(ggufs("llama", qtype)).quantization == qtype.name
    labelled = write_gguf(hf_dirs("llama"), tmp_path / "labelled.gguf", T.Q8_0, extra_metadata={
        "general.file_type": (int(gguf.LlamaFileType.MOSTLY_Q4_K_M), gguf.GGUFValueType.UINT32)})
    assert gguf_summary(labelled).quantization == "Q4_K_M"


def test_gemma3_metadata_is_read_as_llama_cpp_reads_it():
    """What a gemma3 GGUF does not store, derived as llama.cpp derives it: every sixth
    layer global, local rope theta 10000, attention scale 1/sqrt(head_dim) except on
    the 27B (62 layers: hidden / heads), no sliding layers without a window."""
    def fields(layers: int, hidden: int, heads: int, head_dim: int, metadata: dict) -> dict:
        rope = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
        base = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim,
                    rope_parameters=rope)
        return gemma3_config_fields(lambda key, default=None: metadata.get(key, default), "gemma3", base)

    one_b = fields(26, 1152, 4, 256, {"gemma3.attention.sliding_window": 512})
    assert one_b["query_pre_attn_scalar"] == 256
    assert one_b["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert one_b["sliding_window"] == 512 and one_b["final_logit_softcapping"] is None
    assert one_b["rope_parameters"] == {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    big = fields(62, 5376, 32, 128, {"gemma3.attention.sliding_window": 1024, "gemma3.rope.freq_base_swa": 5e4})
    assert big["query_pre_attn_scalar"] == 168 and big["rope_parameters"]["sliding_attention"]["rope_theta"] == 5e4
    no_window = fields(6, 640, 4, 256, {})
    assert no_window["layer_types"] == ["full_attention"] * 6 and no_window["sliding_window"] is None
