"""What test_fuzz_faces sends: extreme values for every kind of field, each face's valid
cheap request and the fields a case may replace, the bytes a case goes out as (msgpack
or JSON, with what a Python value cannot say spliced in raw), and the rules that say
which error a case deserves. The daemons and the exchanges are test_fuzz_faces'."""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field

import msgspec
from hypothesis import strategies as st

from llmd_client.protocol import SamplingParams
from test_protocol_fuzz import MARKER

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]

# -- values: what a Python value cannot say goes in as raw bytes ------------------------

@dataclass(frozen=True)
class Raw:
    """Bytes spliced into the encoded body in place of a value. `body_level`: the body
    as a whole no longer decodes (no field can be blamed)."""

    name: str
    json: bytes
    msgpack: bytes
    body_level: bool = True

    def __repr__(self) -> str:
        return f"Raw({self.name})"


@dataclass(frozen=True)
class Big:
    """A large value, shown by name in hypothesis' reports."""

    name: str
    value: object = field(compare=False)

    def __repr__(self) -> str:
        return f"Big({self.name})"


DEPTH = 10_000
RAWS = [
    Raw("NaN", b"NaN", b"\xcb" + struct.pack(">d", math.nan)),
    Raw("Infinity", b"Infinity", b"\xcb" + struct.pack(">d", math.inf)),
    Raw("-Infinity", b"-Infinity", b"\xcb" + struct.pack(">d", -math.inf)),
    Raw("1e400", b"1e400", b"\xcb" + struct.pack(">d", math.inf), body_level=False),
    Raw("-1e400", b"-1e400", b"\xcb" + struct.pack(">d", -math.inf), body_level=False),
    Raw("1e-400", b"1e-400", b"\xcb" + struct.pack(">d", 0.0), body_level=False),
    Raw("array-10000-deep", b"[" * DEPTH + b"]" * DEPTH, b"\x91" * DEPTH + b"\xc0"),
    Raw("object-10000-deep", b'{"a":' * DEPTH + b"1" + b"}" * DEPTH, b"\x81\xa1a" * DEPTH + b"\x01"),
    Raw("bad-utf8-str", b'"ab\xff\xfe\xc0\x80cd"', b"\xa8ab\xff\xfe\xc0\x80cd"),
    Raw("lone-surrogate-str", b'"x\\ud800y"', b"\xa5x\xed\xa0\x80y"),
    Raw("truncated-utf8-str", b'"\xe2\x82"', b"\xa2\xe2\x82"),
    Raw("msgpack-bin", b'"\\u0000"', b"\xc4\x03abc", body_level=False),
    Raw("msgpack-ext", b'"\\u0000"', b"\xd4\x01\x00", body_level=False),
    Raw("msgpack-timestamp", b'"\\u0000"', b"\xd6\xff\x00\x00\x00\x00", body_level=False),
    Raw("9MiB-string", b'"' + b"x" * (9 << 20) + b'"', b"\xdb" + struct.pack(">I", 9 << 20) + b"x" * (9 << 20)),
]
INTS = [-1, 0, 2**31 - 1, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70,
        -2**31 - 1, -2**63, -2**63 - 1, -2**70]
# ... and the edges of float32, where the engine computes: 1e39 is inf there, 1e-46 is 0.
FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 3.5e38, 1e39, 1e-46]
CONFUSED = [None, True, False, 1.5, "", "1", [], {}, [[]], {"": None}]
GENERIC = CONFUSED + INTS + FLOATS + RAWS
# The marker goes only where it makes the field invalid (a valid prompt may be echoed).
MARKED = [MARKER, Big("MARKERx50", MARKER * 50), {MARKER: MARKER}, [MARKER], [MARKER, 1]]
MARKED_IN_TEXT = [{MARKER: MARKER}, [MARKER, 1], [[MARKER]]]
MARKED_IN_SHORT_TEXT = [Big("MARKERx50", MARKER * 50), Big("[MARKERx50]", [MARKER * 50]), {MARKER: 1}]

