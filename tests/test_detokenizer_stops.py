"""IncrementalDetokenizer's stop strings against a direct decode of the whole output
(transformers): a stop string across tokens, from inside a token or inside multibyte
characters, the first and the earliest of several, none matched in the prompt, text held
back while a match may still come and released or flushed after, random stop strings over
random outputs. The tokenizers, the reference and the driver: test_detokenizer.py.
"""
from __future__ import annotations

import random

from llmd.detokenizer.incremental import IncrementalDetokenizer
from test_detokenizer import (TEXTS, chunked, encode, kind, prompt_ids, reference_text,  # noqa: F401
                              stream, tok, tokenizers_by_kind)


def test_stop_string_spanning_tokens(tok):
    prompt = prompt_ids(tok)
    output = encode(tok, "the quick brown fox jumps over the lazy dog")
    deltas, hit, det = stream(tok, prompt, output, chunked(output, 1), stop=["brown fox"])
    assert hit == "brown fox"
    assert det.output_text.strip() == "the quick"


def test_stop_string_starting_mid_token(tok):
    prompt = prompt_ids(tok)
    output = encode(tok, "the quick brown fox")
    assert "quick" in [tok.decode([i]).strip() for i in output]  # "quick" is one token
    for sizes in (1, "random"):
        _, hit, det = stream(tok, prompt, output, chunked(output, sizes), stop=["ick bro"])
        assert hit == "ick bro" and det.output_text.strip() == "the qu"


def test_stop_string_inside_multibyte_characters(tok):
    prompt = prompt_ids(tok)
    output = encode(tok, "中文 and 生成式人工智能 👨‍👩‍👧 end")
    for stop in (["人工"], ["👩"], ["\u200d👧 e"]):
        for include in (False, True):
            stream(tok, prompt, output, chunked(output, 1), stop=stop, include=include)


def test_first_occurrence_wins(tok):
    prompt = prompt_ids(tok)
    output = encode(tok, "one fox two fox three")
    _, hit, det = stream(tok, prompt, output, chunked(output, 1), stop=["fox"])
    assert hit == "fox" and det.output_text.strip() == "one"
    _, _, det = stream(tok, prompt, output, chunked(output, 1), stop=["fox"], include=True)
    assert det.output_text.strip() == "one fox"


def test_earliest_of_several_stop_strings_wins(tok):
    prompt = prompt_ids(tok)
    output = encode(tok, "alpha beta gamma delta")
    for stop in (["delta", "beta", "gamma"], ["gamma", "beta"]):
        for sizes in (1, 10_000):
            _, hit, det = stream(tok, prompt, output, chunked(output, sizes), stop=stop)
            assert hit == "beta" and det.output_text.strip() == "alpha"
    # Overlapping: the one that completes first, whatever the chunking.
    for sizes in (1, 2, 10_000):
        _, hit, _ = stream(tok, prompt, output, chunked(output, sizes), stop=["alpha beta g", "ta"])
        assert hit == "ta"


def test_stop_string_in_prompt_or_across_the_boundary_is_not_matched(tok):
    prompt = prompt_ids(tok, "STOP here and the")
    output = encode(tok, "STOP here and the quick fox")[len(encode(tok, "STOP here and the")):]
    _, hit, det = stream(tok, prompt, output, chunked(output, 1), stop=["STOP", "the quick"])
    assert hit is None and det.output_text == " quick fox"


def test_hold_back_is_released_when_the_match_fails(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    ids = tok.convert_tokens_to_ids(list("xabd"))  # one token per character
    det = IncrementalDetokenizer(tok, [], stop=["abc", "zz"])
    steps = []
    for token_id in ids:
        assert det.update([token_id]) is None
        steps.append(det.get_delta())
    assert steps == ["x", "", "", "abd"]
    assert det.finish() == ""


def test_held_back_text_is_flushed_by_finish(tokenizers_by_kind):
    tok = tokenizers_by_kind["byte_level"]
    det = IncrementalDetokenizer(tok, [], stop=["abc"])
    det.update(tok.convert_tokens_to_ids(list("xab")))
    assert det.get_delta() == "x"
    assert det.output_text == "xab"
    assert det.finish() == "ab"


def test_updates_after_a_stop_are_ignored(tok):
    det = IncrementalDetokenizer(tok, prompt_ids(tok), stop=["fox"])
    assert det.update(encode(tok, "the quick brown fox jumps")) == "fox"
    text = det.output_text
    assert det.update(encode(tok, " fox fox")) is None
    assert det.output_text == text
    assert det.get_delta() + det.finish() == text
    assert det.get_delta() == "" and det.finish() == ""


def test_random_stop_strings(tok):
    """Property test: stops cut from the text itself (so they start mid-token, span
    tokens and multi-byte characters) mixed with absent ones, random chunking."""
    prompt = prompt_ids(tok)
    rng = random.Random(99)
    for trial in range(400):
        text = rng.choice(TEXTS[:-2]) + " " + rng.choice(TEXTS[:-2])
        output = encode(tok, text) + ([tok.eos_token_id] if rng.random() < 0.3 else [])
        reference = reference_text(tok, prompt, output, True)
        stop = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8 and reference:
                start = rng.randrange(len(reference))
                stop.append(reference[start:start + rng.randint(1, 8)])
            else:
                stop.append(rng.choice(["zzz", "never", "🙃", "\n\n\n\n"]))
        sizes = rng.choice([1, "random", 10_000])
        stream(tok, prompt, output, chunked(output, sizes, seed=trial), stop=stop,
               include=rng.random() < 0.5, skip=rng.random() < 0.8)
