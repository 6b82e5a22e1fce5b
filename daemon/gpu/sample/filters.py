"""Top-k, top-p and min-p filters for the sampler (logits in, masked logits out).

Top-p is exact by the sort rule (keep the most likely tokens until their mass reaches
top_p, ties at the edge broken towards lower ids) but usually avoids the full sort:
growing top-k windows settle rows whose nucleus is narrow, and only wide rows pay for
the sort (see apply_top_k_top_p).
"""
from __future__ import annotations

import torch

# Widths of the window that top-p looks through (see apply_top_k_top_p): a row whose nucleus
# and the ties at its edge fit in the first costs a topk of that width instead of a sort of
# the vocab; wider nuclei grow it, and nuclei wider than the last fall back to the sort.
_TOP_P_WINDOWS = (64, 256, 1024)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks (to -inf) all but each row's top_k largest logits and then all but the
    smallest set of the most likely tokens whose mass reaches top_p (at least one token).
    Ties at the k-th value are kept; among tokens tied at the top-p edge the lower ids are
    kept. Rows with top_p = 1 get no top-p filter (the sort-based rule also drops the
    tokens whose probability underflows to 0: neither can be drawn).

    Without top-p, a partial topk replaces the full sort. With it, the result is the
    sort-based rule's (`apply_top_k_top_p_sorted`; its float32 running sum and the float64
    one here can only differ where top_p lies within rounding of a row's cumulative mass)
    but is found in the top-W window of each row (W = 64, or max_top_k when larger): with
    the probabilities taken once over the row, a row is settled when the window's mass
    reaches top_p and the ties at the edge end inside it. Open rows go on to a wider window
    (256, 1024) or, wider than every window, to the sort; a histogram of their logits picks
    which. Host syncs: one when the first window settles every row (the common case); else
    one more for the histogram and one per further window round."""
    vocab = logits.shape[-1]
    if top_p is None:
        return _apply_top_k(logits, top_k, max_top_k)
    if logits.shape[0] == 0 or vocab == 0:
        return logits.clone()
    if logits.is_cuda:
        # A GPU sorts a batch of rows faster than the host can learn which rows a window
        # settled: the sort rule keeps the step free of host syncs.
        return apply_top_k_top_p_sorted(logits, top_k, top_p)
    return _apply_top_k_top_p_windowed(logits, top_k, max_top_k, top_p)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k alone: the k-th value from a partial topk, no sort."""
    neg_inf = float("-inf")
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1))
    kth = kth.masked_fill(top_k >= logits.shape[-1], neg_inf)
    return logits.masked_fill(logits < kth, neg_inf)


