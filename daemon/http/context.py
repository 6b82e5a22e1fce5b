"""What every HTTP handler needs to know about the model a request names (loaded, and
pinned until the response is done: `served_model`), and how request bodies are read:
typed msgspec decoding whose errors name the parameter, never its value."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from llmd.http.errors import ApiError
from llmd.http.fim import FimTokens
from llmd.http.model_cards import describe_files
from llmd.pool.registry import ModelSpec, UnknownModel
from llmd.pool.slot import ModelUnavailable
from llmd.tool_calls import FORMATS, ToolCallFormat, format_for
from llmd_client.framing import NestingError, decode_json

T = TypeVar("T")


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _bytes_to_unicode()
# msgspec puts field names and types in backticks and values (an enum's, say) in quotes:
# keep the first, drop the second.
_QUOTED_VALUE = re.compile(r"'[^']*'|\"[^\"]*\"")
_FIELD = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_]*)|field `([A-Za-z_][A-Za-z0-9_]*)`")


@dataclass
class ServedModel:
    names: tuple[str, ...]  # what clients may call the model (served_model_name); listings show the first
    created: int  # when the model's files were written (Unix time)
    max_model_len: int
    tokenizer: Any
    architecture: str
    num_params: int
    dtype: str
    size_bytes: int
    digest: str
    fim: FimTokens | None = None
    format: str = "safetensors"  # the checkpoint's file format (Ollama's details.format)
    quantization: str = "F32"  # the weights' type in the file, as Ollama names it (Q4_1, F16, BF16, ...)
    tool_format: ToolCallFormat = field(default_factory=lambda: FORMATS["hermes"])  # how the model writes calls
    guided_tool_calls: str = "forced"  # when tool calls are guided: "forced" or "always" (DaemonConfig)
    task: str = "generate"  # what the model is served for: "generate" or "embed" (embeddings only)
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: for a byte-level BPE token that holds part of a UTF-8
        character these are the real bytes, where its text shows a replacement character."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece) and self._byte_level:
            return [_BYTE_OF[c] for c in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    @functools.cached_property
    def tool_markers_are_special(self) -> bool:
        """Whether the tokenizer holds one of the call format's markers as a special token
        (Mistral's [TOOL_CALLS]): a reply that may call tools must then keep that text."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return False
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        return any(marker in special for marker in self.tool_format.markers)

    @functools.cached_property
    def _byte_level(self) -> bool:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return backend is not None and "ByteLevel" in type(backend.decoder).__name__ + str(backend.decoder)

    @functools.cached_property
    def parameter_size(self) -> str:
        n = self.num_params
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


MODEL_LEASE = "model_lease"  # the request's pin on its model (released when the response is done)


def resolve_model(request: web.Request, requested: str | None) -> ModelSpec:
    """The model `requested` names (None or "": the default); unknown: a 404
    `model_not_found` naming `model` (and the models served, not what was asked)."""
    try:
        return request.app["models"].resolve(requested)
    except UnknownModel as exc:
        raise ApiError(404, str(exc).removeprefix("model: "), param="model", code="model_not_found") from None


async def served_model(request: web.Request, requested: str | None, keep_alive: float | None = None) -> ServedModel:
    """The model `requested` names, loaded first if need be (the request waits; its
    client leaving stops the wait), and pinned until the response is done.
    `keep_alive`: how long the model stays once idle (None: its own). One that cannot
    serve is a 503 saying why."""
    spec = resolve_model(request, requested)
    try:
        lease = await request.app["models"].acquire(spec, keep_alive)
    except ModelUnavailable as exc:
        raise ApiError(503, str(exc), param="model", code=exc.code) from None
    previous = request.get(MODEL_LEASE)
    if previous is not None:
        previous.release()
    request[MODEL_LEASE] = lease
    return lease.model.served


def current_served(request: web.Request) -> ServedModel:
    """The model this request took with served_model."""
    return request[MODEL_LEASE].model.served


def release_model(request: web.Request) -> None:
    """The response is done: let go of its model."""
    lease = request.get(MODEL_LEASE)
    if lease is not None:
        lease.release()


@functools.cache
def _decoder(kind: type[T]) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)


async def decode_body(request: web.Request, kind: type[T]) -> T:
    check_json_content_type(request)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body is larger than {request.app['max_body']} bytes", code="too_large") from None
    if not body:
        raise ApiError(400, "request body is empty; send a JSON object", code="bad_request")
    try:
        return decode_json(body, _decoder(kind))
    except NestingError as exc:
        raise ApiError(400, f"request body {str(exc).removeprefix('message ')}", code="bad_request") from None
    except msgspec.ValidationError as exc:
        text = _QUOTED_VALUE.sub("<value>", str(exc))[:300]
        # The top-level parameter (`$.response_format`) before a field inside it (`type`).
        matches = list(_FIELD.finditer(text))
        match = next((m for m in matches if m.group(1)), matches[0] if matches else None)
        param = (match.group(1) or match.group(2)) if match else None
        raise ApiError(400, text, param=param, code="invalid_params") from None
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid UTF-8 JSON", code="bad_request") from None


def from_browser(request: web.Request) -> bool:
    """Whether a browser sent the request: browsers put Origin on every cross-origin
    request and every POST, and Sec-Fetch-* headers on every request; curl, SDKs and
    scripts send neither."""
    headers = request.headers
    return "Origin" in headers or "Sec-Fetch-Mode" in headers or "Sec-Fetch-Site" in headers


def check_json_content_type(request: web.Request) -> None:
    """JSON bodies come as `application/json` (or `application/<x>+json`): a web page can
    send any other type (text/plain, a form) cross-origin without asking first, this one
    only after a CORS preflight the daemon answers for allowed origins alone. A body
    with no Content-Type, or curl -d's form type, is taken as JSON from a client that
    is not a browser (curl -d without -H, scripts), never from a browser."""
    header = request.headers.get("Content-Type")
    media = header.split(";", 1)[0].strip().lower() if header is not None else None
    if media == "application/json" or (media and media.startswith("application/") and media.endswith("+json")):
        return
    if media in (None, "", "application/x-www-form-urlencoded") and not from_browser(request):
        return
    raise ApiError(415, "Content-Type must be application/json", code="unsupported_media_type")


def describe_model(engine, names: list[str] | tuple[str, ...] = (), *, tool_call_parser: str | None = None,
                   guided_tool_calls: str = "forced", task: str = "generate") -> ServedModel:
    """What the HTTP APIs say about the engine's model: its files' card (model_cards.py)
    and its tokenizer. `names`: what clients may call it (default: the file or folder
    name); the tool settings are the operator's (DaemonConfig), `task` the engine's."""
    from llmd.http.fim import find_fim_tokens

    card = describe_files(engine.model_dir, tuple(names), engine.max_model_len)
    return ServedModel(
        names=card.names, created=card.created, max_model_len=engine.max_model_len,
        tokenizer=engine.tokenizer, architecture=card.architecture, num_params=card.num_params,
        dtype=str(engine.dtype).removeprefix("torch."), size_bytes=card.size_bytes, digest=card.digest,
        fim=find_fim_tokens(engine.tokenizer), format=card.format, quantization=card.quantization,
        guided_tool_calls=guided_tool_calls, task=task,
        tool_format=format_for(tool_call_parser, getattr(engine.tokenizer, "chat_template", None), card.architecture))
