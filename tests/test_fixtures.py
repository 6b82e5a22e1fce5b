"""The model fixtures built by llmd_tools.make_model: loadable by HF transformers, the
configs the engine relies on, exact tokenizer round-trips, the ChatML template, peaked
(but not degenerate) greedy decoding, and the build cache."""
from __future__ import annotations

import json
import threading
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from conftest import TINY_MODELS
from llmd_tools import fixture_config
from llmd_tools import make_model as mm

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "def f(x):\n\treturn x  *  2   # trailing spaces   \n\n",
    "  leading spaces and a trailing newline\n",
    "Héllo wörld, façade, naïve, crème brûlée, Ångström, Łódź, e\u0301 (combining)",
    "你好，世界！今天天气很好。こんにちは世界。안녕하세요",
    "emoji 😀🚀🎉 zwj 👩‍💻 flag 🇯🇵 keycap 1️⃣ skin 👍🏽",
    "rare: ภาษาไทย ქართული 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x07 \u200b\ufeff",
    "",
    " ",
]

CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
CHAT_TEXT = (
    "<|bos|><|im_start|>system\nYou are helpful.<|im_end|>\n"
    "<|im_start|>user\nHi 你好<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nBye<|im_end|>\n"
)


def _tok(path: Path):
    return AutoTokenizer.from_pretrained(str(path))


def _cfg(path: Path):
    return AutoConfig.from_pretrained(str(path))


# --- loading and configs -------------------------------------------------------------


def test_tiny_loads_with_hf(tiny_model: Path) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert all(p.dtype == torch.float32 for p in model.parameters())
    st = load_file(str(tiny_model / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in st.values())
    meta = json.loads((tiny_model / "llmd_fixture.json").read_text())
    assert meta["param_count"] == sum(p.numel() for p in model.parameters())
    tok = _tok(tiny_model)
    assert len(tok) == meta["tokenizer_vocab_size"] == 1024
    assert model.config.vocab_size == meta["model_vocab_size"] >= len(tok)
    out = model(torch.tensor([tok("hi").input_ids])).logits
    assert out.shape[-1] == model.config.vocab_size and torch.isfinite(out).all()


def test_configs_gqa_and_special_ids(tiny_model: Path) -> None:
    cfg = _cfg(tiny_model)
    tok = _tok(tiny_model)
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 3, 4, 2)
    assert getattr(cfg, "head_dim", None) in (None, 16)
    assert cfg.max_position_embeddings == 1024
    ids = {t: tok.convert_tokens_to_ids(t) for t in mm.SPECIAL_TOKENS}
    assert ids == {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    ) == (0, 1, 2)
    gen = GenerationConfig.from_pretrained(str(tiny_model))
    assert gen.bos_token_id == 0 and gen.pad_token_id == 2
    assert gen.eos_token_id == [1, 4]


def test_tied_and_untied(tiny_llama: Path, tiny_llama_tied: Path) -> None:
    assert _cfg(tiny_llama).tie_word_embeddings is False
    assert "lm_head.weight" in load_file(str(tiny_llama / "model.safetensors"))
    assert _cfg(tiny_llama_tied).tie_word_embeddings is True
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_qwen2_padded_vocab_and_bias(tiny_qwen2: Path) -> None:
    cfg = _cfg(tiny_qwen2)
    n_tok = len(_tok(tiny_qwen2))
    assert n_tok == 1024
    assert cfg.vocab_size == fixture_config.padded_vocab_size(n_tok) == 1088 > n_tok
    st = load_file(str(tiny_qwen2 / "model.safetensors"))
    assert st["model.embed_tokens.weight"].shape[0] == 1088
    assert st["lm_head.weight"].shape[0] == 1088
    assert (st["lm_head.weight"][n_tok:] == 0).all()  # padded ids: logit exactly 0
    assert st["lm_head.weight"][:n_tok].abs().sum(-1).min() > 0
    for name in ("q_proj", "k_proj", "v_proj"):
        bias = st[f"model.layers.0.self_attn.{name}.bias"]
        assert bias.abs().max() > 0.01, name  # non-zero: an engine ignoring it would fail


def test_qwen3_has_qk_norm(tiny_qwen3: Path) -> None:
    st = load_file(str(tiny_qwen3 / "model.safetensors"))
    w = st["model.layers.0.self_attn.q_norm.weight"]
    assert w.shape == (16,) and not torch.allclose(w, torch.ones_like(w))
    assert "model.layers.0.self_attn.k_norm.weight" in st
    assert "model.layers.0.self_attn.q_proj.bias" not in st


