"""Benchmark workloads as token ids (seeded, so every run and every engine gets the same):

* `fixed`: N prompts of exactly `input_len` random tokens, `output_len` new tokens each;
* `nano`: nano-vllm's mixed workload, input and output lengths uniform in [100, L];
* `shared_prefix`: N requests over a few long shared prefixes, each with its own short
  suffix (what an editor sends: the same file, a different cursor).

Token ids are drawn from [FIRST_ID, vocab): low enough for any model's vocabulary, and
clear of the fixtures' special tokens (0..4). Outputs run to their length (ignore_eos).
"""
from __future__ import annotations

import random

import msgspec

FIRST_ID = 5
NANO_MIN_LEN = 100
# Seed of warm-up requests: a string, so it never equals a workload's (int) seed;
# random.Random(-1) is random.Random(1), a warm-up could otherwise prime the prefix cache.
WARM_UP_SEED = "llmd-bench-warm-up"


class Req(msgspec.Struct, array_like=True):
    prompt: list[int]
    output_len: int


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int | str) -> list[list[int]]:
    """n prompts of random ids in [FIRST_ID, vocab), lengths uniform in [lo, hi]."""
    if vocab <= FIRST_ID:
        raise ValueError(f"vocabulary of {vocab} tokens is too small for random prompts")
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def fixed(n: int, input_len: int, output_len: int, vocab: int, seed: int | str) -> list[Req]:
    return [Req(p, output_len) for p in make_prompts(n, input_len, input_len, vocab, seed)]


def nano(n: int, max_len: int, vocab: int, seed: int | str) -> list[Req]:
    if max_len < NANO_MIN_LEN:
        raise ValueError(f"the nano workload needs a maximum length of at least {NANO_MIN_LEN}, got {max_len}")
    prompts = make_prompts(n, NANO_MIN_LEN, max_len, vocab, seed)
    rng = random.Random(f"{seed}:output-lengths")
    return [Req(p, rng.randint(NANO_MIN_LEN, max_len)) for p in prompts]


def shared_prefix(n: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                  vocab: int, seed: int | str) -> list[Req]:
    """Request i continues prefix i % num_prefixes with a suffix of its own."""
    prefixes = make_prompts(num_prefixes, prefix_len, prefix_len, vocab, f"{seed}:prefixes")
    suffixes = make_prompts(n, suffix_len, suffix_len, vocab, f"{seed}:suffixes")
    return [Req(prefixes[i % num_prefixes] + suffixes[i], output_len) for i in range(n)]


def longest(reqs: list[Req]) -> int:
    """Most tokens one request needs (prompt + output)."""
    return max(len(r.prompt) + r.output_len for r in reqs)