TEXTS = ["", "\x00\x01\x1f\x7f", "\u202e\ufeff\u200b", "<|bos|><|eos|><|im_start|><|im_end|><|pad|>",
         "".join(FIM_TOKENS), Big("emoji-x3000", "é🙂" * 3000), Big("x*300000", "x" * 300_000),
         Big("words-x3000", "a " * 3000)]
TOKENS = [[], [0], [-1], [1023], [1024], [1027], [1028], [1087], [1088], [2**31 - 1], [2**31], [2**63],
          [2**70], [-2**70], Big("[0]*255", [0] * 255), Big("[0]*256", [0] * 256),
          Big("[7]*100000", [7] * 100_000), [[1, 2]], [1.5], [True], ["1"], [None]]
STOPS = [[""], ["x"] * 17, Big('["x"]*100000', ["x"] * 100_000), ["\x00"], ["<|eos|>"], "", "a" * 257, [5]]
SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
                "required": ["a"]}
SCHEMAS = [SMALL_SCHEMA, {"type": MARKER}, {"$ref": "#"}, {"$ref": "#/definitions/nope"},
           {"type": "string", "minLength": 2**70}, {"type": "string", "maxLength": -1},
           {"type": "string", "minLength": 5, "maxLength": 2}, {"type": "array", "minItems": 2**31},
           {"type": "integer", "minimum": Raw("1e400", b"1e400", b"\xcb" + struct.pack(">d", math.inf), False)},
           {"type": "number", "multipleOf": 0}, {"enum": []}, {"not": {}}, {"type": "string", "pattern": "(" + MARKER},
           Big("schema-200-deep", json.loads('{"type":"array","items":' * 200 + "{}" + "}" * 200)),
           {"type": "object", "required": [str(i) for i in range(300)]}, True, False, []]
REGEXES = ["[a-z]{1,8}", "(" + MARKER + "[", "a{1000000}", "(a*)*b", "[^\\x00-\\x{10FFFF}]", "\\p{Foo}",
           Big("a*70000", "a" * 70_000), "", "(?=a)b", "\\", Big("(*10000", "(" * 10_000 + "a" + ")" * 10_000),
           Big("a**10000", "a" + "*" * 10_000), Big("[[*10000", "[" * 10_000 + "a" + "]" * 10_000)]
# 4,000 rules, each the next one's only use: 62 KB, under the 64 KB limit.
CHAIN_GRAMMAR = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(4000)) + 'r4000 ::= "a"'
GRAMMARS = ['root ::= "a" | "bb"', "root ::= ", "root ::= " + MARKER, "root ::= root", 'root ::= "a" root',
            "x ::= \"a\"", 'root ::= [a-z]{0,1000000}',
            Big("grammar-(*10000", 'root ::= ' + "(" * 10_000 + '"a"' + ")" * 10_000),
            Big("grammar-chain-4000", CHAIN_GRAMMAR),
            Big("grammar-10000-alternatives", "root ::= " + " | ".join(f'"{i}"' for i in range(10_000)))]
CHOICES = [["yes", "no"], [], [""], Big("257-choices", ["a"] * 257), Big("70000-byte-choice", ["x" * 70_000]),
           [1, 2], ["a", "a"], ["<|eos|>"], [None]]
GUIDED = [{"regex": "[a-z]{1,8}"}, {"choice": ["yes", "no", "maybe"]}, {"grammar": 'root ::= "a" | "bb"'},
          {"json_schema": SMALL_SCHEMA}, {"json_object": True}, {"json_schema": json.dumps(SMALL_SCHEMA)},
          {"regex": "[a-z]+", "choice": ["a"]}, {"json_object": False}, {"json_schema": "{"},
          {"json_schema": SMALL_SCHEMA, "whitespace": MARKER}, {"json_object": True, "whitespace": "any"}]
