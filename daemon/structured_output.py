"""Guided decoding with xgrammar: specs are checked when a request arrives, compiled
off the engine thread, and turned into one bitmask row per sampling request per step.

Three stages, each with its own failure mode:

1. `parse_guided` (intake, per request): the spec becomes an `xgrammar.Grammar`. Syntax
   errors, oversized or too deeply nested specs, and grammars that can never complete
   (`root ::= root`, a required property that refers back to its own schema) are
   rejected here with a ValueError naming what is wrong. No tokenizer is needed.
2. `GrammarCompilerService` (a small thread pool; xgrammar releases the GIL): compiles
   the grammar against the model's vocabulary, once per distinct spec (a cache keyed by
   the canonical spec). A compile that runs longer than the time limit fails its
   requests, and the spec is remembered as failed so it is not compiled again.
3. `StructuredOutputManager` (the scheduler's side): one `GrammarMatcher` per request
   (per sample for n > 1), the bitmask rows for the requests that sample in a step, and
   accepting each sampled token. Matchers live with the request: preemption (recompute)
   does not touch them, abort drops them.
"""
from __future__ import annotations

import codecs
import collections
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable

from llmd_client.protocol import MAX_GUIDED_SPEC_BYTES, GuidedDecodingParams

logger = logging.getLogger("llmd.guided")

# A JSON schema document may nest this deep (objects and arrays, counted as JSON
# levels). Conversion time grows fast with depth: 64 levels (32 nested objects) take
# ~10 ms, 400 levels ~2 s.
MAX_SCHEMA_DEPTH = 64
# "any" whitespace: the longest run of whitespace the model may emit at one place.
MAX_WHITESPACE_RUN = 16
# Compiled grammars kept for reuse (by their measured size).
CACHE_LIMIT_BYTES = 256 << 20


class GrammarError(ValueError):
    """A guided-decoding spec that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    """A parsed spec: `key` is its canonical text (the compile cache key)."""

    kind: str
    key: str
    grammar: Any  # xgrammar.Grammar


def parse_guided(guided: GuidedDecodingParams) -> GrammarSpec:
    """Check and parse a spec. Raises GrammarError with a message that names the field
    and the problem (xgrammar's own parse errors keep their line and column)."""
    import xgrammar as xgr

    kind = guided.kind
    field = f"guided.{kind}"
    if kind in ("json_schema", "json_object"):
        schema = _load_schema(guided.json_schema) if kind == "json_schema" else {"type": "object"}
        schema = _lengths_as_patterns(schema)
        # Key order is kept: xgrammar emits properties in the order the schema lists them.
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) > MAX_GUIDED_SPEC_BYTES:
            raise GrammarError(f"{field} must have at most {MAX_GUIDED_SPEC_BYTES} bytes")
        options: dict[str, Any] = {"any_whitespace": guided.whitespace == "any"}
        if guided.whitespace == "any":
            options["max_whitespace_cnt"] = MAX_WHITESPACE_RUN
        elif guided.whitespace == "pretty":
            options["indent"] = 2
        grammar = _xgrammar_call(field, xgr.Grammar.from_json_schema, text, **options)
        key = f"json:{guided.whitespace}:{text}"
    elif kind == "regex":
        grammar = _xgrammar_call(field, xgr.Grammar.from_regex, guided.regex)
        key = f"regex:{guided.regex}"
    elif kind == "choice":
        # JSON string literals are EBNF string literals (quotes, backslashes and control
        # characters escaped; everything else kept as is).
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in guided.choice)
        grammar = _xgrammar_call(field, xgr.Grammar.from_ebnf, ebnf)
        key = f"choice:{json.dumps(guided.choice, ensure_ascii=False)}"
    else:
        grammar = _xgrammar_call(field, xgr.Grammar.from_ebnf, guided.grammar)
        key = f"ebnf:{guided.grammar}"
    if not _can_complete(grammar):
        raise GrammarError(f"{field} can never complete: no finite output satisfies it "
                           "(a rule or a required part always refers back to itself)")
    return GrammarSpec(kind, key, grammar)


def _load_schema(schema: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"guided.json_schema is not valid JSON ({exc.msg} at line {exc.lineno}, "
                               f"column {exc.colno})") from None
    if not isinstance(schema, dict):
        raise GrammarError("guided.json_schema must be a JSON object")
    depth = _json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"guided.json_schema nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    return schema


