"""Stage 3 of guided decoding, the scheduler's side: one `GrammarMatcher` per request
(per sample for n > 1), the bitmask rows for the requests that sample in a step (filled
while the step runs: bitmask_filler.py), and accepting each sampled token. Matchers live
with the request: preemption (recompute) does not touch them, abort drops them.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from llmd.core.step_messages import GrammarRows
from llmd.structured_output.bitmask_filler import BitmaskFiller, RowGroup
from llmd.structured_output.compiler import CompileJob, GrammarCompilerService
from llmd.structured_output.spec import GrammarError, GrammarSpec

logger = logging.getLogger("llmd.structured_output")


class RequestGrammar:
    """One request's grammar: its compile job, then its matcher."""

    __slots__ = ("spec", "job", "submitted_at", "matcher", "utf8_tail", "fill_error")

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.job: CompileJob | None = None
        self.submitted_at = 0.0
        self.matcher = None
        self.utf8_tail = b""  # the output's incomplete last character (see Utf8Guard)
        # Why the matcher could not fill its bitmask rows (an xgrammar failure, not bad
        # input): the token sampled from rows that allowed everything is then refused.
        self.fill_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def set_fill_error(self, message: str) -> None:
        self.fill_error = message


class StructuredOutputManager:
    """The scheduler's view: start compiles, make matchers, fill bitmasks, accept tokens."""

    def __init__(self, service: GrammarCompilerService, fill_beside_forward: bool = True) -> None:
        """`fill_beside_forward`: fill each step's rows while its forward runs (see
        bitmask_filler.py for when that pays), else before the step is launched."""
        self.service = service
        self.vocab_size = service.vocab_size
        self.filler = BitmaskFiller((self.vocab_size + 31) // 32, lambda: service.utf8_guard,
                                    beside_forward=fill_beside_forward)

    @property
    def fill_seconds(self) -> float:
        """Total time spent filling bitmask rows (on the filler's thread)."""
        return self.filler.fill_seconds

    @property
    def wait_seconds(self) -> float:
        """Total time sampling waited for rows still being filled (the rest overlapped)."""
        return self.filler.wait_seconds

    def start(self, grammar: RequestGrammar) -> None:
        grammar.submitted_at = time.monotonic()
        grammar.job = self.service.submit(grammar.spec)

    def poll(self, grammar: RequestGrammar, stop_token_ids: list[int], now: float) -> bool:
        """True once the grammar is compiled and the matcher made; raises GrammarError,
        for a failure of any type (xgrammar's matcher raised RuntimeError on a stop id
        outside the vocabulary, and only ValueError failed the request alone)."""
        compiled = self.service.check(grammar.job, grammar.submitted_at, now)
        if compiled is None:
            return False
        import xgrammar as xgr

        try:
            grammar.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        except Exception as exc:
            logger.warning("a grammar matcher failed to start (%s); its request ends with an error",
                           type(exc).__name__)
            raise GrammarError(f"guided decoding could not start for this request ({type(exc).__name__})") from exc
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

    def fill_bitmask(self, grammars: list[RequestGrammar | None], drafts: list[list[int]]) -> GrammarRows:
        """Start filling a step's grammar rows (on the filler's thread, or at once): the
        step can be handed to the executor at once, with these rows to wait for. Per
        grammar, in order, one row for each position it samples at: 1 + its drafts. A
        None grammar (its request finished) gets rows that allow every token. The
        matchers and tails are read now, when the scheduler holds them."""
        groups = [RowGroup(None, b"", list(d)) if g is None
                  else RowGroup(g.matcher, g.utf8_tail, list(d), g.set_fill_error)
                  for g, d in zip(grammars, drafts)]
        future = self.filler.submit(groups)
        return GrammarRows(lambda: self.filler.wait(future))

    def validate_drafts(self, grammar: RequestGrammar, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar (and UTF-8) allows from here, short
        of a token that would end the grammar (a row after it could not be masked); the
        matcher ends where it started."""
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
        """Advance the matcher by a sampled token; False if the grammar refuses it (or its
        rows could not be filled, so nothing held the token to the grammar)."""
        if grammar.fill_error is not None:
            return False
        grammar.utf8_tail = self.service.utf8_guard.advance(grammar.utf8_tail, token_id) or b""
        return grammar.matcher.accept_token(token_id)

    @staticmethod
    def is_terminated(grammar: RequestGrammar) -> bool:
        return grammar.matcher.is_terminated()

    def shutdown(self) -> None:
        self.service.shutdown()
        self.filler.shutdown()
