"""Batched sampling: one token per row from the logits of the rows that sample.

Order (vLLM's): padded vocab is cut off → grammar bitmask (guided decoding) → min_tokens
masks EOS/stop ids → penalties → greedy argmax or temperature → top-k → top-p → min-p →
exponential race. Logprobs are taken from the logits with only the padded vocab and the
grammar removed (the distribution the request samples from before its own filters), as
vLLM does by default for the raw logits.

`SamplingMetadata` holds the per-row parameters as tensors, built once per batch
composition; `append_sampled` keeps it current from step to step without a rebuild.
Nothing here reads a tensor back to the host, but for top-p on CPU: one small vector per
window round (one in the common case, see apply_top_k_top_p; on CUDA top-p sorts and
never syncs). The runner copies the result once.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from llmd.gpu.sampling_filters import apply_min_p, apply_top_k_top_p
from llmd_client.protocol import SamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Generator seed for a seeded request's next token: a function of the request's seed
    and position only, so the draw does not depend on the batch, the row, or a restart."""
    return _splitmix64(_splitmix64(seed) ^ num_output_tokens)


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
    # Guided decoding: [N, vocab_limit] bool, True where the row's grammar allows the
    # token (all True on unguided rows); None when no row is guided. See set_grammar_bitmask.
    grammar_mask: torch.Tensor | None = None

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

        def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).view(n, 1).to(device, non_blocking=True)

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        random_params = [(i, p) for i, p in enumerate(params) if not greedy[i]]
        # Filters matter only on random rows; greedy rows get neutral values.
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        top_ks = [p.top_k if not g and 0 < p.top_k < vocab_limit else vocab_limit
                  for g, p in zip(greedy, params)]
        top_ps = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        min_ps = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
        use_top_k = any(k < vocab_limit for k in top_ks)
        use_min_p = any(m > 0.0 for m in min_ps)

        pad_mask = None
        if any(v < vocab_limit for v in vocab_sizes):
            arange = torch.arange(vocab_limit)
            pad_mask = (arange[None, :] >= torch.tensor(vocab_sizes)[:, None]).to(device)

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

        num_output_tokens = [len(out) for out in output_token_ids]
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

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        has_min_tokens = bool(pair_rows)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=n,
            vocab_limit=vocab_limit,
            pad_mask=pad_mask,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else index(greedy).bool(),
            temperature=None if all(t == 1.0 for t in temps) else column(temps),
            top_k=column(top_ks, torch.int64) if use_top_k else None,
            max_top_k=max((k for k in top_ks if k < vocab_limit), default=0),
            top_p=column(top_ps) if any(x < 1.0 for x in top_ps) else None,
            log_min_p=column(min_ps).log() if use_min_p else None,
            repetition_penalty=column(rep) if use_rep else None,
            presence_penalty=column(pres) if use_pres else None,
            frequency_penalty=column(freq) if use_freq else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            min_tokens_rows=index(pair_rows) if has_min_tokens else None,
            min_tokens_ids=index(pair_ids) if has_min_tokens else None,
            min_tokens_until=index(pair_until) if has_min_tokens else None,
            min_tokens_by_row=min_tokens_by_row,
            num_output_tokens=num_output_tokens,
            num_output_tokens_t=index(num_output_tokens) if has_min_tokens else None,
            seeded_rows=[(i, p.seed) for i, p in random_params if p.seed is not None],
            max_num_logprobs=max(requested) if requested else None,
        )

    def set_grammar_bitmask(self, rows: Sequence[int], bitmask: bytes, device: torch.device) -> None:
        """Rows `rows` sample under a grammar; `bitmask` holds their allowed-token bits
        (xgrammar's layout: int32 words, bit b of word w = token 32*w + b)."""
        words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(rows), -1).to(device)
        mask = torch.ones(self.num_rows, self.vocab_limit, dtype=torch.bool, device=device)
        mask[torch.tensor(rows, dtype=torch.int64, device=device)] = unpack_bitmask(words, self.vocab_limit)
        self.grammar_mask = mask

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


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask words -> [R, vocab] bool (bit b of word w is token 32*w + b)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    if bits.shape[1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {bits.shape[1] * 32} tokens, fewer than {vocab}")
    return bits.view(words.shape[0], -1)[:, :vocab].bool()


def _token_table(token_lists: list[Sequence[int]], rows: list[int], num_rows: int, vocab: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] occurrence counts (float) or presence (bool) of each row's tokens."""
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64,
                         count=int(lengths.sum()))
    flat = np.repeat(np.asarray(rows, dtype=np.int64), lengths) * vocab + tokens
    flat = torch.from_numpy(flat[(tokens >= 0) & (tokens < vocab)]).to(device)
    table = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    table.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=device))
    table = table.view(num_rows, vocab)
    return table > 0 if dtype == torch.bool else table


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # When any row asked for logprobs (k = the largest request):
    logprobs_token_ids: torch.Tensor | None = None  # [N, k+1] int64: sampled token, then top-k
    logprobs: torch.Tensor | None = None  # [N, k+1] float32
    ranks: torch.Tensor | None = None  # [N] int64: rank of the sampled token, 1 = most likely


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From logprobs [N, V] and chosen token_ids [N]: ids [N, k+1] and logprobs [N, k+1]
    with the chosen token first and then the top-k in descending order, and the chosen
    token's rank [N]: the number of tokens at least as likely (vLLM's; 1 = the most
    likely, and a tie ranks the token after its equals)."""
    token_ids = token_ids.long().view(-1, 1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    k = min(k, logprobs.shape[-1])
    if k <= 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids, top_ids], dim=1), torch.cat([token_logprobs, top_logprobs], dim=1), ranks


class Sampler:
    """Samples one token per row. Unseeded rows share one generator per device, seeded
    once from the engine seed; a seeded row draws from a generator reseeded from
    (its seed, its position) at every step, so it needs no state across steps."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._batch_generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = self.mask(logits, md)
        if md.all_greedy and md.max_num_logprobs is None and not md.has_penalties \
                and not md.min_tokens_pending:
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1))
        logits, raw_logprobs = self.prepare(logits, md)
        sampled, _ = self.sample(logits, md)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_token_ids=ids, logprobs=lps, ranks=ranks)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata, *, keep_probs: bool = False,
               salt: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prepared logits -> (one token per row: the argmax on greedy rows, a draw from
        the filtered distribution on random rows; with keep_probs, that distribution
        [N, vocab_limit] (rows of greedy requests too), else None). `salt` separates
        seeded rows' draws from other streams at the same position (see uniform)."""
        if md.all_greedy:
            return logits.argmax(dim=-1), None
        greedy = None if md.all_random else logits.argmax(dim=-1)
        probs = self.filter(logits, md).softmax(dim=-1)
        sampled = self.race(probs.clone() if keep_probs else probs, md, salt)
        if greedy is not None:
            sampled = torch.where(md.is_greedy, greedy, sampled)
        return sampled, probs if keep_probs else None

    # The stages, also used by the rejection sampler (speculative decoding) -------------
    @staticmethod
    def mask(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """float32 logits cut to the vocab, padded ids and grammar-forbidden ids at -inf."""
        if logits.shape[0] != md.num_rows or logits.shape[1] < md.vocab_limit:
            raise ValueError(f"logits {tuple(logits.shape)} do not fit sampling metadata of "
                             f"{md.num_rows} rows and vocab {md.vocab_limit}")
        logits = logits[:, :md.vocab_limit].float()
        if md.pad_mask is not None:
            logits = logits.masked_fill(md.pad_mask, float("-inf"))
        if md.grammar_mask is not None:
            logits = logits.masked_fill(~md.grammar_mask, float("-inf"))
        return logits

    @staticmethod
    def prepare(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masked logits -> (logits after min_tokens and penalties, the logprobs to report
        or None). Greedy rows take the argmax of the former."""
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if md.min_tokens_pending:
            masked = apply_min_tokens(logits, md)
            if md.grammar_mask is not None:
                # A grammar that allows only its end (EOS) outranks min_tokens: a row the
                # two would leave without any token keeps the grammar's choice.
                empty = torch.isneginf(masked).all(dim=-1, keepdim=True)
                masked = torch.where(empty, logits, masked)
            logits = masked
        if md.has_penalties:
            logits = apply_penalties(logits, md)
        return logits, raw_logprobs

    @staticmethod
    def filter(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p: the logits random rows sample from."""
        if md.temperature is not None:
            logits = logits / md.temperature
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)
        if md.log_min_p is not None:
            logits = apply_min_p(logits, md.log_min_p)
        return logits

    def race(self, probs: torch.Tensor, md: SamplingMetadata, salt: int = 0) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i
        (p need not be normalised). E = -log(U) is several times faster than exponential_
        on CPU. U is kept inside (0, 1) so that E is finite and positive: every token with
        p > 0 then beats every masked one (an E of 0 or inf would give NaN or an all-zero
        row). Overwrites probs."""
        noise = self.uniform(probs, md, salt)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny, max=1.0 - torch.finfo(noise.dtype).eps / 2)
        noise.log_().neg_()
        return probs.div_(noise).argmax(dim=-1)

    def uniform(self, like: torch.Tensor, md: SamplingMetadata, salt: int = 0) -> torch.Tensor:
        """U(0, 1) draws shaped like `like` ([N, ...]); a seeded row's draws depend only on
        (its seed, its position, salt), so they survive batching and restarts."""
        noise = torch.empty_like(like, dtype=torch.float32)
        device = like.device
        if len(md.seeded_rows) < md.num_rows:
            noise.uniform_(generator=self._generator(self._batch_generators, device, self.seed))
        if md.seeded_rows:
            gen = self._generator(self._row_generators, device, 0)
            for row, seed in md.seeded_rows:
                gen.manual_seed(step_seed(seed ^ salt, md.num_output_tokens[row]))
                noise[row].uniform_(generator=gen)
        return noise

    @staticmethod
    def _generator(table: dict[torch.device, torch.Generator], device: torch.device,
                   seed: int) -> torch.Generator:
        gen = table.get(device)
        if gen is None:
            gen = table[device] = torch.Generator(device=device)
            gen.manual_seed(seed)
        return gen


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    rows, ids = md.min_tokens_rows, md.min_tokens_ids
    active = md.num_output_tokens_t[rows] < md.min_tokens_until
    current = logits[rows, ids]
    return logits.index_put((rows, ids), torch.where(active, float("-inf"), current))


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    counts = md.output_counts
    if md.repetition_penalty is not None:
        seen = md.prompt_mask | (counts > 0)
        penalty = md.repetition_penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty * counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty * (counts > 0)
    return logits
