"""Stage 1 of guided decoding (intake, per request): a spec becomes an `xgrammar.Grammar`,
or a GrammarError naming what is wrong. Syntax errors, oversized or too deeply nested
specs, and grammars that can never complete (`root ::= root`, a required property that
refers back to its own schema) are refused here. No tokenizer is needed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from llmd_client.protocol import MAX_GUIDED_SPEC_BYTES, GuidedDecodingParams

# A JSON schema document may nest this deep (objects and arrays, counted as JSON
# levels). Conversion time grows fast with depth: 64 levels (32 nested objects) take
# ~10 ms, 400 levels ~2 s.
MAX_SCHEMA_DEPTH = 64
# "any" whitespace: the longest run of whitespace the model may emit at one place.
MAX_WHITESPACE_RUN = 16


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
        schema = lengths_as_patterns(schema)
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
    elif kind == "structural_tag":
        tag = guided.structural_tag
        text = tag if isinstance(tag, str) else json.dumps(tag, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) > MAX_GUIDED_SPEC_BYTES:
            raise GrammarError(f"{field} must have at most {MAX_GUIDED_SPEC_BYTES} bytes")
        grammar = _xgrammar_call(field, xgr.Grammar.from_structural_tag, text)
        key = f"structural_tag:{text}"
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


def lengths_as_patterns(schema: Any) -> Any:
    """String length limits rewritten as an equivalent `pattern` where the schema has none.

    xgrammar's minLength/maxLength grammar admits raw control characters (invalid JSON)
    and its masks are slow to fill; its pattern grammar admits plain characters only, and
    any string of those with the right length satisfies the original schema."""
    if isinstance(schema, list):
        return [lengths_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: lengths_as_patterns(v) for k, v in schema.items()}
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
        raise GrammarError(f"{field} is invalid: {clean_error(exc)}") from None


def clean_error(exc: BaseException) -> str:
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
    kinds count as productive: this check only ever rejects what is certainly endless.

    Linear in the grammar's size: expressions and rules are the nodes of an AND/OR graph
    (a sequence needs every part, a choice, a reference or a rule one), each node counts
    the parts it still lacks, and a node that becomes productive tells only its parents
    (a pass per rule until nothing changes took seconds for a 2,000-rule chain)."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != "v16":
        return True
    flat, starts, rules = data["grammar_expr_data"], data["grammar_expr_indptr"], data["rules"]
    n_exprs = len(starts)
    ends = starts[1:] + [len(flat)]
    # Node ids: expressions 0..n_exprs-1, then rule r as n_exprs + r.
    lacking = [0] * (n_exprs + len(rules))
    parents: list[list[int]] = [[] for _ in lacking]
    ready = []

    def needs(node: int, children: list[int], all_of: bool) -> None:
        for child in children:
            parents[child].append(node)
        lacking[node] = len(children) if all_of else 1
        if all_of and not children:
            ready.append(node)

    for expr_id, (lo, hi) in enumerate(zip(starts, ends)):
        kind, payload = flat[lo], flat[lo + 2:hi]
        if kind == _RULE_REF:
            needs(expr_id, [n_exprs + payload[0]], all_of=False)
        elif kind == _SEQUENCE:
            needs(expr_id, payload, all_of=True)
        elif kind == _CHOICES:
            needs(expr_id, payload, all_of=False)
        elif kind == _REPEAT and payload[1] != 0:
            needs(expr_id, [n_exprs + payload[0]], all_of=False)
        else:  # bytes, character classes, empty, a repeat that may be empty, unknown kinds
            ready.append(expr_id)
    for index, rule in enumerate(rules):
        needs(n_exprs + index, [rule[1]], all_of=False)

    productive = [False] * len(lacking)
    for node in ready:
        productive[node] = True
    while ready:
        for parent in parents[ready.pop()]:
            lacking[parent] -= 1
            if lacking[parent] == 0 and not productive[parent]:
                productive[parent] = True
                ready.append(parent)
    return productive[n_exprs + data["root_rule_id"]]
