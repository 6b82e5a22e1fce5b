"""`llmctl`: talk to a running llmd from the shell (the model commands, `ps`, `load`,
`unload`, `sleep` and `wake`, are in llmctl_models.py).

Exit codes: 0 ok, 1 the daemon refused or failed the request, 2 usage error,
3 the daemon is not running, 4 the request was aborted (`llmctl abort` from elsewhere,
or the daemon shutting down), 5 guided output cut short by --max-tokens (it does not
follow its grammar yet), 130 interrupted (the request is aborted).
"""
from __future__ import annotations

import itertools
import sys
import time
from typing import IO, Any

import click
import msgspec

from llmd_client.cli_errors import EXIT_ABORTED, EXIT_GUIDED_CUT, EXIT_REQUEST_ERROR, exit_codes
from llmd_client.client import Client
from llmd_client.durations import parse_duration
from llmd_client.llmctl_models import load, ps, sleep, unload, wake
from llmd_client.protocol import GuidedDecodingParams, SamplingParams
from llmd_client.results import Result
from llmd_client.status_view import format_status

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llmd", prog_name="llmctl", message="%(prog)s %(version)s")
@click.option("--socket", "socket_path", metavar="PATH",
              help="The daemon's socket [default: $LLMD_SOCKET, /run/llmd/llmd.sock if present, "
                   "else $XDG_RUNTIME_DIR/llmd.sock].")
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None) -> None:
    """Talk to the llmd inference daemon."""
    ctx.obj = socket_path


def _read_prompt(prompt: str | None, file: IO[str] | None) -> str:
    if prompt is not None and file is not None:
        raise click.UsageError("give the prompt either as an argument or with --file, not both")
    if file is not None:
        return file.read()
    if prompt == "-":
        return sys.stdin.read()
    if prompt is not None:
        return prompt
    stdin = sys.stdin
    if stdin.isatty():
        raise click.UsageError("no prompt: give PROMPT, --file F, or pipe it on stdin")
    return stdin.read()


def sampling_options(func):
    """A flag for every sampling field a person would set from the shell."""
    for option in reversed([
        click.option("--max-tokens", type=int, help="Most tokens to generate [default: 16; chat: to the context's end]."),
        click.option("--min-tokens", type=int, help="Generate at least this many tokens before a stop counts."),
        click.option("--temperature", type=float, help="0 for greedy [default: 1.0]."),
        click.option("--top-p", type=float, help="Sample from the smallest set of tokens with this much probability."),
        click.option("--top-k", type=int, help="Sample from the k most likely tokens (0: all)."),
        click.option("--min-p", type=float, help="Drop tokens less likely than min-p times the most likely one."),
        click.option("--seed", type=int, help="Seed for reproducible sampling."),
        click.option("--presence-penalty", type=float, help="Penalise tokens already generated (-2..2)."),
        click.option("--frequency-penalty", type=float, help="Penalise tokens by how often they were generated (-2..2)."),
        click.option("--repetition-penalty", type=float, help="Divide the logits of tokens seen so far (1: off)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=None, help="Keep generating past the end-of-sequence token."),
        click.option("--include-stop-str", "include_stop_str_in_output", is_flag=True, default=None,
                     help="Keep the stop string at the end of the text."),
        click.option("--logprobs", type=int, help="Log probabilities of the top N tokens per position (in --json)."),
        click.option("--no-skip-special-tokens", "skip_special_tokens", flag_value=False, default=None,
                     help="Show special tokens in the text."),
        click.option("--no-speculative", "speculative", flag_value=False, default=None,
                     help="No speculative decoding for this request."),
        click.option("--json-schema", "json_schema", type=click.File("r"), metavar="FILE",
                     help="Guided decoding: the output is JSON valid under the schema in FILE."),
        click.option("--json-object", is_flag=True, help="Guided decoding: the output is a JSON object."),
        click.option("--regex", help="Guided decoding: the output matches this regular expression."),
        click.option("--choice", help="Guided decoding: the output is one of these comma-separated strings."),
        click.option("--grammar", type=click.File("r"), metavar="FILE",
                     help="Guided decoding: the output follows the EBNF grammar in FILE (rule root)."),
        click.option("--whitespace", type=click.Choice(["compact", "pretty", "any"]),
                     help="JSON layout under --json-schema/--json-object [default: compact]."),
    ]):
        func = option(func)
    return func


_GUIDED_FLAGS = ("json_schema", "json_object", "regex", "choice", "grammar", "whitespace")


def sampling_from(flags: dict[str, Any], **defaults: Any) -> SamplingParams:
    """SamplingParams from the flags of sampling_options (a usage error names the flag)."""
    guided = _guided_params(*(flags.pop(name) for name in _GUIDED_FLAGS))
    given = {k: (list(v) or None) if isinstance(v, tuple) else v for k, v in flags.items()}
    try:
        return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}}, guided=guided)
    except ValueError as exc:  # names the field and its limit
        field = str(exc).split(" ", 1)[0].split(".", 1)[0]
        raise click.BadParameter(str(exc), param_hint=f"--{field.replace('_', '-')}") from None


