"""The test fixtures' tokenizer: a byte-level BPE trained (deterministically, in well
under a second) with the ``tokenizers`` library on Python's stdlib sources plus a short
multilingual snippet, saved through transformers with a ChatML chat template
(tools/make_model.py's module doc lists what the engine may rely on)."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

from llmd_tools.fixture_cache import RECIPE_VERSION, _build_atomically, _hash, _versions, default_cache_dir

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training corpus: stdlib *.py (sorted) up to this many characters, plus the snippet.
CORPUS_CHAR_CAP = 3_000_000
SNIPPET_REPEATS = 300

# Repeated SNIPPET_REPEATS times (~10% of the corpus) so that even the 1024-token vocab
# gets some merges for these scripts (with 20 repeats it got none for CJK); any other
# text is still covered byte by byte (byte-level BPE with the full 256-byte alphabet).
MULTILINGUAL_SNIPPET = """\
Héllo wörld! Ça va? Façade, naïve, crème brûlée, jalapeño, Ångström, Øresund, Łódź.
¿Dónde está la biblioteca? Größe, Straße, schön, über. Été, hiver, àèìòù, âêîôû.
你好，世界！今天天气很好。我们一起学习机器学习和自然语言处理。中文文本测试。
こんにちは、世界。日本語のテキストです。ありがとうございます。東京は晴れです。
안녕하세요, 세계! 한국어 텍스트입니다. 감사합니다.
Привет, мир! Это тест на русском языке. Спасибо.
Γειά σου Κόσμε! مرحبا بالعالم! שלום עולם! नमस्ते दुनिया!
Emoji: 😀 😂 🚀 🎉 👍 ❤️ 🔥 ✨ 🤖 🐍 🌍 👩‍💻 🇯🇵 ⭐ ✅ ❌ →  ← ∑ ∞ ≈ ≠ ≤ ≥ µ °C €100 £5 ¥300
"""


_CORPUS: list[str] | None = None


def _corpus() -> list[str]:
    global _CORPUS
    if _CORPUS is None:
        texts: list[str] = []
        total = 0
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            t = f.read_text(encoding="utf-8", errors="replace")
            if total + len(t) > CORPUS_CHAR_CAP:
                break
            texts.append(t)
            total += len(t)
        texts.extend([MULTILINGUAL_SNIPPET] * SNIPPET_REPEATS)
        _CORPUS = texts
    return _CORPUS


_CORPUS_HASH: str | None = None


def _corpus_hash() -> str:
    global _CORPUS_HASH
    if _CORPUS_HASH is None:
        _CORPUS_HASH = _hash([hashlib.sha256(t.encode()).hexdigest() for t in _corpus()])
    return _CORPUS_HASH


# Tokenizer flavours. "bytelevel": GPT-2/Llama-3 style (ByteLevel pre-tokenizer with its
# own regex, no normalizer). "qwen2": exactly the pipeline transformers' Qwen2Tokenizer
# builds (NFC normalizer, Qwen2 split regex, ByteLevel without regex). transformers 5's
# AutoTokenizer loads any model_type "qwen2" directory as Qwen2Tokenizer, which *replaces*
# the normalizer and pre-tokenizer from tokenizer.json with its own (and adds an
# "<|endoftext|>" unk token unless tokenizer_config.json sets "unk_token": null). So the
# qwen2 fixtures use that pipeline: tokenizer.json and AutoTokenizer then agree.
TOKENIZER_FLAVOURS = ("bytelevel", "qwen2")
ARCH_TOKENIZER_FLAVOUR = {
    "llama": "bytelevel", "mistral": "bytelevel", "qwen2": "qwen2", "qwen3": "bytelevel",
    "gemma2": "bytelevel", "gemma3": "bytelevel", "phi3": "bytelevel", "qwen3_moe": "bytelevel",
    "qwen2_moe": "bytelevel", "mixtral": "bytelevel", "smollm3": "bytelevel",
    "granite": "bytelevel"}
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2_regex() -> str:
    try:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        return PRETOKENIZE_REGEX
    except ImportError:  # pragma: no cover
        return _QWEN2_PRETOKENIZE_REGEX


_TOKENIZER_JSON: dict[tuple[int, str], str] = {}


def _train_tokenizer_json(vocab_size: int, flavour: str) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if flavour == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_qwen2_regex()), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif flavour == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(f"unknown tokenizer flavour {flavour!r}; expected one of {TOKENIZER_FLAVOURS}")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok.to_str()


def _tokenizer_json(vocab_size: int, flavour: str = "bytelevel", cache_dir: Path | None = None) -> str:
    """Trained tokenizer.json text; cached per (vocab_size, flavour) in memory and on disk."""
    if (vocab_size, flavour) in _TOKENIZER_JSON:
        return _TOKENIZER_JSON[(vocab_size, flavour)]
    key = _hash(
        {"v": RECIPE_VERSION, "vocab": vocab_size, "flavour": flavour, "corpus": _corpus_hash(), **_versions()}
    )[:12]
    final = (cache_dir or default_cache_dir()) / "_tokenizers" / f"bpe{vocab_size}-{flavour}-{key}"

    def build(tmp: Path) -> None:
        (tmp / "tokenizer.json").write_text(_train_tokenizer_json(vocab_size, flavour), encoding="utf-8")

    text = (_build_atomically(final, build) / "tokenizer.json").read_text(encoding="utf-8")
    _TOKENIZER_JSON[(vocab_size, flavour)] = text
    return text


def build_tokenizer(
    out_dir: Path,
    vocab_size: int,
    *,
    flavour: str = "bytelevel",
    model_max_length: int | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Write a byte-level BPE tokenizer of ``vocab_size`` tokens (HF format) to ``out_dir``.

    Special tokens ``<|bos|>`` ``<|eos|>`` ``<|pad|>`` ``<|im_start|>`` ``<|im_end|>`` get
    ids 0..4; encoding prepends BOS; the chat template is ChatML, starting with BOS.
    ``flavour``: see TOKENIZER_FLAVOURS. The trained tokenizer is cached per
    (vocab_size, flavour), in memory and under ``cache_dir``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_obj = Tokenizer.from_str(_tokenizer_json(vocab_size, flavour, cache_dir))
    kwargs: dict[str, Any] = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok_obj,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        **kwargs,
    )
    hf_tok.save_pretrained(str(out_dir))
    # An explicit null unk token: model-specific tokenizer classes (Qwen2Tokenizer, picked
    # by AutoTokenizer for model_type qwen2) otherwise add a default unk token.
    cfg_path = out_dir / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tcfg["unk_token"] = None
    cfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


def special_token_ids() -> dict[str, int]:
    return {t: i for i, t in enumerate(SPECIAL_TOKENS)}