def test_norm_weights_not_trivial(tiny_llama: Path) -> None:
    st = load_file(str(tiny_llama / "model.safetensors"))
    w = st["model.layers.0.input_layernorm.weight"]
    assert w.std() > 0.05  # an engine that ignores norm weights would fail the HF match


def test_llama3_rope_scaling(tiny_llama: Path) -> None:
    cfg = _cfg(tiny_llama)
    rp = cfg.rope_parameters
    assert rp["rope_type"] == "llama3"
    assert rp["factor"] == 8.0 and rp["low_freq_factor"] == 1.0 and rp["high_freq_factor"] == 4.0
    assert rp["original_max_position_embeddings"] == 64
    assert rp["rope_theta"] == 10000.0
    # the scaling changes results: same weights with plain RoPE give different logits
    tok = _tok(tiny_llama)
    ids = torch.tensor([tok("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)").input_ids])
    scaled = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    cfg_plain = _cfg(tiny_llama)
    cfg_plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_llama), config=cfg_plain, dtype=torch.float32)
    with torch.no_grad():
        diff = (scaled(ids).logits - plain(ids).logits).abs().max()
    assert diff > 0.1


def test_other_archs_plain_rope(tiny_qwen2: Path, tiny_qwen3: Path) -> None:
    for path in (tiny_qwen2, tiny_qwen3):
        assert _cfg(path).rope_parameters["rope_type"] == "default"


# --- tokenizer -----------------------------------------------------------------------


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_bos_and_round_trip(tiny_model: Path, text: str) -> None:
    tok = _tok(tiny_model)
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 0
    assert ids.count(0) == 1
    assert all(0 <= i < len(tok) for i in ids)
    # qwen2's tokenizer NFC-normalises (as real Qwen2 does): exact for NFC text
    nfc = json.loads((tiny_model / "tokenizer.json").read_text())["normalizer"] is not None
    expected = unicodedata.normalize("NFC", text) if nfc else text
    assert tok.decode(ids, skip_special_tokens=True) == expected
    assert tok(text, add_special_tokens=False).input_ids == ids[1:]


def test_round_trip_is_exact_for_unnormalised_text(tiny_llama: Path, tiny_qwen2: Path) -> None:
    text = "e\u0301 (combining accent), A\u030a"
    tok = _tok(tiny_llama)
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    tok = _tok(tiny_qwen2)
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == unicodedata.normalize("NFC", text)


def test_auto_tokenizer_matches_tokenizer_json(tiny_model: Path) -> None:
    """transformers 5 swaps in model-specific tokenizer classes (Qwen2Tokenizer for
    model_type qwen2) that rebuild the normalizer/pre-tokenizer; the fixtures are made so
    that the raw tokenizer.json still gives the same ids."""
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok = _tok(tiny_model)
    assert len(tok) == raw.get_vocab_size() == 1024
    assert tok.unk_token is None
    assert sorted(tok.all_special_tokens) == sorted(mm.SPECIAL_TOKENS)
    texts = ROUND_TRIP_TEXTS + [CHAT_TEXT, "e\u0301 don't   stop\r\n\r\n 12345 x=1;y=2"]
    for text in texts:
        assert tok(text).input_ids == raw.encode(text).ids, text
        ids = raw.encode(text).ids
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=False)


