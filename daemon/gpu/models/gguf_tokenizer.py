"""The fast tokenizer a GGUF's vocabulary describes, built from the fields llmd's reader
(gguf_file) already parsed, by transformers' own conversion
(`transformers.integrations.gguf.convert_gguf_tokenizer`): the tokenizer
`PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=name)` gives, without
transformers parsing the file a second time, and without the copy of the converted
tokenizer that `PreTrainedTokenizerFast(tokenizer_object=...)` would make (for Gemma 3's
262k-token vocabulary each of those costs a few hundred MB at the load's peak).

tokenizer_fields mirrors transformers' `get_gguf_tokenizer` (tests/test_gguf_tokenizer.py
checks the result against transformers' own reading of the same files).
"""
from __future__ import annotations

import contextlib
import threading
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from llmd.gpu.models.gguf_file import GGUFFile, GGUFStringArray
from llmd.heap import trim_heap

# tokenizer_config entry -> the GGUF key of the token id it names (as transformers maps them)
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def tokenizer_fields(g: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_dict, tokenizer_config) as transformers' get_gguf_tokenizer reads them:
    the vocabulary, scores, token types and merges as lists, the special tokens by text,
    and the add_bos / add_eos settings with transformers' defaults for each tokenizer type."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    grouped = {group: {name: _plain(g.metadata[f"tokenizer.{key}"]) for key, name in renames.items()
                       if f"tokenizer.{key}" in g.metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    tokens = tokenizer.get("tokens")
    if tokens is None:
        raise g.error("GGUF metadata tokenizer.ggml.tokens is missing: the file has no vocabulary")
    if tokenizer.get("tokenizer_type") == "llama":
        # older files say nothing, and llama.cpp adds BOS to a sentencepiece vocabulary then
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False  # its chat template writes <bos> itself
    for name, key in _SPECIAL_TOKENS.items():
        token_id = g.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise g.error(f"GGUF metadata tokenizer.ggml.{key}={token_id} is not a token of the "
                          f"{len(tokens)}-token vocabulary")
        config[name] = tokens[token_id] if token_id is not None else None
    return tokenizer, config


def converter_available() -> bool:
    """Whether the installed transformers offers the conversion this module calls (it
    moved between releases: without it load_gguf_tokenizer lets transformers read the file)."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer  # noqa: F401
    except ImportError:
        return False
    return True


def build_tokenizer(g: GGUFFile):
    """The fast tokenizer of the file's vocabulary (what load_gguf_tokenizer returns)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokenizer, config = tokenizer_fields(g)
    try:
        with _lean_merges():
            backend, extra = convert_gguf_tokenizer(g.architecture, tokenizer)
    except (ValueError, KeyError, IndexError) as exc:
        raise g.error(f"cannot build a tokenizer from the GGUF's vocabulary ({exc})") from None
    del tokenizer  # the vocabulary's lists: the backend holds its own copy
    fast = PreTrainedTokenizerFast(tokenizer_object=_Handover(backend), name_or_path=str(g.path), **config, **extra)
    trim_heap()  # the conversion's lists, freed, back to the system (Gemma 3: 60 MB of glibc's heap)
    return fast


class _Handover:
    """Hands `backend` to PreTrainedTokenizerFast as it is: its __init__ deep-copies a
    `tokenizer_object` (a round trip through the tokenizer's JSON), which for a converted
    tokenizer nobody else holds is only a second copy at the peak."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __deepcopy__(self, memo: dict) -> Any:
        return self.backend


def _plain(value: Any) -> Any:
    """A metadata value as transformers' reader gives it: arrays as lists."""
    if isinstance(value, GGUFStringArray | np.ndarray):
        return value.tolist()
    return value


# --- merges derived from a vocabulary ------------------------------------------------------

