"""Guided decoding with xgrammar: specs are checked when a request arrives, compiled
off the engine thread, and turned into one bitmask row per sampling request per step.

Three stages, each with its own failure mode and its own module:

1. `parse_guided` (spec.py; intake, per request): the spec becomes an `xgrammar.Grammar`.
   Syntax errors, oversized or too deeply nested specs, and grammars that can never
   complete (`root ::= root`, a required property that refers back to its own schema)
   are rejected here with a ValueError naming what is wrong. No tokenizer is needed.
2. `GrammarCompilerService` (compiler.py; a small thread pool, xgrammar releases the
   GIL): compiles the grammar against the model's vocabulary, once per distinct spec (a
   cache keyed by the canonical spec). A compile that runs longer than the time limit
   fails its requests, and the spec is remembered as failed so it is not compiled again.
3. `StructuredOutputManager` (manager.py; the scheduler's side): one `GrammarMatcher` per
   request (per sample for n > 1), the bitmask rows for the requests that sample in a
   step, and accepting each sampled token. Matchers live with the request: preemption
   (recompute) does not touch them, abort drops them. The rows are filled by
   `BitmaskFiller` (bitmask_filler.py) on its own thread, in batched xgrammar calls,
   while the step's forward runs: only sampling waits for them.

`Utf8Guard` (utf8_guard.py) narrows every bitmask row to the tokens that keep the output
valid UTF-8, which xgrammar's lenient decoding alone does not.
"""
from llmd.structured_output.compiler import GrammarCompilerService
from llmd.structured_output.manager import RequestGrammar, StructuredOutputManager
from llmd.structured_output.spec import GrammarError, GrammarSpec, parse_guided

__all__ = ["GrammarCompilerService", "GrammarError", "GrammarSpec", "RequestGrammar",
           "StructuredOutputManager", "parse_guided"]