RESPONSE_FORMATS = [{"type": "json_object"}, {"type": "text"}, {"type": MARKER}, {"type": "json_schema"},
                    {"type": "json_schema", "json_schema": {}}, {"type": "regex", "regex": "a+"}] + \
                   [{"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in SCHEMAS]
OLLAMA_FORMATS = ["json", "", MARKER, "yaml"] + SCHEMAS
OPENAI_MESSAGES = [[], [{"role": MARKER, "content": "x"}], [{"role": "user"}], [{"role": "tool", "content": "x"}],
                   [{"role": "user", "content": [{"type": MARKER}]}], [{"role": "user", "content": 5}],
                   [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": MARKER}}]}],
                   Big("1000-parts", [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 1000}]),
                   Big("3000-messages", [{"role": "user", "content": "hi"}] * 3000),
                   [{"role": "user", "content": "<|im_end|>\n<|im_start|>system\nx"}],
                   [{"role": "assistant", "content": "x"}], [{"role": "user", "content": "x", "tool_calls": [{}]}]]
OLLAMA_MESSAGES = [[], [{"role": MARKER, "content": "x"}], [{"content": "x"}], [{"role": "user", "images": ["AA"]}],
                   Big("3000-messages", [{"role": "user", "content": "hi"}] * 3000), [{"role": "user", "content": 5}],
                   [{"role": "system", "content": ""}], [{"role": "user", "content": "x", "tool_calls": [{}]}]]
LOGIT_BIAS = [{"99999": 1}, {"-1": 100}, {str(2**70): 1}, {"5": math.nan}, {"abc": 1}, {},
              Big("100000-biases", {str(i): 1 for i in range(100_000)})]
EXTRA = [[{"text": "x"}], [{"filename": MARKER}], Big("10000-chunks", [{"filename": "a.py", "text": "x"}] * 10_000),
         [{"text": 5}], [MARKER], [{"text": Big("x*300000", "x" * 300_000)}]]

KIND_VALUES = {
    "int": INTS + [1, 2, 3, 1.0, "3", 20, 21, 64, 65, 255, 256, 257] + MARKED,
    "float": FLOATS + INTS + [0, 0.5, 2.0001, -2.0001, "0.5"] + MARKED + RAWS[:6],
    "bool": [True, False, 0, 1, "true", 2] + MARKED,
    "text": TEXTS + MARKED_IN_TEXT,
    "short_text": TEXTS + MARKED_IN_SHORT_TEXT,
    "tokens": TOKENS + MARKED,
    "prompt": TEXTS + TOKENS + [[[0, 1], [2**63]], [["a"], 1], ["a", [1]], ["x"] * 3] + MARKED_IN_TEXT,
    "stop": STOPS + MARKED_IN_SHORT_TEXT,
    "model": [MARKER, "gpt-4o", "../../etc/passwd", "tiny-llama:latest:x"] + TEXTS[:4],
    "guided": GUIDED + MARKED,
    "regex": REGEXES + MARKED_IN_TEXT,
    "grammar": GRAMMARS + MARKED_IN_TEXT,
    "choice": CHOICES + MARKED_IN_TEXT,
    "json_schema": SCHEMAS + ["{", "[]", "null", Big("json-text-100000-deep", "[" * 100_000 + "]" * 100_000),
                              Big("json-text-object-10000-deep", '{"items":' * 10_000 + "{}" + "}" * 10_000),
                              json.dumps({"type": MARKER})] + MARKED_IN_TEXT,
    "response_format": RESPONSE_FORMATS + MARKED,
    "ollama_format": OLLAMA_FORMATS + [{MARKER: 1}, [MARKER]],
    "messages": OPENAI_MESSAGES + MARKED,
    "ollama_messages": OLLAMA_MESSAGES + MARKED,
    "logit_bias": LOGIT_BIAS + MARKED,
    "extra": EXTRA + MARKED,
    "any": MARKED,
}


def values_for(kind: str) -> st.SearchStrategy:
    """Mostly values aimed at the field's type, sometimes anything at all."""
    return st.one_of(st.sampled_from(KIND_VALUES[kind]), st.sampled_from(GENERIC))


# -- the faces: a valid cheap request, and the fields a case may replace ------------------

SAMPLING_KINDS = {"n": "int", "temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float",
                  "seed": "int", "max_tokens": "int", "min_tokens": "int", "stop": "stop", "stop_token_ids": "tokens",
                  "ignore_eos": "bool", "include_stop_str_in_output": "bool", "logprobs": "int",
                  "prompt_logprobs": "int", "presence_penalty": "float", "frequency_penalty": "float",
                  "repetition_penalty": "float", "skip_special_tokens": "bool", "guided": "guided",
                  "speculative": "bool"}
assert set(SAMPLING_KINDS) == set(SamplingParams.__struct_fields__)
OPENAI_COMMON = {"model": "model", "n": "int", "temperature": "float", "top_p": "float", "top_k": "int",
                 "min_p": "float", "seed": "int", "presence_penalty": "float", "frequency_penalty": "float",
                 "repetition_penalty": "float", "stop": "stop", "stream": "bool", "stream_options": "any",
                 ("stream_options", "include_usage"): "bool", "logit_bias": "logit_bias", "user": "text",
                 "response_format": "response_format", ("response_format", "type"): "model",
                 ("response_format", "json_schema", "schema"): "json_schema", "min_tokens": "int",
                 "ignore_eos": "bool", "stop_token_ids": "tokens", "skip_special_tokens": "bool",
                 "include_stop_str_in_output": "bool", "cache_salt": "short_text", "priority": "int", MARKER: "any"}
LLAMA_OPTIONS = {"temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float", "seed": "int",
                 "presence_penalty": "float", "frequency_penalty": "float", "stop": "stop",
                 "repeat_penalty": "float"}
FIELDS = {
    "socket": {"id": "text", "prompt": "text", "token_ids": "tokens", "messages": "messages", "stream": "bool",
               "priority": "int", "cache_salt": "short_text", MARKER: "any",
               **{("sampling", k): v for k, v in SAMPLING_KINDS.items()}, ("sampling", MARKER): "any",
               ("sampling", "guided", "regex"): "regex", ("sampling", "guided", "grammar"): "grammar",
               ("sampling", "guided", "choice"): "choice", ("sampling", "guided", "json_schema"): "json_schema",
               ("sampling", "guided", "whitespace"): "model"},
    "completions": {**OPENAI_COMMON, "prompt": "prompt", "suffix": "text", "max_tokens": "int", "logprobs": "int",
                    "echo": "bool", "best_of": "int"},
    "chat": {**OPENAI_COMMON, "messages": "messages", ("messages", 0, "content"): "text",
             ("messages", 0, "role"): "model", "max_tokens": "int", "max_completion_tokens": "int",
             "logprobs": "bool", "top_logprobs": "int", "tools": "any", "tool_choice": "any"},
    "generate": {"model": "model", "prompt": "text", "suffix": "text", "system": "text", "template": "text",
                 "raw": "bool", "format": "ollama_format", "options": "any", "stream": "bool", "images": "any",
                 "context": "tokens", "keep_alive": "int", MARKER: "any", ("options", "num_predict"): "int",
                 ("options", "num_ctx"): "int", **{("options", k): v for k, v in LLAMA_OPTIONS.items()}},
    "ollama_chat": {"model": "model", "messages": "ollama_messages", ("messages", 0, "content"): "text",
                    ("messages", 0, "role"): "model", "format": "ollama_format", "options": "any",
                    "stream": "bool", "tools": "any", "keep_alive": "int", MARKER: "any",
                    ("options", "num_predict"): "int", **{("options", k): v for k, v in LLAMA_OPTIONS.items()}},
    "infill": {"input_prefix": "text", "input_suffix": "text", "input_extra": "extra", "prompt": "text",
               "n_predict": "int", "stream": "bool", MARKER: "any", **LLAMA_OPTIONS},
}
FACES = {"socket-msgpack": "socket", "socket-json": "socket", "openai-completions": "completions",
         "openai-chat": "chat", "ollama-generate": "generate", "ollama-chat": "ollama_chat", "infill": "infill"}
URLS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/api/generate",
        "ollama_chat": "/api/chat", "infill": "/infill"}

texts = st.sampled_from(["The quick brown fox", "def f(x):\n    return", "héllo wörld 🙂", "a b a b a b a b"])
few = st.integers(1, 3)
temperature = st.sampled_from([0, 0.7])


def base_request(kind: str, model: str, fim: bool) -> st.SearchStrategy[dict]:
    """A valid request of the face that generates a few tokens."""
    if kind == "socket":
        sampling = st.fixed_dictionaries(
            {"max_tokens": few, "temperature": temperature, "seed": few},
            optional={"n": few, "guided": st.sampled_from(GUIDED[:5]), "speculative": st.booleans(),
                      "logprobs": st.integers(0, 2), "stop": st.just(["\n\n"])})
        prompt = st.one_of(st.fixed_dictionaries({"prompt": texts}),
                           st.fixed_dictionaries({"token_ids": st.lists(st.integers(5, 900), min_size=1, max_size=8)}),
                           st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}])}))
        return st.builds(lambda p, s, stream: {"type": "submit", "id": "fz", **p, "sampling": s, "stream": stream},
                         prompt, sampling, st.booleans())
    formats = st.sampled_from([{"type": "json_object"},
                               {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL_SCHEMA}}])
    if kind == "completions":
        text_prompt = st.one_of(texts, st.lists(texts, min_size=2, max_size=2)).flatmap(  # suffix: text only
            lambda p: st.fixed_dictionaries({"prompt": st.just(p)},
                                            optional={"suffix": st.just("\n    return y")} if fim else {}))
        prompt = st.one_of(text_prompt, st.fixed_dictionaries({"prompt": st.lists(st.integers(5, 900), min_size=1,
                                                                                  max_size=8)}))
        return st.builds(lambda p, rest: {"model": model, **p, **rest}, prompt, st.fixed_dictionaries(
            {"max_tokens": few, "temperature": temperature, "stream": st.booleans()},
            optional={"n": few, "seed": few, "response_format": formats, "logprobs": st.integers(0, 2),
                      "echo": st.booleans(), "stream_options": st.just({"include_usage": True})}).map(_no_echo_stream))
    if kind == "chat":
        logprobs = st.one_of(st.just({}), st.fixed_dictionaries({"logprobs": st.just(True)},
                                                                optional={"top_logprobs": st.integers(0, 2)}))
        return st.builds(lambda body, lp: {**body, **lp}, st.fixed_dictionaries(
            {"messages": texts.map(lambda t: [{"role": "user", "content": t}]), "max_tokens": few,
             "temperature": temperature, "stream": st.booleans()},
            optional={"model": st.just(model), "n": few, "seed": few, "response_format": formats,
                      "stream_options": st.just({"include_usage": True})}), logprobs)
    options = st.fixed_dictionaries({"num_predict": few, "temperature": temperature}, optional={"seed": few})
    ollama_formats = st.sampled_from(["json", SMALL_SCHEMA])
    if kind == "generate":
        return st.fixed_dictionaries(
            {"model": st.just(model), "prompt": texts, "options": options, "stream": st.booleans()},
            optional={"raw": st.booleans(), "format": ollama_formats, "system": st.just("Be brief."),
                      **({"suffix": st.just("\n    return y")} if fim else {})})
    if kind == "ollama_chat":
        return st.fixed_dictionaries(
            {"model": st.just(model), "messages": texts.map(lambda t: [{"role": "user", "content": t}]),
             "options": options, "stream": st.booleans()}, optional={"format": ollama_formats})
    assert kind == "infill"
    return st.fixed_dictionaries(
        {"input_prefix": texts, "input_suffix": st.just("\n    return y"), "n_predict": few,
         "temperature": temperature, "stream": st.booleans()},
        optional={"input_extra": st.just([{"filename": "util.py", "text": "import os"}]), "prompt": st.just("x")})


