"""The per-row sampling parameters of one batch as tensors (`SamplingMetadata`), built
once per batch composition from each row's SamplingParams, prompt and output so far;
`append_sampled` keeps it current from step to step without a rebuild. The sampler
(sampler.py) and the rejection sampler read it; a stage no row needs is None and skipped.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from llmd_client.protocol import SamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


def argmax_only(p: SamplingParams) -> bool:
    """Whether a request's token is the argmax of its raw logits and nothing else of them
    is read: greedy, no penalties, grammar or min_tokens to change them, no logprobs."""
    return (p.temperature < SAMPLING_EPS and p.logprobs is None and p.guided is None and p.min_tokens == 0
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one batch, on the logits' device.

    Optional tensors are None when no row needs them, and the sampler then skips that
    stage. Column tensors are [N, 1] so they broadcast against [N, V] logits.
    """

    num_rows: int
    vocab_limit: int  # logits are cut to [:, :vocab_limit] (the largest valid vocab size)
    pad_mask: torch.Tensor | None  # [N, vocab_limit] bool: ids past a smaller row vocab
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # [N] bool, only in a mixed batch
    temperature: torch.Tensor | None  # [N, 1] float32, 1.0 on greedy rows; None if all 1.0
    top_k: torch.Tensor | None  # [N, 1] int64, vocab_limit where off
    max_top_k: int  # largest top_k in use (0 when none)
    top_p: torch.Tensor | None  # [N, 1] float32
    log_min_p: torch.Tensor | None  # [N, 1] float32, -inf where off
    repetition_penalty: torch.Tensor | None  # [N, 1] float32
    presence_penalty: torch.Tensor | None  # [N, 1] float32
    frequency_penalty: torch.Tensor | None  # [N, 1] float32
    prompt_mask: torch.Tensor | None  # [N, vocab_limit] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [N, vocab_limit] float32: occurrences in the output
    # min_tokens: (row, token) pairs masked while the row's output is shorter than `until`.
    min_tokens_rows: torch.Tensor | None  # [P] int64
    min_tokens_ids: torch.Tensor | None  # [P] int64
    min_tokens_until: torch.Tensor | None  # [P] int64
    min_tokens_by_row: list[tuple[int, int]]  # host copy: (row, min_tokens)
    num_output_tokens: list[int]  # per row: tokens generated before this step
    num_output_tokens_t: torch.Tensor | None  # [N] int64 device copy, only for min_tokens
    seeded_rows: list[tuple[int, int]]  # (row, seed) of random rows that carry a seed
    max_num_logprobs: int | None  # k of the top logprobs to return; None: no logprobs
    # Guided decoding: [N, words] int32 bitmask words (xgrammar's layout) on the logits'
    # device, all ones on unguided rows; None when no row is guided. See mask_grammar.
    grammar_bitmask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        *,
        valid_vocab_size: int | Sequence[int],
        eos_token_id: int | None | Sequence[int | None] = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Row i samples for the request with params[i], prompt_token_ids[i] and the
        output_token_ids[i] generated so far (their count is the position being sampled).
        valid_vocab_size / eos_token_id are one value for all rows or one per row."""
        n = len(params)
        device = torch.device(device)
        vocab_sizes = [valid_vocab_size] * n if isinstance(valid_vocab_size, int) else list(valid_vocab_size)
        eos_ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id] * n
        vocab_limit = valid_vocab_size if isinstance(valid_vocab_size, int) else max(vocab_sizes)
        pad_mask = None
        if any(v < vocab_limit for v in vocab_sizes):
            arange = torch.arange(vocab_limit)
            pad_mask = (arange[None, :] >= torch.tensor(vocab_sizes)[:, None]).to(device, non_blocking=True)
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        num_output_tokens = [len(out) for out in output_token_ids]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=n,
            vocab_limit=vocab_limit,
            pad_mask=pad_mask,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else _index(greedy, device).bool(),
            **_filter_fields(params, greedy, vocab_limit, device),
            **_penalty_fields(params, prompt_token_ids, output_token_ids, vocab_limit, device),
            **_min_tokens_fields(params, num_output_tokens, eos_ids, vocab_sizes, device),
            num_output_tokens=num_output_tokens,
            seeded_rows=[(i, p.seed) for i, p in enumerate(params) if not greedy[i] and p.seed is not None],
            max_num_logprobs=max(requested) if requested else None,
        )

    def set_grammar_bitmask(self, rows: Sequence[int], bitmask: bytes, device: torch.device) -> None:
        """Rows `rows` sample under a grammar; `bitmask` holds their allowed-token bits
        (xgrammar's layout: int32 words, bit b of word w = token 32*w + b). The words go to
        the device as they are, every other row all ones: the host never expands them."""
        given = np.frombuffer(bitmask, dtype=np.int32).reshape(len(rows), -1)
        words = np.full((self.num_rows, given.shape[1]), -1, dtype=np.int32)
        words[np.asarray(rows, dtype=np.int64)] = given
        self.grammar_bitmask = torch.from_numpy(words).to(device, non_blocking=True)

    def mask_grammar(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, vocab_limit] float32 logits plus the grammar's bias: -inf on the ids each
        row's grammar forbids, 0 elsewhere (a new tensor; the logits are finite). One
        lookup unpacks the words on the device and one add applies them: no branch per
        token, so it costs the same whatever share of the vocabulary a grammar allows
        (xgrammar's CPU kernel and a masked_fill both slow down several-fold on typical
        masks, see docs/benchmarks.md)."""
        return logits + unpack_bitmask(self.grammar_bitmask, self.vocab_limit, as_bias=True)

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None

    @property
    def min_tokens_pending(self) -> bool:
        return any(self.num_output_tokens[row] < until for row, until in self.min_tokens_by_row)

    def append_sampled(self, sampled_token_ids: torch.Tensor) -> None:
        """Advance every row by the token it just sampled (same batch next step)."""
        self.num_output_tokens = [c + 1 for c in self.num_output_tokens]
        if self.num_output_tokens_t is not None:
            self.num_output_tokens_t += 1
        if self.output_counts is not None:
            ones = torch.ones(self.num_rows, 1, dtype=self.output_counts.dtype,
                              device=self.output_counts.device)
            self.output_counts.scatter_add_(1, sampled_token_ids.view(-1, 1).long(), ones)


def unpack_bitmask(words: torch.Tensor, vocab: int, *, as_bias: bool = False) -> torch.Tensor:
    """[R, W] int32 bitmask words -> [R, vocab] (bit b of word w is token 32*w + b): bool,
    True where allowed, or with `as_bias` float32, 0 where allowed and -inf where not.
    Every byte of the words is looked up in a 256 x 8 table, one gather on their device.
    Byte k of word w holds tokens 32*w + 8*k .. + 7 in memory on a little-endian machine
    (every CPU and GPU torch runs on here)."""
    if words.shape[1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {words.shape[1] * 32} tokens, fewer than {vocab}")
    key = (words.device, as_bias)
    table = _BYTE_BITS.get(key)
    if table is None:  # made on the device (arange), not copied from the host: no sync
        byte = torch.arange(256, device=words.device).unsqueeze(1)
        allowed = ((byte >> torch.arange(8, device=words.device)) & 1).bool()
        table = _BYTE_BITS[key] = torch.where(allowed, 0.0, float("-inf")) if as_bias else allowed
    data = words.contiguous().view(torch.uint8).view(-1)
    return table.index_select(0, data.int()).view(words.shape[0], -1)[:, :vocab]


# unpack_bitmask's tables, per device and kind: row b is the 8 bits of byte value b,
# lowest first (as bools, or as 0 / -inf).
_BYTE_BITS: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _column(values: list[float], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, 1] tensor of one value per row, on `device`."""
    return torch.tensor(values, dtype=dtype).view(len(values), 1).to(device, non_blocking=True)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _filter_fields(params: Sequence[SamplingParams], greedy: list[bool], vocab_limit: int,
                   device: torch.device) -> dict[str, Any]:
    """SamplingMetadata's temperature, top-k, top-p and min-p fields: each None when no
    row uses it. The filters matter only on random rows; greedy rows get neutral values."""
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    top_ks = [p.top_k if not g and 0 < p.top_k < vocab_limit else vocab_limit
              for g, p in zip(greedy, params)]
    top_ps = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
    min_ps = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
    return dict(
        temperature=None if all(t == 1.0 for t in temps) else _column(temps, device),
        top_k=_column(top_ks, device, torch.int64) if any(k < vocab_limit for k in top_ks) else None,
        max_top_k=max((k for k in top_ks if k < vocab_limit), default=0),
        top_p=_column(top_ps, device) if any(x < 1.0 for x in top_ps) else None,
        log_min_p=_column(min_ps, device).log() if any(m > 0.0 for m in min_ps) else None,
    )


def _penalty_fields(params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], vocab_limit: int,
                    device: torch.device) -> dict[str, Any]:
    """SamplingMetadata's repetition, presence and frequency penalty columns (each None
    when no row uses it) and the token tables they read: output counts of every
    penalized row, prompt presence of the rows with a repetition penalty."""
    n = len(params)
    rep = [p.repetition_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    use_rep = any(r != 1.0 for r in rep)
    use_pres = any(x != 0.0 for x in pres)
    use_freq = any(x != 0.0 for x in freq)
    prompt_mask = output_counts = None
    if use_rep or use_pres or use_freq:
        rows = [i for i in range(n) if rep[i] != 1.0 or pres[i] != 0.0 or freq[i] != 0.0]
        output_counts = _token_table([output_token_ids[i] for i in rows], rows, n, vocab_limit,
                                     torch.float32, device)
        if use_rep:
            rep_rows = [i for i in rows if rep[i] != 1.0]
            prompt_mask = _token_table([prompt_token_ids[i] for i in rep_rows], rep_rows, n,
                                       vocab_limit, torch.bool, device)
    return dict(
        repetition_penalty=_column(rep, device) if use_rep else None,
        presence_penalty=_column(pres, device) if use_pres else None,
        frequency_penalty=_column(freq, device) if use_freq else None,
        prompt_mask=prompt_mask,
        output_counts=output_counts,
    )


def _min_tokens_fields(params: Sequence[SamplingParams], num_output_tokens: list[int],
                       eos_ids: list[int | None], vocab_sizes: list[int], device: torch.device) -> dict[str, Any]:
    """SamplingMetadata's min_tokens fields: the (row, stop token) pairs to mask while the
    row's output is shorter than its min_tokens (EOS unless ignored, and its stop ids)."""
    pair_rows: list[int] = []
    pair_ids: list[int] = []
    pair_until: list[int] = []
    min_tokens_by_row: list[tuple[int, int]] = []
    for i, p in enumerate(params):
        if p.min_tokens <= num_output_tokens[i]:
            continue
        stop_ids = set(p.stop_token_ids or ())
        if eos_ids[i] is not None and not p.ignore_eos:
            stop_ids.add(eos_ids[i])
        stop_ids = {t for t in stop_ids if t < vocab_sizes[i]}
        if stop_ids:
            min_tokens_by_row.append((i, p.min_tokens))
            pair_rows += [i] * len(stop_ids)
            pair_ids += sorted(stop_ids)
            pair_until += [p.min_tokens] * len(stop_ids)
    has_min_tokens = bool(pair_rows)
    return dict(
        min_tokens_rows=_index(pair_rows, device) if has_min_tokens else None,
        min_tokens_ids=_index(pair_ids, device) if has_min_tokens else None,
        min_tokens_until=_index(pair_until, device) if has_min_tokens else None,
        min_tokens_by_row=min_tokens_by_row,
        num_output_tokens_t=_index(num_output_tokens, device) if has_min_tokens else None,
    )


def _token_table(token_lists: list[Sequence[int]], rows: list[int], num_rows: int, vocab: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] occurrence counts (float) or presence (bool) of each row's tokens."""
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64,
                         count=int(lengths.sum()))
    flat = np.repeat(np.asarray(rows, dtype=np.int64), lengths) * vocab + tokens
    flat = torch.from_numpy(flat[(tokens >= 0) & (tokens < vocab)]).to(device, non_blocking=True)
    table = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    table.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=device))
    table = table.view(num_rows, vocab)
    return table > 0 if dtype == torch.bool else table
