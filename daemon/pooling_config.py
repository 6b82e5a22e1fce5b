"""How the engine makes embeddings of a model: how it pools the final hidden states
(the last token's, the mean over the input, or the first token's) and which sizes a
request may cut the vector to (Matryoshka models). Settled once, at load, from the
engine settings and the model's own files, as sentence-transformers and vLLM read them:

- a sentence-transformers directory says how it pools in `modules.json` and its Pooling
  module's `config.json` (`1_Pooling/config.json`): `pooling_mode_lasttoken`,
  `pooling_mode_mean_tokens`, `pooling_mode_cls_token`;
- `config.json`'s `matryoshka_dimensions` (the sizes it was trained for) or
  `is_matryoshka` (any size) allow a request's `dimensions`.

The `pooling_type` and `matryoshka_dimensions` settings override both. No torch."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

PoolingType = Literal["LAST", "MEAN", "CLS"]
# sentence-transformers' pooling modes that llmd runs, and the type each one is.
_ST_MODES: dict[str, PoolingType] = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}
_ST_PREFIX = "sentence_transformers.models."
# Modules of a sentence-transformers pipeline that llmd reproduces: the transformer
# itself, its pooling, and the L2 normalisation (every request's `normalize`).
_ST_MODULES_RUN = {"Transformer", "Pooling", "Normalize"}


class PoolingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`matryoshka_dimensions`: the sizes `dimensions` may ask for; () any size up to
    hidden_size; None: the model was not trained for smaller sizes, `dimensions` is
    refused. `source` says where the pooling type came from, for the log.
    `unsupported_modules`: sentence-transformers modules after the pooling that llmd
    does not run (a Dense projection, say): its embeddings are not that pipeline's."""

    pooling_type: PoolingType
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"
    unsupported_modules: tuple[str, ...] = ()

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raise ValueError (naming `dimensions`) for a size this model cannot give."""
        if dimensions is None:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError("dimensions is not supported by this model: it was not trained for Matryoshka "
                             "representations (the matryoshka_dimensions setting or config.json's "
                             "matryoshka_dimensions/is_matryoshka declare it)")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}] (the model's embedding size), "
                             f"got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            sizes = ", ".join(str(d) for d in self.matryoshka_dimensions)
            raise ValueError(f"dimensions must be one of the model's Matryoshka sizes ({sizes}), got {dimensions}")


def resolve_pooling(model_path: str, hf_config: Any, pooling_type: PoolingType | None,
                    matryoshka_dimensions: list[int] | None) -> PoolingConfig:
    """The pooling of the model at `model_path` (a directory, or a GGUF file, which has
    none of these files), the settings first. Raises ValueError for a
    sentence-transformers pooling mode llmd does not run."""
    hidden_size = int(hf_config.hidden_size)
    folder = Path(model_path)
    # With the setting given, the directory's pooling mode is not read (nor refused).
    st_type, unsupported = _sentence_transformers_pooling(folder, pooling_type is None) \
        if folder.is_dir() else (None, ())
    if pooling_type is not None:
        chosen, source = pooling_type, "the pooling_type setting"
    elif st_type is not None:
        chosen, source = st_type, "the model's sentence-transformers pooling config"
    else:
        chosen, source = "LAST", "the default for decoder models"
    if matryoshka_dimensions is not None:
        too_big = [d for d in matryoshka_dimensions if d > hidden_size]
        if too_big:
            raise ValueError(f"matryoshka_dimensions lists {too_big[0]}, more than the model's embedding size "
                             f"({hidden_size})")
        sizes: tuple[int, ...] | None = tuple(sorted(set(matryoshka_dimensions)))
    else:
        sizes = _declared_matryoshka(hf_config, hidden_size)
    return PoolingConfig(pooling_type=chosen, hidden_size=hidden_size, matryoshka_dimensions=sizes, source=source,
                         unsupported_modules=unsupported)


def _declared_matryoshka(hf_config: Any, hidden_size: int) -> tuple[int, ...] | None:
    """config.json's declaration, as vLLM reads it: the sizes listed in
    `matryoshka_dimensions`, or any size with `is_matryoshka`."""
    listed = getattr(hf_config, "matryoshka_dimensions", None)
    if listed:
        return tuple(sorted({int(d) for d in listed if 1 <= int(d) <= hidden_size}))
    if getattr(hf_config, "is_matryoshka", False):
        return ()
    return None


def _sentence_transformers_pooling(folder: Path, read_mode: bool) -> tuple[PoolingType | None, tuple[str, ...]]:
    """The pooling type a sentence-transformers directory declares (None: it is not
    one, it has no Pooling module, or not `read_mode`) and the modules llmd does not run."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, ()
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{modules_file} cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must list the sentence-transformers modules")
    pooling_type = None
    unsupported = []
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        name = kind.removeprefix(_ST_PREFIX)
        if name == "Pooling" and read_mode:
            pooling_type = _pooling_mode(folder / str(module.get("path", "")) / "config.json")
        elif name not in _ST_MODULES_RUN:
            unsupported.append(kind or "a module without a type")
    return pooling_type, tuple(unsupported)


def _pooling_mode(config_file: Path) -> PoolingType:
    """A Pooling module's config: exactly one mode that llmd runs, over the whole input."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the sentence-transformers pooling config {config_file} cannot be read "
                         f"({type(exc).__name__})") from None
    if isinstance(config.get("pooling_mode"), str):  # the spelling of newer releases
        modes = [config["pooling_mode"].removeprefix("pooling_mode_")]
    else:
        modes = [key.removeprefix("pooling_mode_") for key, on in config.items()
                 if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{config_file} asks for pooling mode(s) {', '.join(modes) or 'none'}; llmd pools by "
                         "lasttoken, mean_tokens or cls_token, exactly one (set pooling_type to override)")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file} sets include_prompt false (an instruction prefix left out of the "
                         "pooling), which llmd does not run (set pooling_type to override)")
    return _ST_MODES[modes[0]]