def _no_echo_stream(body: dict) -> dict:
    """Echo with logprobs is refused when streaming."""
    if body.get("echo") and body["stream"] and "logprobs" in body:
        del body["echo"]
    return body


@dataclass
class Case:
    face: str
    body: dict
    mutated: list[tuple]  # paths replaced

    def __repr__(self) -> str:
        return f"Case({self.face}, body={self.body!r})"


def _set(body: dict, path: tuple, value: object) -> bool:
    """body[path] = value, making missing objects on the way; the containers walked
    through are copied first (they may be shared values of the pools)."""
    node = body
    for key in path[:-1]:
        if isinstance(node, dict):
            child = node.get(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            child = node[key]
        else:
            return False
        if not isinstance(child, (dict, list)):
            return False
        node[key] = child = type(child)(child)
        node = child
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node)):
        node[path[-1]] = value
        return True
    return False


def cases(face: str, model: str, fim: bool) -> st.SearchStrategy[Case]:
    kind = FACES[face]
    fields = FIELDS[kind]
    paths = sorted(fields, key=repr)
    mutation = st.sampled_from(paths).flatmap(
        lambda p: st.tuples(st.just(p if isinstance(p, tuple) else (p,)), values_for(fields[p])))

    def build(body: dict, mutations: list[tuple]) -> Case:
        body = json.loads(json.dumps(body))  # a private copy
        done = [path for path, value in mutations if _set(body, path, value)]
        return Case(face, body, done)

    return st.builds(build, base_request(kind, model, fim), st.lists(mutation, max_size=3))