def model_options(func):
    """--model and --keep-alive: which model answers, and how long it stays loaded."""
    func = click.option("--keep-alive", metavar="DURATION",
                        help='How long the model stays loaded after this request: seconds or e.g. "5m" '
                             "(negative: for ever; 0: unload right after) [default: the model's own].")(func)
    return click.option("--model", "-m", metavar="NAME", help="The model to ask (`llmctl ps` lists them) "
                                                              "[default: the daemon's default model].")(func)


@cli.command()
@click.argument("prompt", required=False)
@click.option("--file", "-f", type=click.File("r"), help="Read the prompt from a file (- for stdin).")
@click.option("--n", "n", type=int, help="Number of samples.")
@model_options
@sampling_options
@click.option("--stream/--no-stream", default=None,
              help="Print text as it is generated [default: when stdout is a terminal].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object when done.")
@click.pass_context
def submit(ctx: click.Context, prompt: str | None, file: IO[str] | None, n: int | None, stream: bool | None,
           as_json: bool, model: str | None, keep_alive: str | None, **flags: Any) -> None:
    """Generate a completion of PROMPT (or of --file, or of stdin)."""
    params = sampling_from({**flags, "n": n})
    which = _model_args(model, keep_alive)
    text = _read_prompt(prompt, file)
    if stream is None:
        stream = sys.stdout.isatty()
    line_open = [False]
    with exit_codes(line_open), Client(ctx.obj) as client:
        if stream and not as_json and params.n == 1:
            out = sys.stdout
            error = finish_reason = None
            for delta in client.stream(text, sampling=params, **which):
                if delta.text:
                    out.write(delta.text)
                    out.flush()
                    line_open[0] = True
                error = delta.error or error
                finish_reason = delta.finish_reason or finish_reason
            click.echo()
            _exit_for_outcome(ctx, [finish_reason], error, params.guided is not None)
            return
        result = client.generate(text, sampling=params, **which)
        if as_json:
            click.echo(msgspec.json.encode(_result_json(result)).decode())
        elif len(result.outputs) == 1:
            click.echo(result.text)
        else:
            for completion in result.outputs:
                click.echo(f"--- sample {completion.index} ({completion.finish_reason}) ---")
                click.echo(completion.text)
        _exit_for_outcome(ctx, [c.finish_reason for c in result.outputs],
                          next((c.error for c in result.outputs if c.error), None), params.guided is not None)


@cli.command()
@click.option("--system", help="A system message opening the conversation.")
@model_options
@sampling_options
@click.pass_context
def chat(ctx: click.Context, system: str | None, model: str | None, keep_alive: str | None, **flags: Any) -> None:
    """Chat with the model: one line per turn, replies streamed; the conversation is kept.
    Ctrl-C stops the reply being written (the turn is dropped), Ctrl-D or /quit leaves."""
    params = sampling_from(flags, max_tokens=None)
    which = _model_args(model, keep_alive)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    tty = sys.stdin.isatty()
    with exit_codes(), Client(ctx.obj) as client:
        while True:
            try:
                line = input("> ") if tty else sys.stdin.readline()
            except (EOFError, KeyboardInterrupt):
                click.echo()
                return
            if not line or line.strip() == "/quit":
                return
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reply = _chat_turn(client, messages, params, which)
            if reply is None:
                messages.pop()  # interrupted: this turn never happened
            else:
                messages.append({"role": "assistant", "content": reply})


def _chat_turn(client: Client, messages: list[dict[str, str]], params: SamplingParams,
               which: dict[str, Any]) -> str | None:
    """Stream one reply; None when Ctrl-C cut it short (the request is aborted)."""
    parts: list[str] = []
    stream = client.stream(messages=messages, sampling=params, **which)
    try:
        for delta in stream:
            if delta.text:
                parts.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            if delta.error:
                click.echo(f"\nllmctl: error: {delta.error}", err=True)
                return None
    except KeyboardInterrupt:
        stream.close()
        click.echo("\n(interrupted)", err=True)
        return None
    click.echo()
    return "".join(parts)


def _model_args(model: str | None, keep_alive: str | None) -> dict[str, Any]:
    """The request's model and keep_alive (checked here: a usage error names the flag)."""
    if keep_alive is not None:
        try:
            parse_duration(keep_alive)
        except ValueError as exc:
            raise click.BadParameter(str(exc).removeprefix("keep_alive "), param_hint="--keep-alive") from None
    return {"model": model, "keep_alive": keep_alive}


def _guided_params(json_schema: IO[str] | None, json_object: bool, regex: str | None, choice: str | None,
                   grammar: IO[str] | None, whitespace: str | None) -> GuidedDecodingParams | None:
    given = {"json_schema": json_schema.read() if json_schema is not None else None,
             "json_object": json_object or None, "regex": regex,
             "choice": [c.strip() for c in choice.split(",")] if choice is not None else None,
             "grammar": grammar.read() if grammar is not None else None}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        if whitespace is not None:
            raise click.UsageError("--whitespace needs --json-schema or --json-object")
        return None
    if len(given) > 1:
        raise click.UsageError("give at most one of --json-schema, --json-object, --regex, --choice, --grammar")
    try:
        return GuidedDecodingParams(**given, whitespace=whitespace or "compact")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"--{next(iter(given)).replace('_', '-')}") from None


