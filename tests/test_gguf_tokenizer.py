"""The tokenizer llmd builds from its own reading of a GGUF (gguf_tokenizer) is the one
transformers builds reading the file itself (`PreTrainedTokenizerFast.from_pretrained(
dir, gguf_file=name)`): the same backend tokenizer (its whole JSON: model, merges,
normalizer, pre-tokenizer, post-processor, added tokens), the same ids for texts with
unicode, whitespace runs, special tokens and code, the same special tokens, BOS/EOS
settings and chat template — for the built-in SmolLM2 (byte-level BPE), Gemma 3
(sentencepiece vocabulary, merges derived from it), the fixture GGUFs (byte-level BPE
with control tokens) and a hand-made sentencepiece ("llama") vocabulary without merges
or an add_bos key. A file whose vocabulary cannot make a tokenizer is a clear error."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as T
from gguf_fixtures import written
from llmd.gpu.models.gguf_file import GGUFFile
from llmd.gpu.models.gguf_loader import load_gguf_tokenizer
from llmd.gpu.models import gguf_tokenizer
from llmd.gpu.models.gguf_tokenizer import converter_available, derived_merges
from test_gguf import ggufs, hf_dirs  # noqa: F401

TEXTS = [
    "Hello world",
    "  two  spaces\t\ttabs\n\n\nnewlines   ",
    " leading space",
    "héllo wörld — ünïcödé, 日本語のテキスト, emoji 🤖🚀, Ελληνικά, عربى",
    'def fib(n: int) -> int:\n    """Docstring."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n',
    "{\"key\": [1, 2.5e-3, null], 'x': `y`}",
    "",
]


def transformers_tokenizer(path: Path | str):
    from transformers import PreTrainedTokenizerFast

    p = Path(path).resolve()
    return PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


def assert_same_tokenizer(path: Path | str):
    """llmd's tokenizer of `path` (after checking it against transformers')."""
    ours, ref = load_gguf_tokenizer(path), transformers_tokenizer(path)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    specials = ref.all_special_tokens
    assert specials and ours.all_special_tokens == specials
    texts = TEXTS + [f"{specials[0]}a {specials[-1]}\n{''.join(specials)} b"]
    for text in texts:
        for add_special_tokens in (True, False):
            ids = ref(text, add_special_tokens=add_special_tokens).input_ids
            assert ours(text, add_special_tokens=add_special_tokens).input_ids == ids, text
        assert ours.decode(ids) == ref.decode(ids)
    for name in ("special_tokens_map", "all_special_ids", "chat_template", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "add_bos_token", "add_eos_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in ref.added_tokens_decoder.items()}
    if ref.chat_template:
        chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "日本語?"}]
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return ours


def test_the_installed_transformers_offers_the_conversion():
    """Else load_gguf_tokenizer falls back to transformers reading the file itself."""
    assert converter_available()


def test_builtin_model_tokenizer_is_transformers(builtin_gguf):
    assert_same_tokenizer(builtin_gguf)


def test_gemma3_tokenizer_is_transformers(gemma3_270m):
    tokenizer = assert_same_tokenizer(gemma3_270m)
    assert tokenizer("<start_of_turn>user\nhi<end_of_turn>").input_ids == [2, 105, 2364, 107, 2202, 106]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fixture_tokenizers_are_transformers(ggufs, name):  # noqa: F811
    assert_same_tokenizer(ggufs(name, T.Q8_0))


def _sentencepiece_gguf(path: Path, **token_ids: int) -> Path:
    """A llama GGUF with a small sentencepiece vocabulary as llama.cpp stores one: byte
    fallback tokens, scored pieces, no merges, no add_bos_token key."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    words = ["▁", "e", "t", "a", "o", "h", "l", "w", "r", "d", "▁t", "he", "▁the", "ll", "▁he", "llo", "▁hello",
             "or", "▁w", "▁wor", "ld", "▁world", "▁a", "at", "▁at"]
    pieces += words
    types += [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(token_ids.get("bos", 1))
    w.add_eos_token_id(token_ids.get("eos", 2))
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), dtype=np.float32))
    return written(w, path)


def test_sentencepiece_vocabulary_without_merges_is_transformers(tmp_path):
    path = _sentencepiece_gguf(tmp_path / "sp.gguf")
    tokenizer = assert_same_tokenizer(path)
    assert tokenizer.add_bos_token  # llama.cpp's default for a sentencepiece vocabulary
    assert tokenizer("hello world").input_ids[0] == 1


def test_vocabulary_that_makes_no_tokenizer_is_a_clear_error(tmp_path):
    bad_id = _sentencepiece_gguf(tmp_path / "bad-eos.gguf", eos=5000)
    with pytest.raises(ValueError, match=r"bad-eos.gguf': GGUF metadata tokenizer.ggml.eos_token_id=5000 is not a "
                                         r"token of the 284-token vocabulary"):
        load_gguf_tokenizer(bad_id)
    no_vocab = tmp_path / "no-vocab.gguf"
    w = gguf.GGUFWriter(str(no_vocab), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"no-vocab.gguf': GGUF metadata tokenizer.ggml.tokens is missing"):
        load_gguf_tokenizer(no_vocab)
    assert GGUFFile(no_vocab).architecture == "llama"


def test_merges_derived_from_a_vocabulary_are_transformers():
    """derived_merges is transformers' generate_merges, order included: on a vocabulary of
    short strings over four letters (so most tokens split several ways) whose ids are
    shuffled (a token's splits go by the pieces' ids), with scores that tie (ties keep
    their order), with int scores (Gemma's file positions) and with none (by id)."""
    from transformers.tokenization_utils_base import generate_merges

    rng = random.Random(0)
    letters = "ab▁c"
    tokens = list(dict.fromkeys(list(letters) + ["".join(rng.choice(letters) for _ in range(rng.randint(2, 6)))
                                                 for _ in range(700)]))
    ids = list(range(len(tokens)))
    rng.shuffle(ids)
    vocab = dict(zip(tokens, ids))
    tied = {t: rng.choice([0.0, -1.0, -2.5]) for t in tokens}
    positions = {t: -i for t, i in vocab.items()}
    for scores in (tied, positions, None):
        want = generate_merges(vocab, scores)
        assert len(want) > 1000
        assert derived_merges(vocab, scores) == want
    assert derived_merges({"a": 0, "b": 1}, None) == []


def test_a_vocabulary_without_merges_takes_the_lean_derivation(tmp_path, monkeypatch):
    """Building a sentencepiece tokenizer without merges derives them through
    derived_merges (the tokenizer equals transformers' own: the test above and
    test_gemma3_tokenizer_is_transformers), and leaves transformers' conversion as it was."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    calls = []
    monkeypatch.setattr(gguf_tokenizer, "derived_merges", lambda *a: calls.append(a) or derived_merges(*a))
    before = mapping.get_merges
    assert_same_tokenizer(_sentencepiece_gguf(tmp_path / "sp.gguf"))
    assert len(calls) == 1 and mapping.get_merges is before