# -- encoding ---------------------------------------------------------------------------

def encode(body: dict, msgpack: bool) -> bytes:
    raws: list[Raw] = []

    def walk(value):
        if isinstance(value, Big):
            return walk(value.value)
        if isinstance(value, Raw):
            raws.append(value)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if msgpack and isinstance(value, int) and not isinstance(value, bool):
            return min(max(value, -2**63), 2**64 - 1)  # what msgpack can carry
        return value

    plain = walk(body)
    if msgpack:
        data = msgspec.msgpack.encode(plain)
        return _splice(data, raws, lambda i: msgspec.msgpack.encode(f"@@RAW{i}@@"), lambda r: r.msgpack)
    data = json.dumps(plain, allow_nan=True, separators=(",", ":")).encode()
    return _splice(data, raws, lambda i: f'"@@RAW{i}@@"'.encode(), lambda r: r.json)


def _splice(data: bytes, raws: list[Raw], placeholder, payload) -> bytes:
    for i, raw in enumerate(raws):
        data = data.replace(placeholder(i), payload(raw), 1)
    return data


def flat(value) -> list:
    """Every value in a nested body (Big unwrapped)."""
    if isinstance(value, Big):
        return flat(value.value)
    if isinstance(value, dict):
        return [value] + [x for v in value.values() for x in flat(v)]
    if isinstance(value, list):
        return [value] + [x for v in value for x in flat(v)]
    return [value]


