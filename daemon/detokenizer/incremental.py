"""Incremental detokenization: output token ids in, streamable text deltas out. No torch.

The text of a request's output is defined as its decode in the context of the prompt's
last few tokens,

    text = decode(context + output)[len(decode(context)):]

which for byte-level BPE (GPT-2, Llama-3, Qwen) is just ``decode(output)`` and for
SentencePiece-style decoders (Metaspace, or Replace + Strip) keeps the leading space of
the first output token, as ``decode(prompt + output)`` does. When the prompt ends inside
a character (an incomplete UTF-8 sequence, or an open run of byte-fallback tokens) the
context stops before that character, so the output's bytes decode on their own. Text is
the tokenizers backend's decode; transformers' ``clean_up_tokenization_spaces`` is not
applied (it rewrites text across token boundaries and cannot be streamed).

The concatenation of all deltas, ``finish()`` included, equals that text, truncated
before the first stop string (or after it with ``include_stop_str_in_output``).
"First" is the stop string that is complete earliest in the text; on a tie, the one that
starts earlier. That is what token-by-token streaming sees, so the result does not
depend on how tokens are grouped into updates.

Each update decodes a short window of token ids in one call to the Rust decoder:
the window starts a few tokens before the unread ones, and a window that grew past
``_MAX_WINDOW_TOKENS`` restarts near its end. Text counts as final when no later token
can change it:

* byte-level decoders decode all bytes with lossy UTF-8, so only a trailing U+FFFD (an
  incomplete character) may still change; everything before it is final;
* the ByteFallback decoder turns a run of ``<0xXX>`` tokens into text only if the whole
  run is valid UTF-8 and into one U+FFFD per byte otherwise, so a later invalid byte can
  turn characters already complete into U+FFFD. A run is therefore final only when a
  token that is not a byte token (and not a skipped special token) ends it.

``tokenizers.decoders.DecodeStream`` does the same windowed decode in Rust, but raises
"Invalid prefix" in the ByteFallback case above and cannot flush a held-back tail at the
end of generation, so it is not used.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the output. Decoders that drop the first leading space
# (Strip, Metaspace) then drop the context's space, not the first output token's.
_CONTEXT_TOKENS = 6
_MAX_CONTEXT_TOKENS = 64
# A decode window past this many tokens restarts at a recent character boundary, so the
# cost of a step does not grow with the output. Decoding costs ~0.5 us + 0.1 us/token
# (byte-level) or ~1 us + 0.4 us/token (Replace + ByteFallback + Fuse + Strip).
_MAX_WINDOW_TOKENS = 8
# Without a known boundary (a long stream of invalid bytes), the restart keeps this many.
_RESTART_KEEP_TOKENS = 4
# An incomplete UTF-8 character has at most 3 bytes, so it spans at most 3 tokens.
_MAX_INCOMPLETE_CHAR_TOKENS = 3


@dataclass(frozen=True, slots=True)
class _TokenizerTraits:
    backend: Any  # tokenizers.Tokenizer
    # "<0xXX>" tokens, when the decoder turns them into bytes (ByteFallback); else empty.
    byte_token_ids: frozenset[int]
    special_token_ids: frozenset[int]


_traits_cache: weakref.WeakKeyDictionary[Any, _TokenizerTraits] = weakref.WeakKeyDictionary()


def _tokenizer_traits(tokenizer: Any) -> _TokenizerTraits:
    try:
        return _traits_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    # A transformers tokenizer wraps a tokenizers.Tokenizer; one may also be passed as is.
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    needed = ("decode", "token_to_id", "get_added_tokens_decoder")
    if not all(hasattr(backend, name) for name in needed):
        raise TypeError(f"IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer, "
                        f"got {type(tokenizer).__name__}")
    byte_ids: set[int] = set()
    probe: tuple[int, str] | None = None
    for value in range(256):
        for name in (f"<0x{value:02X}>", f"<0x{value:02x}>"):
            token_id = backend.token_to_id(name)
            if token_id is not None:
                byte_ids.add(token_id)
                probe = probe or (token_id, name)
    # The pieces exist in a vocabulary; they are bytes only if the decoder says so.
    if probe is None or backend.decode([probe[0]], skip_special_tokens=False) == probe[1]:
        byte_ids.clear()
    special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    traits = _TokenizerTraits(backend, frozenset(byte_ids), special_ids)
    try:
        _traits_cache[tokenizer] = traits
    except TypeError:  # not weak-referenceable (a bare tokenizers.Tokenizer): ~0.4 ms a request
        pass
    return traits


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas and watches for stop strings.

    ``update`` consumes tokens and returns the stop string it hit, if any; after a hit the
    text is truncated and later updates are ignored. ``get_delta`` returns the text that
    is safe to stream: a possible start of a stop string (at most
    ``max(len(s) for s in stop) - 1`` characters) and an incomplete character are held
    back. ``finish`` returns whatever is still held at the end of generation.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        traits = _tokenizer_traits(tokenizer)
        self._backend = traits.backend
        self._skip_special_tokens = skip_special_tokens
        self._byte_token_ids = traits.byte_token_ids
        # Skipped special tokens are dropped before the decoder, so they end no byte run.
        self._skipped_token_ids = traits.special_token_ids if skip_special_tokens else frozenset()

        if isinstance(stop, str):
            stop = [stop]
        self._stop_strings = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop_str_in_output = include_stop_str_in_output
        # Proper prefixes of each stop string, longest first, for the hold-back.
        self._stop_prefixes = tuple(tuple(s[:k] for k in range(len(s) - 1, 0, -1))
                                    for s in self._stop_strings)
        self._stop_prefix_last_chars = frozenset(c for s in self._stop_strings for c in s[:-1])

        # Decode window: token ids from the window start (prompt context first).
        self._window, self._window_text = self._initial_context(prompt_token_ids)
        # Tokens of the window covered by _window_text, the window's last decode.
        self._num_decoded_tokens = len(self._window)
        # End of the last decode that was final up to its last character: a character
        # boundary, and outside any byte run.
        self._last_final_end = len(self._window)
        # Characters of _window_text already handed on as output (or context).
        self._num_consumed_chars = len(self._window_text)
        self._open_byte_run_start: int | None = None

        self._emitted: list[str] = []  # deltas returned so far
        self._unemitted = ""  # final output text not yet returned by get_delta
        self._num_held_chars = 0  # tail of _unemitted that may begin a stop string
        self._stop_string: str | None = None
        self._done = False

    @property
    def output_text(self) -> str:
        """All output text so far: the deltas returned plus text held back for stop
        matching, without tokens whose text is not final yet (an incomplete character or
        open byte run). After ``finish`` (or a stop) it is the whole, final text."""
        return "".join(self._emitted) + self._unemitted

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_string

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Consume output tokens; return the stop string they completed, else None."""
        if self._done or not new_token_ids:
            return None
        window = self._window
        first_new = len(window)
        window.extend(new_token_ids)
        if self._byte_token_ids:
            self._track_open_byte_run(first_new)
        end = len(window) if self._open_byte_run_start is None else self._open_byte_run_start
        if end <= self._num_decoded_tokens:
            return None
        text = self._decode(window[:end] if end < len(window) else window)
        self._window_text = text
        self._num_decoded_tokens = end
        is_final = not text.endswith(REPLACEMENT_CHAR)
        final_len = len(text) if is_final else len(text) - 1
        new_text = ""
        if final_len > self._num_consumed_chars:
            new_text = text[self._num_consumed_chars:final_len]
            self._num_consumed_chars = final_len
        if len(window) > _MAX_WINDOW_TOKENS:
            self._restart_window()
        if is_final:
            self._last_final_end = self._num_decoded_tokens
        return self._append(new_text) if new_text else None

    def get_delta(self) -> str:
        """Text produced since the last call that no later token can change."""
        num_ready = len(self._unemitted) - self._num_held_chars
        if num_ready <= 0:
            return ""
        delta = self._unemitted[:num_ready]
        self._unemitted = self._unemitted[num_ready:]
        self._emitted.append(delta)
        return delta

    def finish(self) -> str:
        """End of generation: return all text still held back. Later updates are ignored."""
        if not self._done:
            self._done = True
            text = self._decode(self._window)
            if len(text) > self._num_consumed_chars:
                self._append(text[self._num_consumed_chars:])
        self._num_held_chars = 0
        return self.get_delta()

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _track_open_byte_run(self, first_new: int) -> None:
        run_start = self._open_byte_run_start
        window = self._window
        for i in range(first_new, len(window)):
            token_id = window[i]
            if token_id in self._byte_token_ids:
                if run_start is None:
                    run_start = i
            elif token_id not in self._skipped_token_ids:
                run_start = None
        self._open_byte_run_start = run_start

    def _initial_context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        # Skipped special tokens never reach the decoder (a chat template's trailing
        # "<|assistant|>"), so the context leaves them out.
        prompt: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if token_id not in self._skipped_token_ids:
                prompt.append(token_id)
                if len(prompt) == _MAX_CONTEXT_TOKENS:
                    break
        prompt.reverse()
        end = len(prompt)
        if self._byte_token_ids:
            # An open byte run at the prompt's end would merge with the output's bytes.
            i = end - 1
            while i >= 0 and prompt[i] in self._byte_token_ids:
                end = i
                i -= 1
        # Byte-level: an incomplete character at the prompt's end belongs to the prompt.
        for _ in range(_MAX_INCOMPLETE_CHAR_TOKENS + 1):
            start = max(0, end - _CONTEXT_TOKENS)
            text = self._decode(prompt[start:end])
            if not text.endswith(REPLACEMENT_CHAR):
                break
            end -= 1
        else:
            return [], ""
        # Context that decodes to nothing keeps no space for the output.
        while not text and start > 0:
            start = max(0, start - _CONTEXT_TOKENS)
            text = self._decode(prompt[start:end])
        return prompt[start:end], text

    def _restart_window(self) -> None:
        """Drop the window's head, keeping the decoded tokens since the last final end.

        The restart point must not split a character. The last final end is a character
        boundary; without one (the text has ended in U+FFFD since) the restart keeps a
        few tokens, and checks that their decode does not begin with U+FFFD, or else that
        the two halves' decodes put together give the current decode exactly (as for a
        stream of invalid bytes). The kept tokens must decode to some text, or Strip and
        Metaspace would drop the next token's leading space.
        """
        cut = self._last_final_end
        if not 0 < cut < self._num_decoded_tokens:
            cut = self._num_decoded_tokens - _RESTART_KEEP_TOKENS
            if cut <= 0:
                return
        window = self._window
        text = self._window_text
        kept_text = self._decode(window[cut:self._num_decoded_tokens])
        if not kept_text:
            return
        if kept_text[0] == REPLACEMENT_CHAR and self._decode(window[:cut]) + kept_text != text:
            return
        num_unconsumed = len(text) - self._num_consumed_chars
        del window[:cut]
        self._num_decoded_tokens -= cut
        self._last_final_end = max(0, self._last_final_end - cut)
        if self._open_byte_run_start is not None:
            self._open_byte_run_start -= cut
        self._window_text = kept_text
        self._num_consumed_chars = len(kept_text) - num_unconsumed

    def _append(self, new_text: str) -> str | None:
        text = self._unemitted
        num_searched = len(text)
        text += new_text
        if self._stop_strings:
            hit = self._find_stop(text, num_searched)
            if hit is not None:
                stop_str, start = hit
                end = start + len(stop_str) if self._include_stop_str_in_output else start
                self._unemitted = text[:end]
                self._num_held_chars = 0
                self._stop_string = stop_str
                self._done = True
                return stop_str
            self._num_held_chars = self._stop_prefix_suffix_len(text)
        self._unemitted = text
        return None

    def _find_stop(self, text: str, num_searched: int) -> tuple[str, int] | None:
        """The stop string whose first occurrence ends earliest (then starts earliest).

        Occurrences ending within the first ``num_searched`` characters were looked for
        before; none can begin in text already emitted, since it was held back."""
        best: tuple[int, int, str] | None = None
        for stop_str in self._stop_strings:
            start = text.find(stop_str, max(0, num_searched - len(stop_str) + 1))
            if start >= 0:
                candidate = (start + len(stop_str), start, stop_str)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else (best[2], best[1])

    def _stop_prefix_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._stop_prefix_last_chars:
            return 0
        longest = 0
        for prefixes in self._stop_prefixes:
            for prefix in prefixes:
                if len(prefix) <= longest:
                    break
                if text.endswith(prefix):
                    longest = len(prefix)
                    break
        return longest
