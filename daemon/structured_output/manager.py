"""Stage 3 of guided decoding, the scheduler's side: one `GrammarMatcher` per request
(per sample for n > 1), the bitmask rows for the requests that sample in a step, and
accepting each sampled token. Matchers live with the request: preemption (recompute)
does not touch them, abort drops them.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from llmd.structured_output.compiler import CompileJob, GrammarCompilerService
from llmd.structured_output.spec import GrammarSpec


class RequestGrammar:
    """One request's grammar: its compile job, then its matcher."""

    __slots__ = ("spec", "job", "submitted_at", "matcher", "utf8_tail")

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.job: CompileJob | None = None
        self.submitted_at = 0.0
        self.matcher = None
        self.utf8_tail = b""  # the output's incomplete last character (see Utf8Guard)

    @property
    def ready(self) -> bool:
        return self.matcher is not None


class StructuredOutputManager:
    """The scheduler's view: start compiles, make matchers, fill bitmasks, accept tokens."""

    def __init__(self, service: GrammarCompilerService, max_rows: int) -> None:
        self.service = service
        self.vocab_size = service.vocab_size
        self.max_rows = max_rows
        self._bitmask = None  # allocated at the first guided step (xgrammar imports lazily)
        self.fill_seconds = 0.0  # total time spent filling masks (for benchmarks)

    def start(self, grammar: RequestGrammar) -> None:
        grammar.submitted_at = time.monotonic()
        grammar.job = self.service.submit(grammar.spec)

    def poll(self, grammar: RequestGrammar, stop_token_ids: list[int], now: float) -> bool:
        """True once the grammar is compiled and the matcher made; raises GrammarError."""
        compiled = self.service.check(grammar.job, grammar.submitted_at, now)
        if compiled is None:
            return False
        import xgrammar as xgr

        grammar.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        return True

    @staticmethod
    def wait(grammars: list[RequestGrammar], deadline: float | None) -> None:
        """Block until one of these grammars' compiles ends, or the deadline (at most a
        second): for an offline engine that has nothing else to run meanwhile."""
        pending = [g.job.future for g in grammars if not g.job.future.done()]
        if len(pending) < len(grammars):
            return
        timeout = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()) + 0.001)
        wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def next_deadline(self, grammars: list[RequestGrammar]) -> float | None:
        """When the first of these requests runs out of time to wait for its grammar."""
        return min((g.submitted_at + self.service.timeout_s for g in grammars), default=None)

    def fill_bitmask(self, grammars: list[RequestGrammar | None], drafts: list[list[int]]) -> bytes:
        """Rows of allowed-token bits (int32 words, bit i of word j = token 32*j + i): per
        grammar, in order, one row for each position it samples at: 1 + its drafts (the
        row after drafts[:i] is filled with drafts[:i] accepted, then rolled back). A
        None grammar gets rows that allow every token."""
        start = time.perf_counter()
        n = sum(1 + len(d) for d in drafts)
        if self._bitmask is None or n > self._bitmask.shape[0]:
            import xgrammar as xgr
            self._bitmask = xgr.allocate_token_bitmask(max(n, self.max_rows), self.vocab_size)
        rows = self._bitmask.numpy()
        guard = self.service.utf8_guard
        row = 0
        for grammar, request_drafts in zip(grammars, drafts):
            if grammar is None:  # a finished request's row (its token is dropped): anything
                rows[row:row + 1 + len(request_drafts)] = -1
                row += 1 + len(request_drafts)
                continue
            matcher, tail = grammar.matcher, grammar.utf8_tail
            for i in range(len(request_drafts) + 1):
                if i:
                    matcher.accept_token(request_drafts[i - 1])  # validated when proposed
                    tail = guard.advance(tail, request_drafts[i - 1]) or b""
                matcher.fill_next_token_bitmask(self._bitmask, row)
                guarded = rows[row] & guard.mask(tail)
                if guarded.any():  # never leave a row empty: the grammar has the last word
                    rows[row] = guarded
                row += 1
            if request_drafts:
                matcher.rollback(len(request_drafts))
        data = rows[:n].tobytes()
        self.fill_seconds += time.perf_counter() - start
        return data

    def validate_drafts(self, grammar: RequestGrammar, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar (and UTF-8) allows from here, short
        of a token that would end the grammar (that one is left to be sampled: a row after
        it could not be masked); the matcher ends where it started."""
        guard = self.service.utf8_guard
        matcher = grammar.matcher
        tail, valid = grammar.utf8_tail, []
        for token in drafts:
            tail = guard.advance(tail, token)
            if tail is None or not matcher.accept_token(token):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            valid.append(token)
        if valid:
            grammar.matcher.rollback(len(valid))
        return valid

    def accept(self, grammar: RequestGrammar, token_id: int) -> bool:
        grammar.utf8_tail = self.service.utf8_guard.advance(grammar.utf8_tail, token_id) or b""
        return grammar.matcher.accept_token(token_id)

    @staticmethod
    def is_terminated(grammar: RequestGrammar) -> bool:
        return grammar.matcher.is_terminated()

    def shutdown(self) -> None:
        self.service.shutdown()
