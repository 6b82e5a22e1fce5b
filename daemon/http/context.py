"""What every HTTP handler needs to know about the served model, and how request bodies
are read: typed msgspec decoding whose errors name the parameter, never its value."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from llmd.http.errors import ApiError
from llmd.http.fim import FimTokens
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

    def serves(self, requested: str) -> bool:
        """Whether `requested` is one of the model's names (Ollama's clients add a `:latest` tag)."""
        return requested.removesuffix(":latest") in self.names or requested in self.names

    def check(self, requested: str | None) -> None:
        """Clients name the model they want; this daemon serves one, under any of its names."""
        if requested and not self.serves(requested):
            raise ApiError(404, f"the model requested is not served here; this daemon serves {self.name}",
                           param="model", code="model_not_found")

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


def _weights_per_element(name: str, scheme: Any) -> int:
    """Model weights one element of checkpoint tensor `name` stands for: 32 / bits for an
    AWQ/GPTQ `qweight` word, none for a quantized module's zero points, scales and column
    groups (quant/scheme.py), one otherwise."""
    if scheme is None:
        return 1
    leaf = name.rpartition(".")[2]
    if leaf == "qweight":
        return 32 // scheme.bits
    return 0 if leaf in ("qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale") else 1


def describe_model(engine, names: list[str] | tuple[str, ...] = (), *, tool_call_parser: str | None = None,
                   guided_tool_calls: str = "forced", task: str = "generate") -> ServedModel:
    """What the HTTP APIs say about the engine's model, read from its files (config and
    safetensors headers of an HF directory, the header of a GGUF file; no tensor is
    loaded). `names`: what clients may call it (default: the file or folder name);
    the tool settings are the operator's (DaemonConfig), `task` the engine's."""
    import hashlib
    import json
    from collections import Counter
    from pathlib import Path

    from types import SimpleNamespace

    from safetensors import safe_open

    from llmd.gpu.layers.quant.scheme import quant_scheme
    from llmd.http.fim import find_fim_tokens

    model_path = Path(engine.model_dir)
    if model_path.is_file():  # a GGUF checkpoint
        from llmd.gpu.models.gguf_summary import gguf_summary

        summary = gguf_summary(model_path)
        architecture, num_params, size_bytes = summary.architecture, summary.num_params, summary.size_bytes
        digest, created, quantization = summary.header_sha256, model_path.stat().st_mtime, summary.quantization
    else:
        config_bytes = (model_path / "config.json").read_bytes()
        config = json.loads(config_bytes)
        architecture = (config.get("architectures") or ["unknown"])[0]
        scheme = quant_scheme(SimpleNamespace(quantization_config=config.get("quantization_config")))
        weights = sorted(model_path.glob("*.safetensors"))
        elements_of: Counter[str] = Counter()  # safetensors dtype (F32, F16, BF16, ...) -> elements
        for file in weights:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    size = 1
                    for dim in tensor.get_shape():
                        size *= dim
                    elements_of[tensor.get_dtype()] += size * _weights_per_element(name, scheme)
        num_params = sum(elements_of.values())
        quantization = scheme.label if scheme is not None else \
            elements_of.most_common(1)[0][0] if elements_of else "F32"
        size_bytes = sum(f.stat().st_size for f in weights)
        digest = hashlib.sha256(config_bytes).hexdigest()
        created = (model_path / "config.json").stat().st_mtime
    return ServedModel(
        names=tuple(names) or (model_path.name,), created=int(created), max_model_len=engine.max_model_len,
        tokenizer=engine.tokenizer, architecture=architecture, num_params=num_params,
        dtype=str(engine.dtype).removeprefix("torch."), size_bytes=size_bytes, digest="sha256:" + digest,
        fim=find_fim_tokens(engine.tokenizer), format="gguf" if model_path.is_file() else "safetensors",
        quantization=quantization, guided_tool_calls=guided_tool_calls, task=task,
        tool_format=format_for(tool_call_parser, getattr(engine.tokenizer, "chat_template", None), architecture))
