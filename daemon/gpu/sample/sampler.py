"""Batched sampling: one token per row from the logits of the rows that sample.

Order (vLLM's): padded vocab is cut off → grammar bitmask (guided decoding) → min_tokens
masks EOS/stop ids → penalties → greedy argmax or temperature → top-k → top-p → min-p →
exponential race. Logprobs are taken from the logits with only the padded vocab and the
grammar removed (the distribution the request samples from before its own filters), as
vLLM does by default for the raw logits.

`SamplingMetadata` (sampling_metadata.py) holds the per-row parameters as tensors.
Nothing here reads a tensor back to the host, but for top-p on CPU: one small vector per
window round (one in the common case, see apply_top_k_top_p; on CUDA top-p sorts and
never syncs). The runner copies the result once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.gpu.sample.filters import apply_min_p, apply_top_k_top_p
from llmd.gpu.sample.metadata import SAMPLING_EPS, SamplingMetadata

# The metadata is part of the sampler's interface: its users import it from here too.
__all__ = ["SAMPLING_EPS", "Sampler", "SamplerOutput", "SamplingMetadata", "apply_min_tokens",
           "apply_penalties", "argmax_rows", "gather_logprobs", "step_seed"]

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


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [N] int64: the first of equal maxima, a NaN counting as the
    largest (torch's rule, and numpy's). float32 logits on CPU go through numpy: torch's
    CPU argmax is not vectorized (one thread: ~100 us over a 49k vocabulary, ~550 over
    262k, against numpy's 8 and 20; a greedy batch-1 step of a small model is ~10 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


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
            return SamplerOutput(sampled_token_ids=argmax_rows(logits))
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
            return argmax_rows(logits), None
        greedy = None if md.all_random else argmax_rows(logits)
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
        if md.grammar_bitmask is not None:
            logits = md.mask_grammar(logits)
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
            if md.grammar_bitmask is not None:
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
            noise.uniform_(generator=self.batch_generator(device))
        if md.seeded_rows:
            gen = self._generator(self._row_generators, device, 0)
            for row, seed in md.seeded_rows:
                gen.manual_seed(step_seed(seed ^ salt, md.num_output_tokens[row]))
                noise[row].uniform_(generator=gen)
        return noise

    def batch_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from on `device` (a captured graph that draws
        registers it, so each replay draws fresh numbers from it)."""
        return self._generator(self._batch_generators, device, self.seed)

    @staticmethod
    def _generator(table: dict[torch.device, torch.Generator], device: torch.device,
                   seed: int) -> torch.Generator:
        device = device_key(device)
        gen = table.get(device)
        if gen is None:
            gen = table[device] = torch.Generator(device=device)
            gen.manual_seed(seed)
        return gen


def device_key(device: torch.device) -> torch.device:
    """One name per device: "cuda" and "cuda:0" (the current device) are one device, but
    unequal as dict keys. A runner made with torch.device("cuda") registers the generator
    of "cuda" with its graphs, while its tensors say "cuda:0": without this they drew from
    two generators, and a capture failed on the unregistered one ("Attempt to increase
    offset for a CUDA generator not in capture mode"). CPU indexes mean nothing: "cpu"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


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
