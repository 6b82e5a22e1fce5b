"""What model listings (/v1/models, /api/tags, /api/show) say of a model, loaded or
not: its architecture, size, type and digest from its files' headers (config.json and
safetensors headers of an HF directory, the header of a GGUF file; no tensor is read),
and its context length from the settings or the files. A loaded model's ServedModel
carries the same fields, and more (its tokenizer)."""
from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmd.pool.registry import ModelSpec


@dataclass(frozen=True)
class ModelCard:
    names: tuple[str, ...]  # what clients may call the model; listings show the first
    created: int  # when the model's files were written (Unix time)
    max_model_len: int
    architecture: str
    num_params: int
    size_bytes: int
    digest: str
    format: str = "safetensors"  # the checkpoint's file format (Ollama's details.format)
    # The weights' type in the file, as Ollama names it (Q4_1, F16, BF16, ...), or a
    # packed checkpoint's scheme (awq-int4, gptq-int8, fp8-e4m3).
    quantization: str = "F32"
    chat_template: str | None = None  # where the files hold it as text (an HF directory's)
    task: str = "generate"  # what the model is served for (its settings'): "generate" or "embed"

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def parameter_size(self) -> str:
        n = self.num_params
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe_files(path: str | Path, names: tuple[str, ...], max_model_len: int | None) -> ModelCard:
    """A model directory's or GGUF file's card (`max_model_len` None: the files' own)."""
    model_path = Path(path)
    if model_path.is_file():  # a GGUF checkpoint
        from llmd.gpu.models.gguf_summary import gguf_summary
        from llmd.pool.estimate import read_shape

        summary = gguf_summary(model_path)
        return ModelCard(names=names or (model_path.name,), created=int(model_path.stat().st_mtime),
                         max_model_len=max_model_len or read_shape(str(model_path)).max_position,
                         architecture=summary.architecture, num_params=summary.num_params,
                         size_bytes=summary.size_bytes, digest="sha256:" + summary.header_sha256, format="gguf",
                         quantization=summary.quantization)
    from safetensors import safe_open

    from llmd.gpu.layers.quant.scheme import config_scheme, weights_per_element

    config_bytes = (model_path / "config.json").read_bytes()
    config = json.loads(config_bytes)
    scheme = config_scheme(config)
    weights = sorted(model_path.glob("*.safetensors"))
    elements_of: Counter[str] = Counter()  # safetensors dtype (F32, F16, BF16, ...) -> elements
    for file in weights:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor, size = f.get_slice(name), 1
                for dim in tensor.get_shape():
                    size *= dim
                elements_of[tensor.get_dtype()] += size * weights_per_element(name, scheme)
    quantization = scheme.label if scheme is not None else elements_of.most_common(1)[0][0] if elements_of else "F32"
    return ModelCard(names=names or (model_path.name,), created=int((model_path / "config.json").stat().st_mtime),
                     max_model_len=max_model_len or (config.get("text_config") or config).get(
                         "max_position_embeddings", 2048),
                     architecture=(config.get("architectures") or ["unknown"])[0],
                     num_params=sum(elements_of.values()), size_bytes=sum(f.stat().st_size for f in weights),
                     digest="sha256:" + hashlib.sha256(config_bytes).hexdigest(),
                     quantization=quantization,
                     chat_template=_chat_template(model_path))


def _chat_template(model_dir: Path) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None


def card_of(spec: ModelSpec) -> ModelCard:
    """The card of a model that may not be loaded (the built-in one where fetched)."""
    path = spec.path
    if not path:
        from llmd.builtin_model import BuiltinModelUnavailable, builtin_model_path

        try:
            path = str(builtin_model_path(fetch=False))
        except BuiltinModelUnavailable:
            return ModelCard(names=spec.names, created=0, max_model_len=spec.engine.max_model_len or 0,
                             architecture="unknown", num_params=0, size_bytes=0, digest="", format="gguf",
                             task=spec.engine.task)
    return replace(describe_files(path, spec.names, spec.engine.max_model_len), task=spec.engine.task)


async def listing(pool: Any, cache: dict[str, ModelCard]) -> list[Any]:
    """Every model the daemon may serve, the default first: a loaded model's ServedModel,
    else its card (read once, off the event loop, and kept in `cache`). A model whose
    files cannot be read is left out (its requests say why)."""
    out = []
    for spec in pool.registry.listed():
        slot = pool.slots.get(spec.name)
        if slot is not None and slot.model is not None and slot.model.served is not None:
            out.append(slot.model.served)
            continue
        card = cache.get(spec.name)
        if card is None:
            try:
                card = cache[spec.name] = await asyncio.to_thread(card_of, spec)
            except (OSError, ValueError, KeyError):
                continue
        out.append(card)
    return out
