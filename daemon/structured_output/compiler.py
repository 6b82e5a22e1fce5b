"""Stage 2 of guided decoding: compiling a parsed spec against the model's vocabulary in
a small thread pool (xgrammar releases the GIL), once per distinct spec (a cache keyed by
the canonical spec, bounded by the compiled grammars' measured size). A compile that runs
longer than the time limit fails its requests, and the spec is remembered as failed so
it is not compiled again.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from llmd.structured_output.spec import GrammarError, GrammarSpec, clean_error
from llmd.structured_output.utf8_guard import Utf8Guard

logger = logging.getLogger("llmd.guided")

# Compiled grammars kept for reuse (by their measured size).
CACHE_LIMIT_BYTES = 256 << 20


class CompileJob:
    """One compile of one spec; shared by every request with the same spec."""

    __slots__ = ("future", "started_at", "timed_out")

    def __init__(self) -> None:
        self.future: Future = Future()
        self.started_at: float | None = None
        self.timed_out = False


class GrammarCompilerService:
    """Compiles specs against the model's vocabulary in a thread pool, one job per
    distinct spec. `vocab_size` is the logit width (the padded tail is never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 timeout_s: float, max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="llmd-grammar")
        self._jobs: OrderedDict[str, CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.utf8_guard: Utf8Guard | None = None  # made with the compiler
        self._compiler_lock = threading.Lock()
        self.on_done: Callable[[], None] | None = None  # called (from a pool thread) after each job
        # Seconds of each finished compile, for metrics. Bounded: the offline engine never
        # reads it. deque's append and popleft are safe across threads.
        self.compile_times: collections.deque[float] = collections.deque(maxlen=1024)

    def submit(self, spec: GrammarSpec) -> CompileJob:
        with self._lock:
            job = self._jobs.get(spec.key)
            if job is not None:
                self._jobs.move_to_end(spec.key)
                return job
            job = self._jobs[spec.key] = CompileJob()
        self._pool.submit(self._run, job, spec)
        return job

    def drain_compile_times(self) -> list[float]:
        """The compile times recorded since the last call."""
        times = []
        while True:
            try:
                times.append(self.compile_times.popleft())
            except IndexError:
                return times

    def _run(self, job: CompileJob, spec: GrammarSpec) -> None:
        job.started_at = time.monotonic()
        try:
            compiled = self._get_compiler().compile_grammar(spec.grammar)
        except Exception as exc:  # the spec parsed but did not compile: its requests fail
            job.future.set_exception(GrammarError(f"guided.{spec.kind} did not compile: {clean_error(exc)}"))
        else:
            elapsed = time.monotonic() - job.started_at
            self.compile_times.append(elapsed)
            if job.timed_out:
                logger.warning("a grammar compile finished after its time limit (%.1f s)", elapsed)
            job.future.set_result(compiled)
            self._evict()
        if self.on_done is not None:
            self.on_done()

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self.utf8_guard = Utf8Guard(info.decoded_vocab, (self.vocab_size + 31) // 32)
                self.utf8_guard.mask(b"")  # the common row, computed off the engine thread
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _evict(self) -> None:
        with self._lock:
            total = 0
            for key in reversed(list(self._jobs)):
                job = self._jobs[key]
                if not job.future.done() or job.future.exception() is not None:
                    continue
                total += job.future.result().memory_size_bytes
                if total > CACHE_LIMIT_BYTES:
                    del self._jobs[key]

    def check(self, job: CompileJob, submitted_at: float, now: float) -> Any | None:
        """The compiled grammar, or None while compiling; raises GrammarError if the job
        failed, or the request has waited longer than the time limit."""
        if job.future.done():
            return job.future.result()
        if job.started_at is not None and now - job.started_at > self.timeout_s:
            job.timed_out = True  # the thread runs on; requests for this spec fail at once
        if job.timed_out or now - submitted_at > self.timeout_s:
            raise GrammarError(f"guided decoding grammar did not compile within {self.timeout_s:g} s")
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