_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _lean_merges() -> Iterator[None]:
    """transformers' conversion with its `get_merges` taking derived_merges' way where a
    file has no merges (Gemma's: 515k of them from its 262k-token vocabulary); the same
    list either way. Put back after (a lock: two loads in threads do not interleave the
    swap); nothing changes where the installed transformers has no such function."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    original = getattr(mapping, "get_merges", None)
    if original is None:
        yield
        return

    def get_merges(tokenizer_dict: dict[str, Any], vocab_scores: Mapping[str, float] | None = None):
        if "merges" in tokenizer_dict:
            return original(tokenizer_dict, vocab_scores)
        tokens = tokenizer_dict["tokens"]
        if vocab_scores is None:
            vocab_scores = dict(zip(tokens, tokenizer_dict["scores"]))
        return derived_merges({token: index for index, token in enumerate(tokens)}, vocab_scores)

    with _PATCH_LOCK:
        mapping.get_merges = get_merges
        try:
            yield
        finally:
            mapping.get_merges = original


def derived_merges(vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """The merges transformers' `generate_merges(vocab, vocab_scores)` derives from a
    vocabulary (tokenization_utils_base), the same list in the same order, at a fraction
    of its peak: every split of a token into two tokens of the vocabulary, a token's
    splits ordered by the pieces' ids, all of them ordered by the token's score
    (descending; with no scores, by the token's id, ascending), then by the pieces'
    lengths, ties kept in that order. transformers holds each merge as a tuple of two new
    strings and a score through two sorts (~315 bytes a merge: 160 MB at Gemma 3's load);
    here the merges are ids and sort keys in arrays until the last list, whose tuples
    hold the vocabulary's own strings."""
    reverse = vocab_scores is not None
    scores = vocab_scores if reverse else vocab
    left, right, left_len, right_len, score = array("q"), array("q"), array("q"), array("q"), array("d")
    for token, token_score in scores.items():
        splits = []
        for i in range(1, len(token)):
            a = vocab.get(token[:i])
            if a is not None and (b := vocab.get(token[i:])) is not None:
                splits.append((a, b, i))
        splits.sort()  # by the pieces' ids (two splits never share the left piece)
        for a, b, i in splits:
            left.append(a)
            right.append(b)
            left_len.append(i)
            right_len.append(len(token) - i)
            score.append(token_score)
    keys = [np.frombuffer(k, dtype=k.typecode) for k in (right_len, left_len, score)]  # int64, float64
    if reverse:  # descending, ties in order: a stable sort of the negated keys
        keys = [-k for k in keys]
    order = np.lexsort(keys) if len(score) else np.zeros(0, dtype=np.int64)
    by_id = [""] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        by_id[index] = token
    return [(by_id[left[k]], by_id[right[k]]) for k in order.tolist()]


# Token texts llama.cpp ends generation on wherever a vocabulary has them (llama-vocab.cpp:
# its end-of-generation set, found by text because converters do not always write the ids,
# and the end-of-turn texts it takes for the eot id), beside the eos / eot / eom ids the
# metadata names: the end of a turn of the chat formats (Llama 3, ChatML, Phi-3, Gemma,
# granite, DeepSeek, Kimi, gpt-oss, ...), of a message and of a text.
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                       "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>", "[EOT]"})
# ids the metadata names that llama.cpp also ends on (FIM's padding, repository and file
# separators among them: a completion ends where the next file would begin)
_EOG_KEYS = ("eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")


def end_of_generation_ids(g: GGUFFile) -> set[int]:
    """The ids llama.cpp stops generating on besides EOS: the metadata's (_EOG_KEYS) and
    every token whose text is one of EOG_TEXTS. The vocabulary is walked once (Gemma's
    262k texts: ~0.1 s)."""
    ids = {int(g.metadata[f"tokenizer.ggml.{key}"]) for key in _EOG_KEYS if f"tokenizer.ggml.{key}" in g.metadata}
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        ids.update(i for i, text in enumerate(tokens) if text in EOG_TEXTS)
    return ids
