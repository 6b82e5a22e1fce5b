"""The sampler tests' shared helpers (test_sampler.py, test_top_k_top_p.py): sampling
metadata and one sampling call, and the independent references they check against —
vLLM's distribution written out token by token, Pearson's chi-square, the penalties."""
from __future__ import annotations

import numpy as np
import torch

from llmd.gpu.sample.sampler import Sampler, SamplingMetadata
from llmd_client.protocol import SamplingParams

NEG_INF = float("-inf")
# Distinct logits of a 12-token vocab, deliberately not sorted by id.
LOGITS12 = np.array([0.3, 2.0, -0.9, 1.1, -0.2, 1.6, 0.0, -1.4, 0.8, 1.3, -0.5, 0.5])


def metadata(params: list[SamplingParams], vocab: int | list[int], prompts=None, outputs=None,
             eos: int | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, prompts or [[] for _ in range(n)],
                                  outputs or [[] for _ in range(n)], valid_vocab_size=vocab,
                                  eos_token_id=eos)


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kw) -> torch.Tensor:
    md = metadata(params, kw.pop("vocab", logits.shape[1]), **kw)
    return Sampler(seed=seed)(logits, md).sampled_token_ids


def reference_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The distribution vLLM samples from, written out token by token."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = [True] * len(p)
    if top_k:
        for i in order[top_k:]:
            keep[i] = False
    if top_p < 1.0:
        kept_mass = sum(p[i] for i in order if keep[i])
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= top_p:  # the tokens before it already reach top_p
                keep[i] = False
            else:
                mass += p[i] / kept_mass
    if min_p > 0.0:
        top = max(p[i] for i in range(len(p)) if keep[i])
        for i in range(len(p)):
            keep[i] = keep[i] and p[i] >= min_p * top
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi_square_pvalue(tokens: torch.Tensor, expected: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit; a token drawn where the expected
    probability is 0 fails outright (p = 0)."""
    observed = np.bincount(tokens.numpy(), minlength=len(expected)).astype(np.float64)
    if observed[expected == 0].sum() > 0:
        return 0.0
    support = expected > 0
    e = expected[support] * observed.sum()
    stat = float(((observed[support] - e) ** 2 / e).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    # Survival function of chi2(dof) = regularized upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def reference_penalties(logits: np.ndarray, prompt: list[int], output: list[int], rep: float,
                        presence: float, frequency: float) -> np.ndarray:
    out = logits.copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= presence
    for t in output:
        out[t] -= frequency
    return out
