"""The models a daemon may serve, by name: the default model (`model`, or the built-in
one; named by `served_model_name` or its file or folder name) and the operator's
`[models.NAME]` tables, each with its own path, engine settings over the top-level
ones, aliases, keep_alive and tool-call format. Requests name a model (or none: the
default); with `allow_model_paths` they may also name a model directory or GGUF file
by its absolute path. Pure logic: nothing is read or loaded here but the settings."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from llmd.builtin_model import BUILTIN_MODEL
from llmd.config import EngineConfig
from llmd_client.durations import FOREVER, parse_duration

# Keys of a [models.NAME] table beside the engine settings.
TABLE_KEYS = ("path", "aliases", "keep_alive", "tool_call_parser", "idle_action", "sleep_level")
IDLE_ACTIONS = ("unload", "sleep")  # what keep_alive's end does to an idle model
SLEEP_LEVELS = (1, 2)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
DEFAULT_TABLE_KEEP_ALIVE_S = 300.0  # a [models.NAME] model's keep_alive when none is set (Ollama's 5m)


class UnknownModel(LookupError):
    """A request named no model this daemon serves. The message names the field and
    the served names, never what was asked for."""


@dataclass(frozen=True)
class ModelSpec:
    """One model the daemon may serve. `engine.model` is its path ("" for the built-in)."""

    name: str
    aliases: tuple[str, ...]
    engine: EngineConfig
    keep_alive_s: float  # once idle, unloaded (or put to sleep) after this long (FOREVER: never)
    tool_call_parser: str | None = None
    idle_action: str = "unload"  # at keep_alive's end: "unload", or "sleep" (faster to come back)
    sleep_level: int = 1  # the level idle_action "sleep" puts it to: 1 keeps the weights, 2 drops them
    default: bool = False
    ad_hoc: bool = False  # named by a request's path (allow_model_paths), not by the operator

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def path(self) -> str:
        return self.engine.model


class ModelRegistry:
    """Name -> ModelSpec for every model the operator listed, and (when allowed) the
    models requests named by path, kept while they are loaded (`forget` drops one)."""

    def __init__(self, specs: list[ModelSpec], allow_model_paths: bool = False,
                 ad_hoc_keep_alive_s: float = DEFAULT_TABLE_KEEP_ALIVE_S,
                 ad_hoc_idle: dict[str, Any] | None = None) -> None:
        """`ad_hoc_keep_alive_s` and `ad_hoc_idle` (idle_action, sleep_level): a model
        named by its path gets these, as a table without its own would."""
        self.specs = {spec.name: spec for spec in specs}
        self.default = next(spec for spec in specs if spec.default)
        self.allow_model_paths = allow_model_paths
        self.ad_hoc_keep_alive_s = ad_hoc_keep_alive_s
        self._ad_hoc_idle = ad_hoc_idle or {}
        self._by_name: dict[str, ModelSpec] = {}
        for spec in specs:
            for name in spec.names:
                if name in self._by_name:
                    raise ValueError(f"model name {name!r} is given twice (served_model_name, [models.NAME] "
                                     "and aliases must all differ)")
                self._by_name[name] = spec
        self._ad_hoc: dict[str, ModelSpec] = {}
        self._ad_hoc_engine = msgspec.structs.replace(self.default.engine, model="")

    @property
    def single_model(self) -> bool:
        """Only the default model can ever be served (no tables, no paths)."""
        return len(self.specs) == 1 and not self.allow_model_paths

    def listed(self) -> list[ModelSpec]:
        """The operator's models (the default first), then the ad-hoc ones known now."""
        return sorted(self.specs.values(), key=lambda s: not s.default) + list(self._ad_hoc.values())

    def resolve(self, requested: str | None) -> ModelSpec:
        """The model a request names: None or "" is the default; a name or alias (with
        or without Ollama's ":latest" tag); an absolute path where allowed."""
        if not requested:
            return self.default
        spec = self._by_name.get(requested) or self._by_name.get(requested.removesuffix(":latest"))
        if spec is not None:
            return spec
        if self.allow_model_paths and requested.startswith("/"):
            return self._path_spec(requested)
        served = ", ".join(s.name for s in self.listed())
        raise UnknownModel(f"model: the model requested is not served here; this daemon serves {served}")

    def _path_spec(self, requested: str) -> ModelSpec:
        path = os.path.normpath(requested)
        spec = self._ad_hoc.get(path) or self._by_name.get(path)
        if spec is not None:
            return spec
        p = Path(path)
        # The daemon reads it with its own rights: only what looks like a model is taken.
        if not ((p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf")):
            raise UnknownModel("model: no model is served under that name, and it is no model directory "
                               "(with a config.json) or .gguf file the daemon can read")
        spec = ModelSpec(name=path, aliases=(), engine=msgspec.structs.replace(self._ad_hoc_engine, model=path),
                         keep_alive_s=self.ad_hoc_keep_alive_s, tool_call_parser=self.default.tool_call_parser,
                         ad_hoc=True, **self._ad_hoc_idle)
        self._ad_hoc[path] = spec
        return spec

    def forget(self, name: str) -> None:
        """Drop an ad-hoc model (it was unloaded); the operator's models stay."""
        self._ad_hoc.pop(name, None)

    @classmethod
    def from_settings(cls, engine: EngineConfig, *, default_names: tuple[str, ...], tables: dict[str, Any] | None,
                      keep_alive: str | int | float | None, tool_call_parser: str | None,
                      allow_model_paths: bool, idle_action: str = "unload", sleep_level: int = 1) -> ModelRegistry:
        """The registry the settings describe (raises ValueError naming the setting).
        `default_names`: served_model_name (empty: the model's file or folder name)."""
        default_keep = parse_duration(keep_alive, "keep_alive") if keep_alive is not None else None
        names = default_names or (Path(engine.model).name if engine.model else BUILTIN_MODEL.filename,)
        idle = _idle_settings({"idle_action": idle_action, "sleep_level": sleep_level}, "", "unload", 1)
        specs = [ModelSpec(name=names[0], aliases=tuple(names[1:]), engine=engine, default=True,
                           keep_alive_s=FOREVER if default_keep is None else default_keep,
                           tool_call_parser=tool_call_parser, **idle)]
        table_keep = DEFAULT_TABLE_KEEP_ALIVE_S if default_keep is None else default_keep
        base = msgspec.to_builtins(engine)
        for name, table in (tables or {}).items():
            specs.append(_table_spec(name, table, base, table_keep, tool_call_parser, idle))
        return cls(specs, allow_model_paths, table_keep, idle)


def _table_spec(name: str, table: Any, base: dict[str, Any], keep_alive_s: float,
                tool_call_parser: str | None, idle: dict[str, Any]) -> ModelSpec:
    """One [models.NAME] table: `path`, optional aliases, keep_alive, tool_call_parser,
    idle_action and sleep_level (`idle`: the top-level ones), and engine settings over
    the top-level ones."""
    where = f"models.{name}"
    _check_name(name, where)
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table (path = ..., and settings)")
    if "model" in table:
        raise ValueError(f"{where}: give the model's directory or GGUF file as path, not model")
    engine_keys = set(EngineConfig.__struct_fields__) - {"model"}
    unknown = sorted(set(table) - set(TABLE_KEYS) - engine_keys)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s): {', '.join(unknown)}")
    path = table.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}.path is required: the model's directory or .gguf file")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{where}.aliases must be a list of names")
    for alias in aliases:
        _check_name(alias, f"{where}.aliases")
    keep = table.get("keep_alive")
    parser = table.get("tool_call_parser", tool_call_parser)
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"{where}.tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
    overrides = {k: v for k, v in table.items() if k in engine_keys}
    try:
        engine = msgspec.convert({**base, **overrides, "model": path}, EngineConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ModelSpec(name=name, aliases=tuple(aliases), engine=engine, tool_call_parser=parser,
                     keep_alive_s=keep_alive_s if keep is None else parse_duration(keep, f"{where}.keep_alive"),
                     **_idle_settings(table, f"{where}.", idle["idle_action"], idle["sleep_level"]))


def _idle_settings(table: dict[str, Any], where: str, idle_action: str, sleep_level: int) -> dict[str, Any]:
    """idle_action and sleep_level from `table` (else the given ones), checked."""
    action, level = table.get("idle_action", idle_action), table.get("sleep_level", sleep_level)
    if action not in IDLE_ACTIONS:
        raise ValueError(f"{where}idle_action must be one of {', '.join(IDLE_ACTIONS)}")
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"{where}sleep_level must be 1 (weights kept in host memory) or 2 (weights dropped)")
    return {"idle_action": action, "sleep_level": level}


def _check_name(name: str, where: str) -> None:
    if not isinstance(name, str) or not name or name != name.strip() or name.startswith("/") \
            or any(not c.isprintable() for c in name):
        raise ValueError(f"{where}: model names must be printable, not empty, without surrounding spaces, "
                         "and not start with / (paths)")
