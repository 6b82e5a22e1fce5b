"""Top-k / top-p: the windowed filter against the full sort, ties at the nucleus's edge,
and the sort rule against a plain reference and the old rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmd.gpu.sample import filters as sampler_module
from llmd.gpu.sample.filters import apply_top_k_top_p, apply_top_k_top_p_sorted
from llmd_client.protocol import SamplingParams
from sampler_refs import NEG_INF, reference_probs, sample


# -- top-k / top-p: the windowed filter against the full sort -------------------------------

def kept_sets(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).view(-1).tolist()) for row in logits]


def clear_of_rounding(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                      margin: float = 1e-5) -> torch.Tensor:
    """top_p moved off the float32 rounding zone: where the mass of a row's top j tokens
    lies within `margin` of its top_p, the sort's float32 sum and the window's float64 one
    may round to different sides of it. Such rows get the midpoint between two masses."""
    x = logits.double()
    if top_k is not None:
        kth = x.sort(dim=-1, descending=True).values.gather(1, top_k.clamp(max=x.shape[1]) - 1)
        x = x.masked_fill(x < kth, NEG_INF)
    mass = x.softmax(dim=-1).sort(dim=-1, descending=True).values.cumsum(dim=-1)
    top_p = top_p.clone()
    for row in torch.nonzero(((mass - top_p.double()).abs() < margin).any(dim=-1)).view(-1).tolist():
        if top_p[row, 0] >= 1.0:
            continue
        m = mass[row][mass[row] < 1 - margin].unique()
        j = int(torch.searchsorted(m, torch.tensor(float(top_p[row, 0]), dtype=torch.float64)))
        lo, hi = (float(m[j - 1]) if j > 0 else 0.0), (float(m[j]) if j < len(m) else 1.0)
        top_p[row, 0] = (lo + hi) / 2
    return top_p


def random_batch(gen: torch.Generator, kind: str, rows: int, vocab: int):
    """Logits, top_k (or None), max_top_k and top_p of a batch of one kind of row."""
    def rand(*shape):
        return torch.rand(*shape, generator=gen)
    std = {"peaked": 4 + 4 * rand(rows, 1), "medium": 2 + 1.5 * rand(rows, 1),
           "flat": 0.2 + 0.8 * rand(rows, 1)}.get(kind, 0.5 + 7.5 * rand(rows, 1))
    logits = torch.randn(rows, vocab, generator=gen) * std
    if kind == "ties":  # few distinct values, many tied at the top-p edge
        logits = (logits * 2).round() / 2
    if kind == "bf16":
        logits = logits.to(torch.bfloat16).float()
    if kind == "padded":  # -inf past a shorter vocab, and masked ids (min_tokens)
        logits[:, vocab - int(vocab * float(rand(()) * 0.5)) - 1:] = NEG_INF
        logits[rand(rows, vocab) < 0.05] = NEG_INF
        logits[:, 0] = torch.randn(rows, generator=gen)
    top_p = rand(rows, 1) * 0.98 + 0.01
    top_p[rand(rows, 1) < 0.15] = 1.0  # unfiltered rows beside filtered ones
    top_p[rand(rows, 1) < 0.1] = 1e-7  # tiny: the most likely token only
    top_k, max_top_k = None, 0
    if kind in ("top_k", "ties", "padded", "bf16"):
        top_k = torch.randint(1, min(vocab, 1500), (rows, 1), generator=gen)
        top_k[rand(rows, 1) < 0.3] = vocab  # off
        if (top_k < vocab).any():
            max_top_k = int(top_k[top_k < vocab].max())
        else:
            top_k = None
    return logits, top_k, max_top_k, clear_of_rounding(logits, top_k, top_p)


@pytest.mark.parametrize("kind", ["peaked", "medium", "flat", "mixed", "ties", "bf16", "top_k", "padded"])
def test_top_p_window_matches_full_sort(kind, monkeypatch):
    """The windowed top-k/top-p keeps exactly the tokens the full sort keeps, on batches
    that settle in the first window, need wider ones, or fall back to the sort."""
    widths, sorted_rows = [], []
    window, fallback = sampler_module._top_p_window, sampler_module.apply_top_k_top_p_sorted
    monkeypatch.setattr(sampler_module, "_top_p_window",
                        lambda values, *a: widths.append(values.shape[1]) or window(values, *a))
    monkeypatch.setattr(sampler_module, "apply_top_k_top_p_sorted",
                        lambda logits, *a: sorted_rows.append(logits.shape[0]) or fallback(logits, *a))
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    for vocab in (3000, 8192, 300, 12):
        for _ in range(3):
            logits, top_k, max_top_k, top_p = random_batch(gen, kind, 24, vocab)
            got = apply_top_k_top_p(logits, top_k, max_top_k, top_p)
            want = fallback(logits, top_k, top_p)
            assert torch.equal(got, want), [
                (row, float(top_p[row]), len(a), len(b))
                for row, (a, b) in enumerate(zip(kept_sets(got), kept_sets(want))) if a != b]
    # the batches took the paths they are there for
    if kind == "peaked":
        assert not sorted_rows and widths.count(64) == 9
    if kind == "medium":
        assert {256, 1024} <= set(widths)
    if kind == "flat":
        assert sum(sorted_rows) > 40


def test_top_p_ties_at_the_edge_keep_the_lowest_ids():
    """Tokens tied at the top-p edge: as many as the mass needs, lowest ids first, in the
    window and in the sort alike; ties in blocks that run past the first window too."""
    vocab = 4096
    gen = torch.Generator().manual_seed(11)
    for block in (5, 100, 2000):
        ids = torch.randperm(vocab, generator=gen)
        logits = torch.full((1, vocab), -20.0)
        logits[0, ids[0]] = 8.0
        logits[0, ids[1:1 + block]] = 2.0
        p = torch.softmax(logits.double(), -1)[0]
        p_top, p_tied = float(p[ids[0]]), float(p[ids[1]])
        for keep_tied in (1, block // 2, block - 1):
            top_p = torch.tensor([[p_top + (keep_tied - 0.5) * p_tied]])
            want = {int(ids[0])} | set(sorted(ids[1:1 + block].tolist())[:keep_tied])
            for fn in (apply_top_k_top_p, lambda x, k, m, q: apply_top_k_top_p_sorted(x, k, q)):
                assert kept_sets(fn(logits, None, 0, top_p)) == [want], (block, keep_tied)
        # tiny top_p among tokens tied for the max keeps the first of them, like argmax
        flat = torch.zeros(1, vocab)
        assert kept_sets(apply_top_k_top_p(flat, None, 0, torch.tensor([[1e-6]]))) == [{0}]
        assert kept_sets(apply_top_k_top_p_sorted(flat, None, torch.tensor([[1e-6]]))) == [{0}]


def test_top_p_sort_rule_matches_plain_reference():
    """The sort-based rule itself against the token-by-token reference, with ties at the
    top-p edge (reference_probs breaks ties at the k-th value, the sampler keeps them)."""
    gen = torch.Generator().manual_seed(12)
    for _ in range(200):
        logits = (torch.randn(1, 40, generator=gen) * 2).round() / 2
        top_p = clear_of_rounding(logits, None, torch.rand(1, 1, generator=gen))
        probs = reference_probs(logits[0].double().numpy(), top_p=float(top_p))
        want = set(np.flatnonzero(probs > 0).tolist())
        assert kept_sets(apply_top_k_top_p_sorted(logits, None, top_p)) == [want]
        assert kept_sets(apply_top_k_top_p(logits, None, 0, top_p)) == [want]


def old_sort_rule(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """The sampler's top-k/top-p before the window, verbatim: which of the tokens tied at
    the top-p edge it kept was up to the sort."""
    neg_inf = float("-inf")
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, vocab - top_k)
        sorted_logits.masked_fill_(sorted_logits < kth, neg_inf)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, neg_inf)
    return sorted_logits.scatter(-1, order, sorted_logits)


def test_sort_rule_is_the_old_rule():
    """Without ties at the top-p edge the reference is the old code bit for bit (also
    where probabilities underflow, and on rows with top_p = 1), and with ties it keeps as
    many tokens."""
    gen = torch.Generator().manual_seed(14)
    for kind in ("peaked", "flat", "top_k", "padded", "ties"):
        logits, top_k, _, top_p = random_batch(gen, kind, 32, 2000)
        if kind == "flat":
            logits[:8] *= 60  # probabilities that underflow to 0
        got, want = apply_top_k_top_p_sorted(logits, top_k, top_p), old_sort_rule(logits, top_k, top_p)
        if kind == "ties":
            assert torch.equal((got > NEG_INF).sum(-1), (want > NEG_INF).sum(-1))
        else:
            assert torch.equal(got, want), kind


def test_top_k_alone_needs_no_sort(monkeypatch):
    def no_sort(*a, **kw):
        raise AssertionError("sorted")
    monkeypatch.setattr(sampler_module, "apply_top_k_top_p_sorted", no_sort)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(13))
    tokens = sample(logits, [SamplingParams(top_k=k) for k in (1, 5, 50, 999, 1000, 0, 7, 2)])
    assert tokens[0] == logits[0].argmax()
    order = logits.argsort(dim=-1, descending=True)
    for row, k in enumerate((1, 5, 50, 999, 1000, 0, 7, 2)):
        assert tokens[row] in order[row, :k or 1000].tolist()
