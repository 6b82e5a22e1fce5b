"""IncrementalDetokenizer against a direct decode of the whole output (transformers).

Three small tokenizers are trained here in about a second: a byte-level BPE (GPT-2
style) and a SentencePiece-style BPE with byte fallback, the latter with Llama-2's
decoder (Replace + ByteFallback + Fuse + Strip) and with a Metaspace decoder. CJK
characters and emoji they never saw split into byte pieces across tokens. Stop strings:
test_detokenizer_stops.py (these tokenizers and this driver).
"""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llmd.detokenizer.incremental import IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"

_WORDS = ("the quick brown fox jumps over the lazy dog while Programmers write Python code "
          "for inference Engines and streaming servers in 2024 on the 3rd of May").split()
_CODE = (
    "def foo(x):\n    return x + 1\n",
    "for i in range(10):\n    print(i)\n",
    "class Engine:\n    def __init__(self) -> None:\n        self.queue = []\n",
    "import os\nimport sys\n",
    "if __name__ == '__main__':\n    main()\n",
)
# Seen in training, so that merges like " " + a UTF-8 lead byte exist.
_CJK_WORDS = ("中国 中心 下载 不是 为了 人们 他们 今天 以后 个人 事情 交通 产品 亲自 会议 但是 作者 "
              "使用 信息 价格 任何 休息 传统 伤害 位置 低于 住房 体育 何时 余额 佛教 依然 俄罗斯").split()
_ACCENTED_WORDS = ("café", "naïve", "über", "déjà", "señor")

TEXTS = [
    "Hello world",
    "the quick brown fox jumps over the lazy dog",
    "中文 and 日本語 mixed with English",
    "生成式人工智能模型的推理服务",
    "Family: 👨‍👩‍👧 flags: 🇯🇵🇫🇷 thumbs: 👍🏽 ok",
    "café naïve über Ångström Zürich Ελληνικά русский",
    "def foo(x):\n    return x + 1\n\n\n    # done",
    "tabs\tand   runs   of\n\n\nwhitespace  ",
    "   leading spaces and trailing   ",
    "emoji at the end 🎉",
    "🎉 emoji at the start",
    "한국어 텍스트 😀😃 ✓ ✗ € £ ¥",
    "x = {'k': [1, 2, 3]}  # 中 文",
    "a",
    "",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(2000):
        words = [rng.choice(_WORDS) for _ in range(12)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_ACCENTED_WORDS))
        lines.append(" ".join(words) + ". " + rng.choice(_CODE))
    lines += [" ".join(rng.choice(_CJK_WORDS) for _ in range(8)) for _ in range(300)]
    return lines


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return _wrap(tok)


def _sentencepiece(decoder: decoders.Decoder) -> PreTrainedTokenizerFast:
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"])
    trainer_tok.train_from_iterator(_corpus(), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    # Llama-2 layout: specials, then the 256 byte pieces, then the learned pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for value in range(256):
        vocab[f"<0x{value:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoder
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return _wrap(tok)


# Small enough that CJK words stay split into byte pieces, not merged whole.
_VOCAB_SIZE = 400

TOKENIZER_KINDS = ("byte_level", "sp_llama2", "sp_metaspace")


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[str, PreTrainedTokenizerFast]:
    return {
        "byte_level": _byte_level(),
        "sp_llama2": _sentencepiece(decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)])),
        "sp_metaspace": _sentencepiece(decoders.Sequence([
            decoders.ByteFallback(),
            decoders.Metaspace(replacement="▁", prepend_scheme="first")])),
    }


