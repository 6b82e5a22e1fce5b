"""`llmd bench latency|throughput|serve`. Heavy imports (torch, the engine) happen inside
the commands, so `llmd --help` stays quick."""
from __future__ import annotations

import math
import re

import click
from click.core import ParameterSource

from llmd.engine_options import engine_options
from llmd_tools.bench.report import emit

SEED_HELP = "Seed of the workload's random prompts and lengths."


@click.group()
def bench() -> None:
    """Benchmarks: offline latency and throughput, and serving a running daemon."""


def _model(func):
    """The model options of the offline benchmarks (engine settings follow the others)."""
    for option in reversed([
        click.option("--model", default=None, help="A Hugging Face model directory or a .gguf file (default: the built-in model)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
                     help="auto: CUDA when available, else CPU."),
        click.option("--tp", "tensor_parallel_size", type=int, default=None, help="Tensor parallel size."),
    ]):
        func = option(func)
    return func


def _common(func):
    func = click.option("--data-seed", type=int, default=0, show_default=True, help=SEED_HELP)(func)
    return click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")(func)


def _only_with(ctx: click.Context, names: tuple[str, ...], allowed: bool, when: str) -> None:
    """Refuse options given on the command line that the chosen mode does not use."""
    given = [n for n in names if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
    if given and not allowed:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise click.UsageError(f"{flags} only applies {when}")


def _run(func, *args, **kwargs):
    """Run a benchmark; errors a user can fix are printed, not traced."""
    from llmd_client.errors import LlmdError

    try:
        return func(*args, **kwargs)
    except (ValueError, FileNotFoundError, LlmdError) as exc:
        raise click.ClickException(str(exc)) from None


@bench.command()
@_model
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together.")
@click.option("--input-len", type=click.IntRange(min=1), default=32, show_default=True, help="Prompt tokens per request.")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens generated per request.")
@click.option("--num-iters-warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed batches first.")
@click.option("--num-iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed batches.")
@_common
@engine_options
def latency(model, batch_size, input_len, output_len, num_iters_warmup, num_iters, data_seed, as_json,
            **settings) -> None:
    """Latency of one batch of fixed-length requests (offline engine)."""
    from llmd_tools.bench.latency import run_latency
    from llmd_tools.bench.offline import load_llm

    llm = _run(load_llm, model, settings)
    emit(_run(run_latency, llm, batch_size=batch_size, input_len=input_len, output_len=output_len,
              num_iters_warmup=num_iters_warmup, num_iters=num_iters, seed=data_seed), as_json)


@bench.command()
@_model
@click.option("--dataset", type=click.Choice(["random", "nano"]), default="random", show_default=True,
              help="random: fixed lengths; nano: nano-vllm's mix, lengths uniform in [100, --max-len].")
@click.option("--num-prompts", type=click.IntRange(min=1), default=256, show_default=True, help="Requests in the workload.")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True, help="random only.")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True, help="random only.")
@click.option("--max-len", type=click.IntRange(min=100), default=1024, show_default=True, help="nano only.")
@click.option("--hf-baseline", is_flag=True, help="Then run the same workload through HF transformers' generate.")
@click.option("--hf-batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Prompts per HF generate call.")
@_common
@engine_options
@click.pass_context
def throughput(ctx, model, dataset, num_prompts, input_len, output_len, max_len, hf_baseline, hf_batch_size,
               data_seed, as_json, **settings) -> None:
    """Every request at once through the offline engine: requests and tokens per second."""
    _only_with(ctx, ("input_len", "output_len"), dataset == "random", "to --dataset random")
    _only_with(ctx, ("max_len",), dataset == "nano", "to --dataset nano")
    _only_with(ctx, ("hf_batch_size",), hf_baseline, "with --hf-baseline")
    from llmd_tools.bench.offline import load_llm
    from llmd_tools.bench.throughput import make_workload, run_throughput

    llm = _run(load_llm, model, settings)
    reqs = _run(make_workload, llm, dataset, num_prompts, input_len, output_len, max_len, data_seed)
    emit(_run(run_throughput, llm, reqs, dataset, hf_batch_size if hf_baseline else None), as_json)


def _split(values: tuple[str, ...]) -> list[str]:
    """Values of a repeatable option, each also splitting on commas and spaces."""
    return [v for value in values for v in re.split(r"[,\s]+", value.strip()) if v]


def _rates(values: tuple[str, ...]) -> list[float | None]:
    rates: list[float | None] = []
    for v in _split(values):
        try:
            r = float(v)
        except ValueError:
            raise click.BadParameter(f"{v!r} is not a number (or inf)", param_hint="--request-rate") from None
        if not r > 0:
            raise click.BadParameter(f"{v} must be > 0 (inf: all at once)", param_hint="--request-rate")
        rates.append(None if math.isinf(r) else r)
    return rates or [None]