def test_tokenizer_is_byte_level_bpe_with_merges(tiny_llama: Path) -> None:
    data = json.loads((tiny_llama / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE"
    assert len(data["model"]["merges"]) > 500
    tok = _tok(tiny_llama)
    # learned merges: common Python words take few tokens; CJK is partially covered
    assert len(tok("import", add_special_tokens=False).input_ids) == 1
    assert len(tok(" return self", add_special_tokens=False).input_ids) <= 2
    cjk = "你好，世界"
    assert len(tok(cjk, add_special_tokens=False).input_ids) < len(cjk.encode())


def test_chat_template(tiny_model: Path) -> None:
    tok = _tok(tiny_model)
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert text == CHAT_TEXT
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == CHAT_TEXT + "<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:2] == [0, 3] and ids.count(0) == 1
    assert ids.count(4) == len(CHAT)
    assert tok.decode(ids) == text


def test_tokenizer_shared_between_tiny_fixtures(model_dirs) -> None:
    texts = {(model_dirs(n) / "tokenizer.json").read_text() for n in TINY_MODELS if "qwen2" not in n}
    assert len(texts) == 1
    q2 = json.loads((model_dirs("tiny-qwen2") / "tokenizer.json").read_text())
    assert q2["normalizer"]["type"] == "NFC"


# --- peaked, non-degenerate greedy decoding ------------------------------------------


def test_greedy_is_peaked_and_not_degenerate(tiny_model: Path) -> None:
    st = mm.greedy_stats(tiny_model, steps=64)
    n_tok = len(_tok(tiny_model))
    assert st["frac_gap_gt_0.05"] >= 0.95, st["frac_gap_gt_0.05"]
    assert min(st["distinct_per_seq"]) >= 20, st["distinct_per_seq"]
    assert sum(st["distinct_per_seq"]) / len(st["distinct_per_seq"]) >= 30, st["distinct_per_seq"]
    assert st["max_id"] < n_tok  # never a padded id
    assert len({tuple(s) for s in st["sequences"]}) == len(st["sequences"])


def test_greedy_stats_matches_hf_generate(tiny_qwen2: Path) -> None:
    tok = _tok(tiny_qwen2)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32)
    prompt = mm.DEFAULT_PROMPTS[0]
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, do_sample=False, max_new_tokens=24)[0, ids.shape[1]:].tolist()
    ref = mm.greedy_stats(tiny_qwen2, prompts=[prompt], steps=24)["sequences"][0]
    stop = [i for i, t in enumerate(ref) if t in (1, 4)]
    n = stop[0] + 1 if stop else len(ref)
    assert out == ref[:n]


# --- build cache ---------------------------------------------------------------------


def test_cache_hit_returns_same_path_without_rebuilding(model_dirs, monkeypatch) -> None:
    p1 = mm.fixture_path("tiny-llama", model_dirs.cache_dir)
    mtime = (p1 / "model.safetensors").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("rebuilt a cached fixture")

    monkeypatch.setattr(mm, "build_model", boom)
    p2 = mm.fixture_path("tiny-llama", model_dirs.cache_dir)
    assert p1 == p2 and (p2 / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_builds_build_once(tmp_path: Path, monkeypatch) -> None:
    calls = []
    real = mm.build_model

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(mm, "build_model", counting)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(mm.fixture_path("tiny-qwen3", tmp_path))
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1 and len(set(results)) == 1
    built = [p for p in tmp_path.iterdir() if p.name.startswith("tiny-qwen3")]
    assert built == [results[0]]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    AutoModelForCausalLM.from_pretrained(str(results[0]), dtype=torch.float32)


def test_recipe_change_changes_key(monkeypatch) -> None:
    before = mm.recipe_key("tiny-llama")
    monkeypatch.setitem(mm.FIXTURES, "tiny-llama", dict(arch="llama", preset="tiny", seed=1))
    assert mm.recipe_key("tiny-llama") != before
    with pytest.raises(KeyError):
        mm.recipe_key("no-such-fixture")


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = load_file(str(mm.build_model(tmp_path / "a", "qwen2", "tiny") / "model.safetensors"))
    b = load_file(str(mm.build_model(tmp_path / "b", "qwen2", "tiny") / "model.safetensors"))
    c = load_file(str(mm.build_model(tmp_path / "c", "qwen2", "tiny", seed=1) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_cli_prints_path(model_dirs, capsys) -> None:
    assert mm.main(["--name", "tiny-llama", "--out", str(model_dirs.cache_dir)]) == 0
    assert Path(capsys.readouterr().out.strip()) == model_dirs("tiny-llama")


# --- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", mm.ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_small_preset_param_count(arch: str, tied: bool) -> None:
    n = fixture_config.param_count(arch, "small", tie_word_embeddings=tied)
    assert 30e6 <= n <= 60e6, n


def test_small_llama_demo_model(model_dirs) -> None:
    # builds in a few seconds the first time (cached afterwards)
    path = model_dirs("small-llama")
    meta = json.loads((path / "llmd_fixture.json").read_text())
    assert meta["param_count"] == fixture_config.param_count("llama", "small")
    assert 30e6 <= meta["param_count"] <= 60e6
    cfg = _cfg(path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (512, 12, 8, 4)
    assert cfg.vocab_size == len(_tok(path)) == 8192
    assert cfg.rope_parameters["rope_type"] == "llama3"
    if model_dirs.cache_dir == mm.default_cache_dir():
        assert mm.demo_model_path() == path