@pytest.fixture(params=TOKENIZER_KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def tok(tokenizers_by_kind, kind) -> PreTrainedTokenizerFast:
    return tokenizers_by_kind[kind]


# ---------------------------------------------------------------- references and driver


def decode(tok, ids: list[int], skip: bool) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def reference_text(tok, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output's text as a direct decode gives it."""
    if tok.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel":
        return decode(tok, output, skip)
    full, head = decode(tok, prompt + output, skip), decode(tok, prompt, skip)
    assert full.startswith(head), "test prompt must end on a character boundary"
    return full[len(head):]


def truncate_at_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the shortest prefix of text that completes some stop string."""
    for end in range(len(text) + 1):
        done = [s for s in stop if s and text[:end].endswith(s)]
        if done:
            stop_str = max(done, key=len)
            return text[:end] if include else text[:end - len(stop_str)], stop_str
    return text, None


def chunked(ids: list[int], sizes: str | int, seed: int = 0) -> list[list[int]]:
    if sizes == "random":
        rng = random.Random(seed)
        chunks, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 8)
            chunks.append(ids[i:i + n])
            i += n
        return chunks
    return [ids[i:i + sizes] for i in range(0, len(ids), sizes)]


def stream(tok, prompt, output, chunks, *, skip=True, stop=(), include=False):
    """Feed chunks, checking invariants after each; return (deltas, stop hit, detokenizer)."""
    expected, expected_stop = truncate_at_stop(reference_text(tok, prompt, output, skip),
                                               list(stop), include)
    max_hold = max((len(s) for s in stop), default=1) - 1
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=list(stop),
                                 include_stop_str_in_output=include)
    deltas: list[str] = []
    hit = None
    for chunk in chunks:
        result = det.update(chunk)
        if hit is not None:
            assert result is None, "update after a stop must be ignored"
        elif result is not None:
            hit = result
        delta = det.get_delta()
        position = sum(map(len, deltas))
        deltas.append(delta)
        streamed = "".join(deltas)
        assert expected.startswith(streamed), (streamed, expected)
        for offset, char in enumerate(delta):  # implied by the line above; stated for clarity
            assert char != REPLACEMENT_CHAR or expected[position + offset] == REPLACEMENT_CHAR
        assert det.output_text.startswith(streamed)
        if hit is None:
            assert len(det.output_text) - len(streamed) <= max_hold
    deltas.append(det.finish())
    assert "".join(deltas) == expected
    assert det.output_text == expected
    # A stop inside text that only finish() made final is reported by stop_string alone.
    assert det.stop_string == expected_stop and hit in (None, expected_stop)
    return deltas, hit, det


def prompt_ids(tok, text: str = "User: write something.\nAssistant: ok") -> list[int]:
    return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- tokenizers are what we think


def test_unseen_characters_split_into_byte_pieces(tokenizers_by_kind):
    bl = tokenizers_by_kind["byte_level"]
    assert len(encode(bl, "生")) == 3  # one token per byte
    sp = tokenizers_by_kind["sp_llama2"]
    assert sp.convert_ids_to_tokens(encode(sp, "生"))[-3:] == ["<0xE7>", "<0x94>", "<0x9F>"]
    # Byte-level tokens that end a character and start the next one.
    pieces = [bl.decode([i]) for text in TEXTS for i in encode(bl, text)]
    assert any(REPLACEMENT_CHAR in p and p.strip(REPLACEMENT_CHAR) for p in pieces)


# ---------------------------------------------------------------- the streaming invariant


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("sizes", [1, 3, "random", 10_000])
def test_deltas_concatenate_to_direct_decode(tok, skip, sizes):
    prompt = prompt_ids(tok)
    for n, text in enumerate(TEXTS):
        output = encode(tok, text) + [tok.eos_token_id]
        stream(tok, prompt, output, chunked(output, sizes, seed=n), skip=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_inside_output(tok, skip):
    prompt = prompt_ids(tok)
    for text in TEXTS:
        ids = encode(tok, text)
        # Special tokens anywhere, including between the bytes of one character.
        for at in range(0, len(ids) + 1, 2):
            output = ids[:at] + [tok.eos_token_id, tok.bos_token_id] + ids[at:]
            stream(tok, prompt, output, chunked(output, 1), skip=skip)


def test_random_token_sequences(tok):
    """Arbitrary ids (byte pieces in any order, invalid UTF-8, specials), any chunking."""
    prompt = prompt_ids(tok)
    rng = random.Random(1234)
    vocab = len(tok)
    byte_ids = [i for i in range(vocab) if tok.convert_ids_to_tokens(i).startswith("<0x")]
    for trial in range(300):
        pool = byte_ids if byte_ids and rng.random() < 0.5 else range(vocab)
        output = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(vocab)
                  for _ in range(rng.randint(0, 60))]
        sizes = rng.choice([1, 2, "random"])
        stream(tok, prompt, output, chunked(output, sizes, seed=trial), skip=rng.random() < 0.5)


def test_empty_prompt(tok):
    for text in TEXTS:
        output = encode(tok, text)
        stream(tok, [], output, chunked(output, 1))


def test_long_output_crosses_many_window_restarts(tok):
    text = " ".join(TEXTS) * 5
    prompt = prompt_ids(tok)
    output = encode(tok, text)
    assert len(output) > 500
    for sizes in (1, "random"):
        stream(tok, prompt, output, chunked(output, sizes))


def test_first_output_token_keeps_its_leading_space(tokenizers_by_kind):
    for kind in TOKENIZER_KINDS:
        tok = tokenizers_by_kind[kind]
        prompt = prompt_ids(tok, "Say hi")
        output = encode(tok, "Say hi there")[len(encode(tok, "Say hi")):]
        deltas, _, _ = stream(tok, prompt, output, chunked(output, 1))
        assert "".join(deltas) == " there", kind


def test_context_of_skipped_specials_keeps_the_leading_space(tokenizers_by_kind):
    tok = tokenizers_by_kind["sp_llama2"]
    prompt = prompt_ids(tok, "Say hi") + [tok.eos_token_id] * 80
    output = encode(tok, "Say hi there")[len(encode(tok, "Say hi")):]
    deltas, _, _ = stream(tok, prompt, output, chunked(output, 1))
    assert "".join(deltas) == " there"


# ---------------------------------------------------------------- incomplete characters


def test_incomplete_character_is_held_until_complete(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    output = encode(tok, "ab生")  # "ab", then 3 byte tokens
    det = IncrementalDetokenizer(tok, [])
    det.update(output[:-3])
    assert det.get_delta() == "ab"
    for token_id in output[-3:-1]:
        det.update([token_id])
        assert det.get_delta() == ""
    det.update(output[-1:])
    assert det.get_delta() == "生"
    assert det.finish() == ""


def test_generation_ending_mid_character_flushes_the_direct_decode(tok):
    prompt = prompt_ids(tok)
    for text in ("ok 生", "🎉", "中文 👨‍👩‍👧"):
        ids = encode(tok, text)
        for cut in range(1, 4):
            output = ids[:-cut]
            deltas, _, _ = stream(tok, prompt, output, chunked(output, 1))
            assert "".join(deltas) == reference_text(tok, prompt, output, True)


def test_byte_run_turned_invalid_by_a_later_byte(tokenizers_by_kind):
    """ByteFallback decodes a byte run all or nothing: a stray byte after a complete
    character turns the character into U+FFFD too, so complete characters inside a run
    are only final once a non-byte token ends the run."""
    for kind in ("sp_llama2", "sp_metaspace"):
        tok = tokenizers_by_kind[kind]
        head = encode(tok, "x")
        sheng = encode(tok, "x生")[len(head):]
        assert tok.convert_ids_to_tokens(sheng) == ["<0xE7>", "<0x94>", "<0x9F>"]
        stray = tok.convert_tokens_to_ids("<0xE4>")
        word = encode(tok, "x ok")[len(head):]
        prompt = prompt_ids(tok)
        for tail in ([stray, *word], [stray], word):
            output = head + sheng + tail
            for sizes in (1, 10_000):
                stream(tok, prompt, output, chunked(output, sizes))
        invalid = reference_text(tok, prompt, head + sheng + [stray], True)
        assert invalid == " x" + REPLACEMENT_CHAR * 4


def test_prompt_ending_mid_character(tok, kind):
    """The output continues a character the prompt began: the prompt's bytes stay the
    prompt's and the output's bytes decode on their own."""
    ids = encode(tok, "hello 中文 生成 ok")
    for split in range(1, len(ids)):
        prompt, output = ids[:split], ids[split:]
        head, full = decode(tok, prompt, True), decode(tok, prompt + output, True)
        if kind == "byte_level" or full.startswith(head):
            stream(tok, prompt, output, chunked(output, 1))
        else:  # a split byte run: decode(prompt) is not a prefix of the whole decode
            det = IncrementalDetokenizer(tok, prompt)
            deltas = []
            for token_id in output:
                det.update([token_id])
                deltas.append(det.get_delta())
            assert "".join(deltas) + det.finish() == decode(tok, output, True)


def test_stray_byte_after_a_prompt_ending_in_a_byte_run(tokenizers_by_kind):
    """The prompt's run would turn invalid as a whole; the output's bytes decode alone."""
    for kind in ("sp_llama2", "sp_metaspace"):
        tok = tokenizers_by_kind[kind]
        prompt = encode(tok, "hi 生")
        assert tok.convert_ids_to_tokens(prompt[-1]).startswith("<0x")
        output = [tok.convert_tokens_to_ids("<0x80>")] + encode(tok, "x ok")[len(encode(tok, "x")):]
        det = IncrementalDetokenizer(tok, prompt)
        det.update(output)
        assert det.get_delta() + det.finish() == REPLACEMENT_CHAR + " ok"


def test_skipped_specials_inside_characters_at_every_offset(tok):
    """Runs of skipped special tokens between the bytes of one character (or before a
    word) at every position of a long output, so that some fall where the decode window
    restarts: its context must neither split the character nor decode to nothing."""
    prompt = prompt_ids(tok)
    ids = encode(tok, "word " * 12 + "生成 ok 👍🏽 end")
    for at in range(len(ids)):
        for run in (1, 4, 9, 13):
            output = ids[:at] + [tok.eos_token_id] * run + ids[at:]
            stream(tok, prompt, output, chunked(output, 1), skip=True)
            stream(tok, prompt, ids[at:] + output, chunked(ids[at:] + output, 1), skip=True)


# ---------------------------------------------------------------- cost stays bounded


def test_degenerate_invalid_byte_stream_keeps_the_window_short(tokenizers_by_kind):
    """A model looping on a UTF-8 lead byte never completes a character, so no decode
    ends on a known character boundary; the decode window must still restart, or each
    step would decode the whole output."""
    tok = tokenizers_by_kind["byte_level"]
    lead = encode(tok, "生")[0]
    space_lead = tok.convert_tokens_to_ids("Ġä")  # " " + the lead byte of 中
    assert decode(tok, [space_lead], True) == " " + REPLACEMENT_CHAR
    for output in ([lead] * 300, [space_lead] * 300, [lead, space_lead] * 150):
        _, _, det = stream(tok, [], output, chunked(output, 1))
        assert len(det._window) < 40  # white-box: the window restarted


# ---------------------------------------------------------------- API edges


def test_accepts_a_raw_tokenizers_tokenizer(tokenizers_by_kind):
    for kind in TOKENIZER_KINDS:
        tok = tokenizers_by_kind[kind]
        output = encode(tok, TEXTS[4])
        det = IncrementalDetokenizer(tok.backend_tokenizer, prompt_ids(tok))
        deltas = []
        for token_id in output:
            det.update([token_id])
            deltas.append(det.get_delta())
        assert "".join(deltas) + det.finish() == reference_text(tok, prompt_ids(tok), output, True)


def test_rejects_a_tokenizer_without_a_tokenizers_backend():
    with pytest.raises(TypeError, match="tokenizers-backed"):
        IncrementalDetokenizer(object(), [])


def test_single_stop_string_and_empty_updates(tok):
    det = IncrementalDetokenizer(tok, prompt_ids(tok), stop="fox")
    assert det.update([]) is None and det.get_delta() == ""
    assert det.update(encode(tok, "the quick brown fox")) == "fox"
    assert (det.get_delta() + det.finish()).strip() == "the quick brown"
