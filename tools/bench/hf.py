"""The baseline: the same workload through Hugging Face transformers' `generate`, in this
process, on the same weights, dtype and device.

HF batches statically: prompts go in chunks of `batch` (left-padded), and each chunk
generates as many tokens as its longest request asks for (`min_new_tokens` equal, so EOS
cannot end it early). Only the requested tokens count, as in vLLM's HF baseline.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import torch


class HfRun(msgspec.Struct, kw_only=True):
    output_tokens: int  # requested tokens (what counts)
    generated_tokens: int  # what HF computed, padding rows included
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def run_hf(model: str, dtype: torch.dtype, device: torch.device | str, prompts: list[list[int]],
           output_lens: list[int], batch: int, progress=None,
           clock: Callable[[], float] = time.perf_counter) -> HfRun:
    """`clock` times the generation (time.thread_time: CPU time of this thread, for
    single-threaded runs on a busy machine)."""
    from transformers import AutoModelForCausalLM

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # what the caller freed (llmd's KV cache) goes back first
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def generate(chunk: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(chunk)

    generate(prompts[:1], 4)  # warm-up
    start = clock()
    generated = 0
    for i in range(0, len(prompts), batch):
        generated += generate(prompts[i:i + batch], max(output_lens[i:i + batch]))
        if progress is not None:
            progress.update(len(prompts[i:i + batch]))
    seconds = clock() - start
    del hf
    return HfRun(output_tokens=sum(output_lens), generated_tokens=generated, seconds=seconds)
