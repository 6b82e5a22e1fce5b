"""One bench_gguf measurement in a fresh process (so its peak RSS is its own): one engine
on one GGUF file, its prompts (token ids, made by the parent: every engine gets the
same) from a JSON file; prints one JSON line of figures. Imports nothing heavy at the
top: a llama.cpp run must not carry torch's memory.

    python -m llmd_tools.bench_gguf_child ENGINE MODEL PROMPTS_JSON TOKENS THREADS

One prompt: batch-1 decode (`decode_tok_s`: the tokens after the first over the time
after the first) and time to first token (`ttft_s`). Several prompts: all of them at
once, each generating TOKENS greedy tokens, end of text ignored (`throughput_tok_s`:
every generated token over the wall time from the first request to the last token;
`batch_ttft_s`: until every sequence has its first token; `batch_decode_tok_s`: the
tokens after each one's first over the time after that). llmd runs through its engine
(`max_num_seqs` = the prompts, continuous batching as it schedules); llama.cpp through
llama-cpp-python's low-level API as llama.cpp's `batched` example drives it: one context
with `n_seq_max` = the prompts, every prompt in one `llama_decode`, then one
`llama_decode` per step with one token of each sequence (the high-level Llama class
cannot batch sequences). Every run also gives the greedy tokens of each sequence
(`tokens`), so that the engines can be seen to do the same work.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from typing import Any

# llmd's settings per engine name (bench_gguf.ENGINES), passed to LLM().
LLMD_SETTINGS: dict[str, dict[str, Any]] = {
    "llmd": dict(dtype="auto"), "llmd-packed-bf16": dict(dtype="bfloat16"),
    "llmd-int8": dict(dtype="auto", cpu_int8_activations=True), "llmd-no-x16": dict(dtype="auto"),
    "llmd-3p": dict(dtype="auto"), "llmd-no-greedy-head": dict(dtype="auto"),
    "llmd-kv16": dict(dtype="auto", kv_cache_dtype="float16"),
    "llmd-int8-kv16": dict(dtype="auto", cpu_int8_activations=True, kv_cache_dtype="float16"),
    "llmd-f32": dict(dtype="float32", dequantize=True), "llmd-bf16": dict(dtype="bfloat16", dequantize=True),
}
WARMUP_TOKENS = 4  # a short run of the same shape first: kernels built, caches warm
WARMUP_PROMPT = 8  # prompt length of a batched warm-up (a full-length one would double the prefill)
BLOCK_SIZE = 16  # llmd's default KV block


def status_mib(key: str) -> float:
    """/proc/self/status VmHWM (the peak so far) or VmRSS (now), in MiB. Both peaks a run
    reports come from VmHWM: getrusage's ru_maxrss may differ from it by a page."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def loaded_figures() -> dict[str, float]:
    return {"load_peak_rss_mib": status_mib("VmHWM"), "loaded_rss_mib": status_mib("VmRSS")}


# --- llama.cpp ------------------------------------------------------------------------