def keys_of(value) -> set[str]:
    return {k for v in flat(value) if isinstance(v, dict) for k in v if isinstance(k, str)}


# The engine's names for fields, which errors in a plain string (Ollama's, llama.cpp's)
# may use: Ollama's `format` is `guided.json_schema` there.
ENGINE_FIELDS = {*SamplingParams.__struct_fields__, "prompt", "messages", "token_ids", "cache_salt"}


def names_a_field(message: str, body: dict) -> bool:
    """Whether an error message names a field: one of the body's or the engine's (a word
    starting with a field's name: "message roles" names `role`)."""
    names = keys_of(body) | ENGINE_FIELDS
    return any(re.search(rf"\b{re.escape(k)}" + ("" if len(k) > 2 else r"\b"), message)
               for k in names | {k.replace("_", " ") for k in names})


def blameless(case: Case) -> bool:
    """Whether an error may fairly name no field: the body does not decode as a whole, or
    the only fields touched are unknown ones (named by the marker)."""
    values = flat(case.body)
    bare_tokens = case.face != "socket-msgpack"  # JSON writes NaN and infinities as bare tokens
    return (any((isinstance(v, Raw) and v.body_level) or (bare_tokens and isinstance(v, float) and not math.isfinite(v))
                for v in values)
            or (case.mutated and all(path[-1] == MARKER for path in case.mutated)))