def _slos(values: tuple[str, ...]) -> dict[str, float]:
    from llmd_tools.bench.serve import SLO_KEYS

    slos = {}
    for v in _split(values):
        key, _, ms = v.partition(":")
        try:
            limit = float(ms)
        except ValueError:
            limit = math.nan
        if key not in SLO_KEYS or not limit > 0:
            raise click.BadParameter(f"{v!r}: expected METRIC:MILLISECONDS with METRIC one of "
                                     f"{', '.join(SLO_KEYS)}, e.g. ttft:500", param_hint="--goodput")
        slos[key] = limit
    return slos


@bench.command()
@click.option("--socket", "socket_path", default=None, help="The daemon's Unix socket (default: as llmctl).")
@click.option("--backend", "backends", multiple=True, metavar="NAME[,NAME...]",
              help="socket (the daemon's protocol; default) or openai (its OpenAI API over HTTP); "
                   "several: each runs the same sweep, one after the other.")
@click.option("--base-url", default=None, help="openai: the API's base URL, e.g. http://127.0.0.1:8000/v1 "
                                                "(default: the HTTP Unix socket beside --socket).")
@click.option("--http-socket", default=None, help="openai: the daemon's HTTP Unix socket (default: beside --socket).")
@click.option("--api-key", default=None, envvar="LLMD_API_KEY", help="openai: bearer token (default: $LLMD_API_KEY).")
@click.option("--workload", type=click.Choice(["random", "shared-prefix", "abort"]), default="random",
              show_default=True, help="random prompts; shared-prefix (an editor re-sending a file); abort (clients "
                                      "that cancel mid-stream).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=100, show_default=True, help="Requests per run.")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt tokens (shared-prefix: each request's own tokens after its prefix).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens generated per request (greedy, to the end).")
@click.option("--num-prefixes", type=click.IntRange(min=1), default=4, show_default=True, help="shared-prefix only.")
@click.option("--prefix-len", type=click.IntRange(min=1), default=512, show_default=True, help="shared-prefix only.")
@click.option("--abort-fraction", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="abort only: share of clients that cancel mid-stream.")
@click.option("--request-rate", multiple=True, metavar="RATE[,RATE...]",
              help="Requests/s (Poisson arrivals); inf: all at once (default). Several values: a sweep.")
@click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Shape of gamma-distributed arrival gaps: 1 is Poisson, lower is burstier.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None, help="Most requests in flight at once.")
@click.option("--goodput", multiple=True, metavar="METRIC:MS[,...]",
              help="SLOs for goodput, e.g. ttft:500,tpot:50 (ttft, tpot, e2e in milliseconds).")
@click.option("--vocab-size", type=click.IntRange(min=6), default=1000, show_default=True,
              help="Random token ids are drawn below this; at most the model's vocabulary.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="Plot latency percentiles against the request rate (needs matplotlib).")
@_common
@click.pass_context
def serve(ctx, socket_path, backends, base_url, http_socket, api_key, workload, num_prompts, input_len, output_len, num_prefixes, prefix_len,
          abort_fraction, request_rate, burstiness, max_concurrency, goodput, vocab_size, plot_path, data_seed,
          as_json) -> None:
    """Load a running daemon over its socket: TTFT, TPOT, ITL, E2E, throughput, goodput."""
    from llmd_tools.bench import plot
    from llmd_tools.bench.backends import BACKENDS
    from llmd_tools.bench.serve import ServeConfig, run_serve

    chosen = tuple(dict.fromkeys(_split(backends))) or ("socket",)
    for name in chosen:
        if name not in BACKENDS:
            raise click.BadParameter(f"must be one of {', '.join(BACKENDS)}", param_hint="--backend")
    _only_with(ctx, ("base_url", "http_socket", "api_key"), "openai" in chosen, "to --backend openai")

    _only_with(ctx, ("num_prefixes", "prefix_len"), workload == "shared-prefix", "to --workload shared-prefix")
    _only_with(ctx, ("abort_fraction",), workload == "abort", "to --workload abort")
    if workload == "abort" and output_len < 2:
        raise click.BadParameter("the abort workload needs at least 2 output tokens", param_hint="--output-len")
    if plot_path and not plot.available():
        raise click.UsageError(plot.MISSING)
    config = ServeConfig(workload=workload, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                         num_prefixes=num_prefixes, prefix_len=prefix_len, abort_fraction=abort_fraction,
                         burstiness=burstiness, max_concurrency=max_concurrency, vocab_size=vocab_size,
                         seed=data_seed, slos_ms=_slos(goodput))
    sweep = _run(run_serve, socket_path, config, _rates(request_rate), chosen, base_url=base_url,
                 http_socket=http_socket, api_key=api_key)
    emit(sweep, as_json)
    if plot_path:
        plot.plot_sweep(sweep, plot_path)