def llamacpp_single(model: str, prompt: list[int], tokens: int, threads: int) -> dict[str, float]:
    """llama.cpp's eval loop through the high-level Llama class, a greedy pick of the last
    logits read in place; TTFT is the prompt's evaluation and the first pick."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=len(prompt) + tokens + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=len(prompt), verbose=False)
    figures = loaded_figures()
    vocab = llm.n_vocab()

    def greedy() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    def run(n: int) -> tuple[float, float, list[int]]:
        llm.reset()
        llm._ctx.kv_cache_clear()
        start = time.perf_counter()
        llm.eval(prompt)
        out = [greedy()]
        first = time.perf_counter()
        for _ in range(n):
            llm.eval(out[-1:])
            out.append(greedy())
        return first - start, time.perf_counter() - first, out

    run(WARMUP_TOKENS)
    ttft, decode, out = run(tokens)
    return {**figures, "ttft_s": ttft, "decode_tok_s": tokens / decode, "tokens": [out]}


def llamacpp_batched(model: str, prompts: list[list[int]], tokens: int, threads: int) -> dict[str, float]:
    """All prompts as sequences 0..N-1 of one context (module doc)."""
    import llama_cpp as lc
    import numpy as np

    n, longest = len(prompts), max(len(p) for p in prompts)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model_p = lc.llama_model_load_from_file(model.encode(), mparams)
    if not model_p:
        raise SystemExit(f"llama.cpp could not load {model}")
    cparams = lc.llama_context_default_params()
    cparams.n_seq_max = n
    cparams.n_ctx = n * (longest + tokens + 8)  # KV cells: each sequence's share (kv_unified off)
    cparams.n_batch = max(n * longest, n)  # every prompt in one llama_decode
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model_p, cparams)
    if not ctx:
        raise SystemExit("llama.cpp could not create the context")
    figures = loaded_figures()
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model_p))
    batch = lc.llama_batch_init(cparams.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; the
        greedy token of each entry that wants logits, in order."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,))))
                for i, e in enumerate(entries) if e[3]]

    def run(run_prompts: list[list[int]], n_tokens: int) -> tuple[float, float, list[list[int]]]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        start = time.perf_counter()
        out = [[t] for t in decode([(t, pos, seq, pos == len(p) - 1)
                                    for seq, p in enumerate(run_prompts) for pos, t in enumerate(p)])]
        first = time.perf_counter()
        for step in range(n_tokens - 1):
            picked = decode([(out[seq][-1], len(p) + step, seq, True) for seq, p in enumerate(run_prompts)])
            for seq, token in enumerate(picked):
                out[seq].append(token)
        return first - start, time.perf_counter() - first, out

    run([p[:WARMUP_PROMPT] for p in prompts], WARMUP_TOKENS)
    ttft, rest, out = run(prompts, tokens)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model_p)
    return {**figures, **_batch_figures(n, tokens, ttft, rest), "tokens": out}


# --- llmd -----------------------------------------------------------------------------

def _llmd(engine: str, model: str, n: int, longest: int, tokens: int, threads: int) -> Any:
    from llmd import LLM

    if engine == "llmd-no-greedy-head":  # every greedy row's logits at two passes (greedy_head)
        from llmd.gpu.layers import greedy_head

        greedy_head.GREEDY_MIN_ROWS = 1 << 30

    blocks_per_seq = -(-(longest + tokens + WARMUP_TOKENS) // BLOCK_SIZE) + 1
    return LLM(model, device="cpu", max_model_len=longest + tokens + 8, max_num_seqs=n, cpu_threads=threads,
               enable_prefix_caching=False, num_gpu_blocks_override=n * blocks_per_seq + 4,
               **LLMD_SETTINGS[engine])


def _llmd_run(llm: Any, prompts: list[list[int]], n_tokens: int, tag: str) -> tuple[float, float, list[list[int]]]:
    """Every prompt added at once, the engine stepped here until all finish: the time until
    each has its first token, then the rest's, and each one's tokens."""
    from llmd import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    finished: dict[str, list[int]] = {}
    first = None
    while len(finished) < len(prompts):
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        if first is None and len(started) == len(prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, end - first, [finished[f"{tag}-{i}"] for i in range(len(prompts))]


def llmd_single(engine: str, model: str, prompt: list[int], tokens: int, threads: int) -> dict[str, float]:
    llm = _llmd(engine, model, 1, len(prompt), tokens, threads)
    figures = loaded_figures()
    _llmd_run(llm, [prompt], WARMUP_TOKENS + 1, "warm-up")
    ttft, decode, out = _llmd_run(llm, [prompt], tokens + 1, "timed")
    return {**figures, "ttft_s": ttft, "decode_tok_s": tokens / decode, "tokens": out}


def llmd_batched(engine: str, model: str, prompts: list[list[int]], tokens: int, threads: int) -> dict[str, float]:
    llm = _llmd(engine, model, len(prompts), max(len(p) for p in prompts), tokens, threads)
    figures = loaded_figures()
    _llmd_run(llm, [p[:WARMUP_PROMPT] for p in prompts], WARMUP_TOKENS, "warm-up")
    ttft, rest, out = _llmd_run(llm, prompts, tokens, "timed")
    return {**figures, **_batch_figures(len(prompts), tokens, ttft, rest), "tokens": out}


def _batch_figures(n: int, tokens: int, ttft: float, rest: float) -> dict[str, float]:
    return {"throughput_tok_s": n * tokens / (ttft + rest), "batch_ttft_s": ttft,
            "batch_decode_tok_s": n * (tokens - 1) / rest if tokens > 1 else 0.0}


def measure(engine: str, model: str, prompts: list[list[int]], tokens: int, threads: int) -> dict[str, Any]:
    if engine == "llama.cpp":
        figures = (llamacpp_single(model, prompts[0], tokens, threads) if len(prompts) == 1
                   else llamacpp_batched(model, prompts, tokens, threads))
    elif engine in LLMD_SETTINGS:
        figures = (llmd_single(engine, model, prompts[0], tokens, threads) if len(prompts) == 1
                   else llmd_batched(engine, model, prompts, tokens, threads))
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    peak = status_mib("VmHWM")  # the load's peak read from the same counter
    # which tree ran (--baseline), found without importing llmd (a llama.cpp run never
    # does: its peak RSS would count the import)
    return {"engine": engine, "batch": len(prompts), **figures, "peak_rss_mib": peak,
            "llmd_from": os.path.dirname(os.path.realpath(importlib.util.find_spec("llmd").origin))}


def main(argv: list[str]) -> int:
    engine, model, prompts_path, tokens, threads = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    with open(prompts_path) as f:
        prompts = json.load(f)
    print(json.dumps(measure(engine, model, prompts, tokens, threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
