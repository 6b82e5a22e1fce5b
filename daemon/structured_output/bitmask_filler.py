"""Filling a step's grammar bitmask rows off the engine thread, while the step's forward
runs: the forward does not need the rows, only sampling does, so the scheduler hands the
step to the executor at once and whoever samples waits for the rows just before sampling
(GrammarRows.wait). xgrammar releases the GIL while it fills, so the
fill really runs beside the forward.

That pays where the host is idle while the device computes (a GPU). When the model runs
on the CPU its threads hold the cores the fill would need: the hand-off cost more than
the fraction of a millisecond it hid (docs/benchmarks.md), so there the rows are filled
in the scheduler's thread before the step is launched (`beside_forward=False`).

One thread fills, one step after another (a step's rows never depend on a later step's),
and never waits for anything but xgrammar: a step cannot be blocked by the engine thread
it runs beside. Each fill is one batched xgrammar call per verified position
(`BatchGrammarMatcher`, on xgrammar's own thread pool) and a few whole-array operations
for the UTF-8 guard: no per-row Python but the bookkeeping of drafts.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("llmd.guided")


@dataclass
class RowGroup:
    """One request's rows in a step, taken when the step was scheduled: its matcher (None
    for a request that finished meanwhile: its rows allow everything, its token is
    dropped), the output's incomplete last character, and the drafts whose positions it
    verifies (row i is filled with drafts[:i] accepted, then rolled back). `on_error` is
    called when its matcher could not fill its rows: they then allow every token."""

    matcher: Any | None
    utf8_tail: bytes
    drafts: list[int]
    on_error: Callable[[str], None] = lambda message: None
    first_row: int = field(default=0, init=False)

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


class BitmaskFiller:
    """Fills the rows of one step at a time, on its own thread (`beside_forward`) or at
    once in the caller's; `utf8_guard()` gives the Utf8Guard (made with the grammar
    compiler, before any matcher exists)."""

    def __init__(self, words_per_row: int, utf8_guard: Callable[[], Any], *, beside_forward: bool = True,
                 max_threads: int | str = "auto") -> None:
        self.words_per_row = words_per_row
        self.beside_forward = beside_forward  # may change only while no step is in flight
        self._utf8_guard = utf8_guard
        self._max_threads = max_threads
        self._batch = None  # xgrammar.BatchGrammarMatcher, made at the first fill
        self._pool: ThreadPoolExecutor | None = None  # the fill thread, started at the first fill beside a forward
        self.fill_seconds = 0.0  # total time spent filling rows
        self.wait_seconds = 0.0  # total time samplers waited for rows not yet filled

    def submit(self, groups: list[RowGroup]) -> Future:
        """Start filling (beside_forward; else fill now); the future's result is the rows'
        bytes (int32 words, bit i of word j = token 32*j + i; the groups' rows in order).
        It never fails: a matcher that raises gets rows that allow everything, and its
        group's on_error is called."""
        if not self.beside_forward:
            future: Future = Future()
            future.set_result(self.fill(groups))
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-bitmask")
        return self._pool.submit(self.fill, groups)

    def wait(self, future: Future) -> bytes:
        """The rows of a submitted fill, counting the time spent waiting for them."""
        start = time.perf_counter()
        data = future.result()
        self.wait_seconds += time.perf_counter() - start
        return data

    def fill(self, groups: list[RowGroup]) -> bytes:
        import numpy as np

        start = time.perf_counter()
        row = 0
        for group in groups:
            group.first_row, row = row, row + group.num_rows
        rows = np.full((row, self.words_per_row), -1, dtype=np.int32)
        live = [g for g in groups if g.matcher is not None]
        try:
            self._fill_matchers(rows, live)
        except Exception:  # find the matcher that fails; the others' rows are filled alone
            live = [g for g in live if self._fill_alone(rows, g)]
        self._apply_utf8_guard(rows, live)
        self.fill_seconds += time.perf_counter() - start
        return rows.tobytes()

    def _fill_alone(self, rows, group: RowGroup) -> bool:
        """Fill one group's rows by themselves; False (rows allowing everything) if it fails."""
        try:
            self._fill_matchers(rows, [group])
            return True
        except Exception as exc:
            logger.exception("filling a grammar's bitmask failed; the request ends with an error")
            rows[group.first_row:group.first_row + group.num_rows] = -1
            group.on_error(f"{type(exc).__name__}: {exc}")
            return False

    def _fill_matchers(self, rows, groups: list[RowGroup]) -> None:
        """Round d fills row d of every group with at least d drafts, after accepting its
        d-th draft: one batched call per round. A draft the grammar refuses or that ends
        it can only be a request's last (DraftPlanner.take_drafts): the row after it, never
        used, is left allowing every token. The matchers end where they started."""
        if not groups:
            return
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(self._max_threads)
        accepted = [0] * len(groups)
        ended: set[int] = set()
        try:
            for depth in range(1 + max(len(g.drafts) for g in groups)):
                at = [i for i, g in enumerate(groups) if len(g.drafts) >= depth and i not in ended]
                if depth:
                    ok = xgr.BatchGrammarMatcher.batch_accept_token(
                        [groups[i].matcher for i in at], [groups[i].drafts[depth - 1] for i in at])
                    for i, taken in zip(at, ok):
                        accepted[i] += taken
                        if not taken or groups[i].matcher.is_terminated():
                            ended.add(i)
                    at = [i for i in at if i not in ended]
                if at:
                    self._batch.batch_fill_next_token_bitmask(
                        [groups[i].matcher for i in at], rows, [groups[i].first_row + depth for i in at])
        finally:
            back = [i for i, n in enumerate(accepted) if n]
            if back:
                xgr.BatchGrammarMatcher.batch_rollback([groups[i].matcher for i in back], [accepted[i] for i in back])

    def _apply_utf8_guard(self, rows, groups: list[RowGroup]) -> None:
        """AND each guided row with the tokens that keep the output valid UTF-8 after its
        tail (Utf8Guard), rows with the same tail at once, except where that would leave a
        row empty: the grammar has the last word."""
        import numpy as np

        guard = self._utf8_guard()
        by_tail: dict[bytes, list[int]] = {}
        for group in groups:
            tail = group.utf8_tail
            for i in range(group.num_rows):
                if i:
                    tail = guard.advance(tail, group.drafts[i - 1]) or b""
                by_tail.setdefault(tail, []).append(group.first_row + i)
        for tail, indices in by_tail.items():
            index = np.asarray(indices)
            guarded = rows[index] & guard.mask(tail)
            keep = guarded.any(axis=1)
            rows[index[keep]] = guarded[keep]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