def _apply_top_k_top_p_windowed(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                                top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p on a non-empty batch through the windows: the first window
    (W = 64, or max_top_k when larger) also gives top-k's threshold; the rows it leaves
    open go through the wider rounds (_settle_open_rows)."""
    neg_inf = float("-inf")
    num_rows, vocab = logits.shape
    device = logits.device
    width = min(vocab, max(_TOP_P_WINDOWS[0], max_top_k))
    values, ids = logits.topk(width, dim=-1)
    if top_k is not None:
        kth = values.gather(1, top_k.clamp(max=width) - 1).masked_fill(top_k >= vocab, neg_inf)
        kept = logits.masked_fill(logits < kth, neg_inf)
    else:
        kth = torch.full((num_rows, 1), neg_inf, dtype=logits.dtype, device=device)
        kept = logits
    # The probabilities as the sort-based rule has them, and their total in float64, so that
    # the mass below a token (total - mass above it) is as exact as that rule's sum.
    probs = kept.softmax(dim=-1)
    total = probs.sum(dim=-1, keepdim=True, dtype=torch.float64)
    stats = (kth, probs, total, 1 - top_p)
    # Row i keeps the logits >= threshold[i] but those its tie_drop marks in its window.
    threshold, tie_drop, open_rows = _top_p_window(values, ids, stats, vocab)
    filtered = top_p < 1.0
    threshold = torch.where(filtered, threshold, kth)
    windows = [(torch.arange(num_rows, device=device), ids, tie_drop & filtered)]
    open_rows = open_rows.masked_fill(~filtered.view(-1), 0)
    sorted_rows = _settle_open_rows(logits, kept, stats, open_rows, width, threshold, windows)
    if len(sorted_rows) == num_rows:
        return apply_top_k_top_p_sorted(logits, top_k, top_p)
    out = logits.masked_fill(logits < threshold, neg_inf)
    for index, ids, tie_drop in windows:
        position = (index.view(-1, 1), ids)
        out.index_put_(position, out[position].masked_fill_(tie_drop, neg_inf))
    if sorted_rows:
        index = torch.tensor(sorted_rows, dtype=torch.int64).to(device, non_blocking=True)
        out.index_copy_(0, index, apply_top_k_top_p_sorted(
            logits.index_select(0, index), None if top_k is None else top_k.index_select(0, index),
            top_p.index_select(0, index)))
    return out


def _settle_open_rows(logits: torch.Tensor, kept: torch.Tensor, stats: tuple[torch.Tensor, ...],
                      open_rows: torch.Tensor, first_width: int, threshold: torch.Tensor,
                      windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[int]:
    """The window rounds after the first: `open_rows` [num_rows] is 0 where the first
    window settled the row, else a lower bound on the width that could. Each round sends
    the open rows to the narrowest window that may hold their nucleus and writes the rows
    it settles into `threshold` and `windows`. Returns the rows wider than every window,
    left for the sort."""
    num_rows, vocab = logits.shape
    device = logits.device
    sizes = sorted({min(w, vocab) for w in _TOP_P_WINDOWS})
    rows = list(range(num_rows))  # the rows `open_rows` describes
    sorted_rows: list[int] = []
    first_round = True
    while True:
        needed = open_rows.tolist()  # the host sync of this round
        pending = [(row, need, need) for row, need in zip(rows, needed) if need]
        if not pending:
            break
        if first_round and first_width < sizes[-1]:
            # A histogram of the open rows bounds their nuclei from both sides (one more
            # sync), so that rows no window could hold go to the sort without a window round.
            select = _row_selector([row for row, _, _ in pending], num_rows, device)
            bounds = _nucleus_bounds(*map(select, (kept, stats[1], stats[2], stats[3])))
            pending = [(row, max(need, lower), max(need, upper + 1))
                       for (row, need, _), (lower, upper) in zip(pending, bounds.tolist())]
        first_round = False
        groups: dict[int, list[int]] = {}
        for row, lower, upper in pending:
            if lower > sizes[-1]:
                sorted_rows.append(row)
            else:
                groups.setdefault(next(w for w in sizes if w >= min(upper, sizes[-1])), []).append(row)
        rows, open_parts = [], []
        for width, group in groups.items():
            open_parts.append(_window_round(logits, stats, group, width, threshold, windows))
            rows += group
        if not rows:
            break
        open_rows = torch.cat(open_parts)
    return sorted_rows


def _window_round(logits: torch.Tensor, stats: tuple[torch.Tensor, ...], group: list[int], width: int,
                  threshold: torch.Tensor, windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                  ) -> torch.Tensor:
    """Top-p in a window of `width` for the rows `group`: their threshold and tie_drop
    are written into `threshold` and `windows`; returns what _top_p_window says of which
    rows it left open."""
    num_rows, vocab = logits.shape
    select = _row_selector(group, num_rows, logits.device)
    index = select(torch.arange(num_rows, device=logits.device))
    values, ids = select(logits).topk(width, dim=-1)
    sub_threshold, tie_drop, open_part = _top_p_window(values, ids, tuple(map(select, stats)), vocab)
    threshold.index_copy_(0, index, sub_threshold)
    windows.append((index, ids, tie_drop))
    return open_part


def _row_selector(rows: list[int], num_rows: int, device: torch.device):
    """t -> t[rows] (along dim 0), without a copy when rows are all the rows in order."""
    if rows == list(range(num_rows)):
        return lambda t: t
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    return lambda t: t.index_select(0, index)


def _top_p_window(values: torch.Tensor, ids: torch.Tensor, stats: tuple[torch.Tensor, ...],
                  vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p in a window: `values`/`ids` [n, W] are each row's W largest logits in
    descending order; `stats`: the top-k threshold [n, 1], the probabilities [n, V] of the
    logits top-k keeps, their total [n, 1] (float64) and 1 - top_p [n, 1]. Returns, for the
    rows the window settles, the threshold [n, 1] and tie_drop [n, W] (the window's tokens
    at the threshold past those kept), and [n]: 0 where the window settles the row, else a
    lower bound on the width that could."""
    kth, probs, total, one_minus_p = stats
    width = values.shape[-1]
    values = values.masked_fill(values < kth, float("-inf"))
    probs = probs.gather(1, ids)
    # The mass of each token and all below it, as the sort-based rule sums it.
    tail = total - probs.double().cumsum(dim=-1)  # [:, i]: of the tokens past i
    # That rule drops the tokens whose mass with all below it stays within 1 - top_p, but
    # keeps the first: the first token, and each next one with p > 0 and a larger tail.
    count = ((tail[:, :-1] > one_minus_p) & (probs[:, 1:] > 0)).sum(dim=-1, keepdim=True) + 1
    threshold = values.gather(1, count - 1)
    # Of the tokens tied at the threshold, the count - above with the lowest ids are kept.
    tied = values == threshold
    above = (values > threshold).sum(dim=-1, keepdim=True)
    last_id = torch.where(tied, ids, vocab).sort(dim=-1).values.gather(1, count - above - 1)
    tie_drop = tied & (ids > last_id)
    if width == vocab:
        return threshold, tie_drop, torch.zeros(values.shape[0], dtype=torch.int64, device=values.device)
    last_p, last_tail = probs[:, -1:], tail[:, -1:]
    settled = ((last_tail <= one_minus_p) | (last_p == 0)) & (values[:, -1:] < threshold)
    # Every token past the window has p <= last_p: at least this many more are needed.
    more = (last_tail - one_minus_p).clamp(min=0) / last_p.clamp(min=torch.finfo(probs.dtype).tiny)
    more = more.ceil().clamp(min=1, max=vocab).long()
    return threshold, tie_drop & settled, torch.where(settled, 0, width + more).view(-1)


def _nucleus_bounds(kept: torch.Tensor, probs: torch.Tensor, total: torch.Tensor,
                    one_minus_p: torch.Tensor, bins: int = 32, step: float = 0.5) -> torch.Tensor:
    """[n, 2]: a lower and an upper bound on the number of tokens top-p keeps in each row,
    from a histogram of its logits (`kept`, probabilities `probs`) in bins `step` wide below
    its max (the last bin takes the rest). Float rounding can make them off by a token or
    so: they only choose the window, which checks itself."""
    bin_of = (kept.amax(dim=-1, keepdim=True) - kept).div_(step).floor_().clamp_(max=bins - 1).long()
    counts = probs.new_zeros(probs.shape[0], bins).scatter_add_(1, bin_of, torch.ones_like(probs))
    mass = probs.new_zeros(probs.shape[0], bins).scatter_add_(1, bin_of, probs)
    counts, tail = counts.cumsum(dim=-1), total - mass.cumsum(dim=-1)
    last = (tail[:, :-1] > one_minus_p).sum(dim=-1, keepdim=True)  # the bin the nucleus ends in
    lower = counts.gather(1, (last - 1).clamp(min=0)).masked_fill(last == 0, 0) + 1
    return torch.cat([lower, counts.gather(1, last)], dim=1).long()


def apply_top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                              top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p by a full sort: the reference rule, and the fallback for rows
    whose nucleus is wider than every window."""
    neg_inf = float("-inf")
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1).values  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, vocab - top_k)
        sorted_logits.masked_fill_(sorted_logits < kth, neg_inf)
    # Drop the least likely tokens while the mass dropped stays within 1 - top_p.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    # The sums do not depend on how the sort ordered equal logits, so neither does the
    # number kept; which of the tokens tied at the edge are kept does: the lowest ids.
    keep = vocab - drop.sum(dim=-1, keepdim=True)
    threshold = sorted_logits.gather(1, vocab - keep)
    drop = logits < threshold
    tied = logits == threshold
    tied_kept = keep - (vocab - drop.sum(dim=-1, keepdim=True) - tied.sum(dim=-1, keepdim=True))
    drop |= tied.logical_and_(tied.cumsum(dim=-1, dtype=torch.int32) > tied_kept)
    return logits.masked_fill(drop, neg_inf)


def apply_min_p(logits: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Keeps tokens with p >= min_p * p_max, i.e. logit >= max logit + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    return logits.masked_fill(logits < threshold, float("-inf"))