def _exit_for_outcome(ctx: click.Context, finish_reasons: list[str | None], error: str | None,
                      guided: bool) -> None:
    """A request the daemon accepted but then failed (e.g. its grammar did not compile),
    aborted, or (guided) cut short: a line on stderr and an exit code of its own."""
    if error is not None:
        click.echo(f"llmctl: error: {error}", err=True)
        ctx.exit(EXIT_REQUEST_ERROR)
    if "abort" in finish_reasons:
        click.echo("llmctl: the request was aborted (by `llmctl abort`, or the daemon is shutting down); "
                   "the text is incomplete", err=True)
        ctx.exit(EXIT_ABORTED)
    if guided and "length" in finish_reasons:
        click.echo("llmctl: the output reached --max-tokens before its grammar was complete: it is cut short "
                   "(raise --max-tokens)", err=True)
        ctx.exit(EXIT_GUIDED_CUT)


def _result_json(result: Result) -> dict[str, Any]:
    return {
        "request_id": result.request_id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "usage": msgspec.to_builtins(result.usage),
        "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "error": c.error,
                     **({"logprobs": msgspec.to_builtins(c.logprobs)} if c.logprobs is not None else {})}
                    for c in result.outputs],
    }


@cli.command()
@click.argument("texts", nargs=-1, metavar="[TEXT]...")
@click.option("--file", "-f", type=click.File("r"), help="Embed the text of a file (- for stdin).")
@click.option("--dimensions", type=int, help="Keep the first N dimensions (models trained for Matryoshka sizes).")
@click.option("--no-normalize", "normalize", flag_value=False, default=True,
              help="The pooled vector as it is, not scaled to unit length.")
@click.option("--truncate", is_flag=True, help="Embed the first tokens of a text longer than the context.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per text, with its request id and tokens.")
@model_options
@click.pass_context
def embed(ctx: click.Context, texts: tuple[str, ...], file: IO[str] | None, dimensions: int | None, normalize: bool,
          truncate: bool, as_json: bool, model: str | None, keep_alive: str | None) -> None:
    """Print the embedding of each TEXT (or of --file, or of stdin) as a JSON array, one
    line each; several TEXTs are embedded together."""
    if texts and file is not None:
        raise click.UsageError("give the text either as arguments or with --file, not both")
    inputs = list(texts) if texts else [_read_prompt(None, file)]
    which = _model_args(model, keep_alive)
    with exit_codes(), Client(ctx.obj) as client:
        try:
            results = client.embed(inputs, normalize=normalize, dimensions=dimensions, truncate=truncate, **which)
        except ValueError as exc:  # names the field: dimensions, or the model's name
            field = str(exc).split(" ", 1)[0]
            raise click.BadParameter(str(exc), param_hint="--model" if field == "model" else "--dimensions") from None
    for result in results:
        body = msgspec.to_builtins(result) if as_json else result.embedding
        click.echo(msgspec.json.encode(body).decode())


@cli.command()
@click.argument("request_id")
@click.pass_context
def abort(ctx: click.Context, request_id: str) -> None:
    """Abort the request REQUEST_ID (as listed by `llmctl status`)."""
    with exit_codes(), Client(ctx.obj) as client:
        client.abort(request_id)
        click.echo(f"aborted {request_id}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the model, queues, running requests, KV cache and memory."""
    with exit_codes(), Client(ctx.obj) as client:
        reply = client.status()
    if as_json:
        data = msgspec.to_builtins(reply)
        data.pop("type", None)
        click.echo(msgspec.json.encode(data).decode())
    else:
        click.echo(format_status(reply))


@cli.command()
@click.pass_context
def metrics(ctx: click.Context) -> None:
    """Print the daemon's metrics in Prometheus text format."""
    with exit_codes(), Client(ctx.obj) as client:
        text = client.metrics()
    click.echo(text, nl=not text.endswith("\n"))


@cli.command()
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--iterations", "-n", type=int, default=0, help="Stop after N refreshes [default: until Ctrl-C].")
@click.pass_context
def top(ctx: click.Context, interval: float, iterations: int) -> None:
    """A live view: queues, running requests, tokens/s, KV usage, prefix hits."""
    clear = sys.stdout.isatty()
    with exit_codes(), Client(ctx.obj) as client:
        try:
            for count in itertools.count(1):
                view = format_status(client.status())
                if clear:
                    click.echo("\x1b[H\x1b[2J" + view)
                else:
                    click.echo(view + "\n")
                if iterations and count >= iterations:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            return  # leaving top is not an error


for command in (ps, load, unload, sleep, wake):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="llmctl")


if __name__ == "__main__":
    main()
