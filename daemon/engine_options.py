"""The engine settings as click options (`--max-num-seqs`, `--enable-prefix-caching/
--no-enable-prefix-caching`, ...), generated from EngineConfig so the command line and
the TOML file share every name and help text. Used by `llmd serve` and by any command
that builds an engine (the benchmarks)."""
from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import TypeVar

import click

from llmd.config import SETTING_HELP, EngineConfig

F = TypeVar("F", bound=Callable[..., object])

# Engine settings that `llmd serve` spells by hand (--model, --device, --tp,
# --speculative-config as JSON); the rest are generated here.
EXPLICIT = {"model", "device", "tensor_parallel_size", "speculative_config"}


def engine_options(func: F) -> F:
    """Add an option for every EngineConfig field not in EXPLICIT. Each defaults to None
    (not given), so a TOML file's value or EngineConfig's default applies."""
    hints = typing.get_type_hints(EngineConfig)
    for name in reversed(EngineConfig.__struct_fields__):
        if name in EXPLICIT:
            continue
        hint = hints[name]
        flag = "--" + name.replace("_", "-")
        default = getattr(EngineConfig(), name)
        help_text = SETTING_HELP[name] + ("" if default is None else f" [default: {_shown(default)}]")
        # An optional setting's flag takes its value's type (None is "not given").
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) \
            if typing.get_origin(hint) in (types.UnionType, typing.Union) else hint
        if hint is bool:
            option = click.option(f"{flag}/--no-{name.replace('_', '-')}", name, default=None, help=help_text)
        elif typing.get_origin(base) is typing.Literal:
            option = click.option(flag, name, type=click.Choice(typing.get_args(base)), default=None, help=help_text)
        elif typing.get_origin(base) is list:
            option = click.option(flag, name, callback=_int_list, multiple=True, metavar="N,N,...", help=help_text)
        else:
            option = click.option(flag, name, type=base, default=None, help=help_text)
        func = option(func)
    return func


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _int_list(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[int] | None:
    """--option 256,512 --option 1024 -> [256, 512, 1024]; None when not given."""
    items = [item.strip() for v in value for item in v.split(",") if item.strip()]
    try:
        return [int(item) for item in items] or None
    except ValueError:
        raise click.BadParameter("must be integers, comma-separated") from None
