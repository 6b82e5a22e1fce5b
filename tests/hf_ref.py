"""Hugging Face transformers as the independent reference: a plain greedy loop over
HF's own forward (so EOS handling and padded-vocab masking are explicit), and vLLM's
`check_logprobs_close` way of comparing two greedy runs."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
             attn_implementation: str | None = None):
    """An HF directory, or a GGUF file (transformers' own GGUF loader: `gguf_file=`);
    loaded once per (path, dtype, device, attention) however the defaults are spelled.
    attn_implementation: transformers' choice when None ("eager" applies Gemma 2's
    attention soft-cap, which its SDPA path cannot)."""
    return _hf_model(path, dtype, device, attn_implementation)


@functools.lru_cache(maxsize=8)
def _hf_model(path: str, dtype: torch.dtype, device: str, attn_implementation: str | None):
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = str(Path(path).parent), Path(path).name
    with _one_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
        kwargs.pop("attn_implementation", None)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    return model, tokenizer


@contextlib.contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """transformers opens a GGUF file once for the config, once for the tokenizer and once
    for the weights, and each open parses the whole vocabulary element by element (~10 s
    for Gemma 3's 262k tokens on this machine): inside this block one reader per file
    serves them all. The reader is read-only; llmd's own loader is not affected (it runs
    outside the block). It reads the file into memory instead of mapping it: the same
    bytes and fields, but its element-by-element parse slices a plain array, not a
    np.memmap (whose every slice is a Python-level subclass view: ~3x the parse time)."""
    import gguf
    import numpy as np

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode: str = "r"):
        key = (str(path), mode)
        if key not in readers:
            with _numpy_memmap(lambda file, mode="r": np.fromfile(file, dtype=np.uint8)):
                readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


@contextlib.contextmanager
def _numpy_memmap(replacement) -> Iterator[None]:
    """np.memmap is `replacement` inside the block (the gguf package's reader calls it once)."""
    import numpy as np

    real = np.memmap
    np.memmap = replacement
    try:
        yield
    finally:
        np.memmap = real


@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: list[int], max_tokens: int, k: int = 5,
              dtype: torch.dtype = torch.float32, device: str = "cpu", attn_implementation: str | None = None,
              prompt_pieces: list[int] | None = None) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens and, per position, the top-k logprobs {id: logprob} (chosen included).
    The prompt goes through one forward call, or with `prompt_pieces` (lengths summing
    to its length) through one call per piece over the cache of the ones before."""
    model, tokenizer = hf_model(path, dtype, device, attn_implementation)
    return model_greedy(model, len(tokenizer), prompt_ids, max_tokens, k, device, prompt_pieces)


@torch.inference_mode()
def model_greedy(model, valid: int, prompt_ids: list[int], max_tokens: int, k: int = 5, device: str = "cpu",
                 prompt_pieces: list[int] | None = None) -> tuple[list[int], list[dict[int, float]]]:
    """hf_greedy over a transformers model already built (`valid`: the tokenizer's size;
    logits past it are masked)."""
    past = None
    start = 0
    for length in prompt_pieces or [len(prompt_ids)]:
        ids = torch.tensor([prompt_ids[start:start + length]], device=device)
        out = model(ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        start += length
    assert start == len(prompt_ids), (prompt_pieces, len(prompt_ids))
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    logits = out.logits[0, -1].float()
    for _ in range(max_tokens):
        logits[valid:] = float("-inf")
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logprobs))
        values, indices = logprobs.topk(k)
        top = {int(i): float(v) for i, v in zip(indices, values)}
        top[token] = float(logprobs[token])
        tokens.append(token)
        tops.append(top)
        out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, tops


@torch.inference_mode()
def hf_forced_logprobs(path: str, prompt_ids: list[int], tokens: list[int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(tokens), V]: transformers' logprobs at each position of `tokens`, given the
    prompt and the tokens before it (one forward call)."""
    model, tokenizer = hf_model(path, dtype)
    logits = model(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    logits[:, len(tokenizer):] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt_ids: list[int]) -> torch.Tensor:
    """[len-1, V] logprobs: row i predicts prompt token i+1."""
    model, tokenizer = hf_model(path)
    logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    logits[:, len(tokenizer):] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def check_logprobs_close(ref: tuple[list[int], list[dict[int, float]]],
                         got: tuple[list[int], list[dict[int, float]]],
                         name: str, atol: float = 2e-3, top_atol: float | None = None) -> int:
    """Tokens identical, or at the first divergence each side's choice is in the other's
    top-k (then the runs are no longer comparable). Logprobs of matching positions agree
    within atol (the other top-k entries within top_atol, default atol). Returns the
    number of positions compared before a divergence."""
    top_atol = atol if top_atol is None else top_atol
    ref_tokens, ref_top = ref
    got_tokens, got_top = got
    assert len(ref_tokens) == len(got_tokens), f"{name}: lengths {len(ref_tokens)} != {len(got_tokens)}"
    for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)):
        if a != b:
            assert b in ref_top[i] and a in got_top[i], (
                f"{name}: position {i}: reference chose {a}, we chose {b}, and neither is in the "
                f"other's top-k ({ref_top[i]} vs {got_top[i]})")
            return i
        assert abs(ref_top[i][a] - got_top[i][b]) <= atol, (
            f"{name}: position {i}: logprob {got_top[i][b]} vs reference {ref_top[i][a]}")
        for tok, lp in got_top[i].items():
            if tok in ref_top[i]:
                assert abs(lp - ref_top[i][tok]) <= top_atol, f"{name}: position {i}, token {tok}: {lp} vs {ref_top[i][tok]}"
    return len(ref_tokens)


def engine_result(output) -> tuple[list[int], list[dict[int, float]]]:
    completion = output.outputs[0]
    return completion.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in completion.logprobs]
