"""Fill-in-the-middle prompts from the model's own FIM tokens (prefix-suffix-middle
order), for OpenAI's `suffix` and llama.cpp's `/infill`."""
from __future__ import annotations

from dataclasses import dataclass

# (prefix, suffix, middle) marker tokens as the model families that train on FIM spell
# them: Qwen2.5-Coder and its kin; StarCoder, SmolLM and their kin; DeepSeek-Coder.
KNOWN_FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)
# Separators for extra context files (llama.cpp's input_extra), where the vocabulary has them.
FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>")


@dataclass(frozen=True)
class FimTokens:
    prefix: str
    suffix: str
    middle: str
    file_separator: str | None = None

    def prompt(self, prefix: str, suffix: str, extra: list[tuple[str, str]] = ()) -> str:
        """The prompt text; its marker tokens are special tokens, so the tokenizer keeps
        them whole. `extra` is (file name, text) context placed before the prefix."""
        context = ""
        for filename, text in extra:
            if self.file_separator is not None:
                context += f"{self.file_separator}{filename}\n"
            context += text if text.endswith("\n") else text + "\n"  # the next piece starts on its own line
        return f"{self.prefix}{context}{prefix}{self.suffix}{suffix}{self.middle}"


def find_fim_tokens(tokenizer) -> FimTokens | None:
    """The model's FIM markers when its vocabulary has a whole known set, else None."""
    vocab = tokenizer.get_vocab()
    for prefix, suffix, middle in KNOWN_FIM_TOKENS:
        if prefix in vocab and suffix in vocab and middle in vocab:
            separator = next((s for s in FILE_SEPARATORS if s in vocab), None)
            return FimTokens(prefix, suffix, middle, separator)
    return None
