"""`llmctl ps`, `llmctl load NAME`, `llmctl unload NAME`, `llmctl sleep NAME` and
`llmctl wake NAME`: the daemon's models, loaded or not, with their memory and when they
go; loading one ahead of its requests, unloading one (once its requests are done),
putting one to sleep (its KV cache freed, its weights kept in host memory or dropped)
and waking it."""
from __future__ import annotations

import click
import msgspec

from llmd_client.cli_errors import exit_codes
from llmd_client.client import Client
from llmd_client.durations import parse_duration
from llmd_client.protocol import ModelStatus
from llmd_client.status_view import format_models


def _print(models: list[ModelStatus], as_json: bool) -> None:
    if as_json:
        click.echo(msgspec.json.encode(models).decode())
    else:
        click.echo(format_models(models))


@click.command()
@click.option("--all", "-a", "show_all", is_flag=True, help="Also list the models that are not loaded.")
@click.option("--json", "as_json", is_flag=True, help="Print the models as JSON.")
@click.pass_context
def ps(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """List the loaded models: state, memory, requests, and when each is unloaded."""
    with exit_codes(), Client(ctx.obj) as client:
        models = client.models()
    _print([m for m in models if show_all or m.state != "unloaded"], as_json)


@click.command()
@click.argument("model", required=False)
@click.option("--keep-alive", metavar="DURATION",
              help='How long it stays loaded from now: seconds or e.g. "30m" (negative: for ever) '
                   "[default: the model's own].")
@click.option("--json", "as_json", is_flag=True, help="Print the model's state as JSON.")
@click.pass_context
def load(ctx: click.Context, model: str | None, keep_alive: str | None, as_json: bool) -> None:
    """Load MODEL (default: the daemon's default model); returns once it serves."""
    if keep_alive is not None:
        try:
            parse_duration(keep_alive)
        except ValueError as exc:
            raise click.BadParameter(str(exc).removeprefix("keep_alive "), param_hint="--keep-alive") from None
    with exit_codes(), Client(ctx.obj) as client:
        status = client.load(model, keep_alive)
    _print([status], as_json)


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the model's state as JSON.")
@click.pass_context
def unload(ctx: click.Context, model: str, as_json: bool) -> None:
    """Unload MODEL once its requests are done; returns once it is unloaded."""
    with exit_codes(), Client(ctx.obj) as client:
        status = client.unload(model)
    _print([status], as_json)


@click.command()
@click.argument("model", required=False)
@click.option("--level", type=click.IntRange(1, 2), default=1, show_default=True,
              help="1: free the KV cache, keep the weights in host memory (on a GPU copied to pinned RAM); "
                   "2: drop the weights too (read from the files again at wake).")
@click.option("--json", "as_json", is_flag=True, help="Print the model's state as JSON.")
@click.pass_context
def sleep(ctx: click.Context, model: str | None, level: int, as_json: bool) -> None:
    """Put MODEL (default: the daemon's default model) to sleep once its requests are
    done; returns once it is asleep. Its worker processes stay; its next request (or
    `llmctl wake`) wakes it."""
    with exit_codes(), Client(ctx.obj) as client:
        status = client.sleep(model, level)
    _print([status], as_json)


@click.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the model's state as JSON.")
@click.pass_context
def wake(ctx: click.Context, model: str | None, as_json: bool) -> None:
    """Wake MODEL (default: the daemon's default model) from sleep (one that is not
    loaded is loaded); returns once it serves."""
    with exit_codes(), Client(ctx.obj) as client:
        status = client.wake(model)
    _print([status], as_json)