def _json_depth(value: Any) -> int:
    """Nesting depth of a JSON document, without recursion (a hostile one may be deep)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _lengths_as_patterns(schema: Any) -> Any:
    """String length limits rewritten as an equivalent `pattern` where the schema has none.

    xgrammar's minLength/maxLength grammar admits raw control characters (invalid JSON)
    and its masks are slow to fill; its pattern grammar admits plain characters only, and
    any string of those with the right length satisfies the original schema."""
    if isinstance(schema, list):
        return [_lengths_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _lengths_as_patterns(v) for k, v in schema.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    if (out.get("type") == "string" and "pattern" not in out and "format" not in out
            and (lo is not None or hi is not None)
            and all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi))):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^.{{{lo or 0},{'' if hi is None else hi}}}$"
    return out


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def _xgrammar_call(field: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"{field} is invalid: {_clean_error(exc)}") from None


def _clean_error(exc: BaseException) -> str:
    """xgrammar's message without its timestamp, source location or echo of the input."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _CHECK_FAILED.sub("", _XGRAMMAR_PREFIX.sub("", text))
    for marker in (". The JSON string is", "The JSON string is"):
        text = text.split(marker)[0]
    return text.strip()[:200] or "not accepted by the grammar parser"


# xgrammar's serialized grammar (format v16): each expression is [type, size, payload...].
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 0, 1, 2, 3, 4, 5, 6, 8


def _can_complete(grammar: Any) -> bool:
    """Whether the root rule derives at least one finite string (the classic
    "productive symbols" fixpoint). A grammar that fails this would let a request run
    to max_tokens without ever producing valid output. Unknown formats or expression
    kinds count as productive: this check only ever rejects what is certainly endless."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != "v16":
        return True
    flat, starts, rules = data["grammar_expr_data"], data["grammar_expr_indptr"], data["rules"]
    bounds = list(zip(starts, starts[1:] + [len(flat)]))
    productive = [False] * len(rules)

    def derives(expr_id: int) -> bool:
        lo, hi = bounds[expr_id]
        kind, payload = flat[lo], flat[lo + 2:hi]
        if kind in (_BYTES, _CLASS, _CLASS_STAR, _EMPTY):
            return True
        if kind == _RULE_REF:
            return productive[payload[0]]
        if kind == _SEQUENCE:
            return all(derives(e) for e in payload)
        if kind == _CHOICES:
            return any(derives(e) for e in payload)
        if kind == _REPEAT:
            return payload[1] == 0 or productive[payload[0]]
        return True

    changed = True
    while changed:
        changed = False
        for index, rule in enumerate(rules):
            if not productive[index] and derives(rule[1]):
                productive[index] = changed = True
    return productive[data["root_rule_id"]]


class Utf8Guard:
    """Keeps guided output valid UTF-8.

    xgrammar checks characters on a lenient UTF-8 decoding: a lead byte followed by the
    right number of continuation bytes passes even when it is an overlong form (E0 9A 9C)
    or an encoded surrogate (ED B5 BD). With byte-level tokens a model can spell those,
    and the text then decodes to U+FFFD: a JSON string longer than its maxLength, a
    choice that is not one. This guard ANDs each bitmask row with the tokens that keep
    the output's bytes a valid UTF-8 prefix (Python's strict decoder is the judge), given
    the incomplete character at the end of the output so far ("tail", 0-3 bytes)."""

    CACHE_SIZE = 1024

    def __init__(self, token_bytes: list[bytes], words_per_row: int) -> None:
        import numpy as np

        self.token_bytes = token_bytes
        self.words = words_per_row
        # After a complete character every token is judged; after an incomplete one only
        # tokens that start with a continuation byte (or have no bytes) can be valid.
        self._continuing = [i for i, b in enumerate(token_bytes) if not b or 0x80 <= b[0] < 0xC0]
        self._masks: OrderedDict[bytes, Any] = OrderedDict()
        self._np = np

    def mask(self, tail: bytes):
        """[words] int32: bit set where the token keeps `tail` + token valid UTF-8."""
        mask = self._masks.get(tail)
        if mask is not None:
            self._masks.move_to_end(tail)
            return mask
        np = self._np
        allowed = np.zeros(self.words * 32, dtype=bool)
        candidates = range(len(self.token_bytes)) if not tail else self._continuing
        for i in candidates:
            data = self.token_bytes[i]
            allowed[i] = not data or _utf8_tail(tail + data) is not None
        mask = np.packbits(allowed, bitorder="little").view("<i4")
        self._masks[tail] = mask
        if len(self._masks) > self.CACHE_SIZE:
            self._masks.popitem(last=False)
        return mask

    def advance(self, tail: bytes, token_id: int) -> bytes | None:
        """The tail after `token_id`, or None if the token would break UTF-8."""
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        return _utf8_tail(tail + data)


def _utf8_tail(data: bytes) -> bytes | None:
    """None if `data` is not a valid UTF-8 prefix; else its incomplete last character."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    return decoder.getstate()[0]


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
            job.future.set_exception(GrammarError(f"guided.{spec.kind} did not compile: {_clean_error(exc)}"))
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
