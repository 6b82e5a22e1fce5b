"""`llmctl ps`, `llmctl load NAME` and `llmctl unload NAME`: the daemon's models, loaded
or not, with their memory and when they go; loading one ahead of its requests, and
unloading one (once its requests are done)."""
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
