"""`llmd bench serve`: load a running daemon through its Unix socket with llmd_client's
AsyncClient (one connection, every request streamed on it), or through its OpenAI API
over HTTP, or both one after the other (see backends.py), and measure what its users
see: TTFT, TPOT, ITL, end-to-end latency, throughput and goodput.

Requests arrive as a Poisson process at `request_rate` per second (None: all at once),
or a gamma process when `burstiness` != 1 (lower is burstier; the mean rate stays), and
at most `max_concurrency` run at once when given. Outputs run to their length
(greedy, ignore_eos). Workloads:

* `random`: prompts of `input_len` random tokens;
* `shared-prefix`: `num_prefixes` prefixes of `prefix_len` tokens, each request adds
  `input_len` tokens of its own (an editor re-sending one file): the prefix cache's case;
* `abort`: as `random`, but a fraction of the clients stop reading and cancel their
  request part-way through its output; those are counted as aborted, not failed.

A sweep (several rates, and several backends) runs one after another, each with prompts
of its own (seeded by the data seed, the backend and the run's index), so one run's
prompts never sit in the prefix cache for the next; the backends of one rate share its
arrival times, so they are compared on the same schedule.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from dataclasses import dataclass, field

import msgspec

from llmd_tools.bench import workloads
from llmd_tools.bench.backends import BackendError, make_backend
from llmd_tools.bench.report import Env, Stats, progress, rate

WORKLOADS = ("random", "shared-prefix", "abort")
SLO_KEYS = ("ttft", "tpot", "e2e")  # milliseconds
MAX_ERRORS_SHOWN = 5


class ServeConfig(msgspec.Struct, kw_only=True):
    workload: str = "random"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    num_prefixes: int = 4
    prefix_len: int = 512
    abort_fraction: float = 0.3
    burstiness: float = 1.0
    max_concurrency: int | None = None
    vocab_size: int = 1000
    seed: int = 0
    slos_ms: dict[str, float] = {}


class ServeReport(msgspec.Struct, kw_only=True):
    request_rate: float | None  # requests/s; None: all at once
    backend: str = "socket"  # how the requests reached the daemon: "socket" or "openai" (HTTP)
    target: str = ""  # the socket path or base URL
    sent: int
    completed: int
    failed: int
    aborted: int
    duration_s: float
    total_input_tokens: int  # of completed requests
    total_output_tokens: int  # of completed requests
    aborted_output_tokens: int  # streamed to aborted requests before they cancelled
    cached_prompt_tokens: int  # prompt tokens of completed requests served by the prefix cache
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float  # most output tokens streamed within one second (tok/s)
    goodput: float | None  # completed requests/s meeting every SLO; None without SLOs
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None
    errors: list[str] = []  # the first few distinct failures

    def text(self) -> str:
        rate_text = "inf" if self.request_rate is None else f"{self.request_rate:g}"
        lines = [f"--- {self.backend}: request rate {rate_text}/s " + "-" * 40,
                 f"{'requests':<24} {self.sent} sent: {self.completed} completed, {self.failed} failed, "
                 f"{self.aborted} aborted, in {self.duration_s:.2f} s",
                 f"{'tokens':<24} {self.total_input_tokens} input ({self.cached_prompt_tokens} from the "
                 f"prefix cache), {self.total_output_tokens} output",
                 f"{'request throughput':<24} {self.request_throughput:.2f} req/s"
                 + ("" if self.goodput is None else f", goodput {self.goodput:.2f} req/s"),
                 f"{'output throughput':<24} {self.output_throughput:.1f} tok/s (peak "
                 f"{self.peak_output_throughput:.0f} tok/s), total {self.total_token_throughput:.1f} tok/s"]
        for label, stats in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("ITL", self.itl_ms),
                             ("E2E", self.e2e_ms)):
            if stats is not None:
                lines.append(stats.row(label, "ms"))
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


class ServeSweep(msgspec.Struct, kw_only=True):
    benchmark: str = "serve"
    model: str
    socket: str
    config: ServeConfig
    runs: list[ServeReport]
    env: Env

    def text(self) -> str:
        c = self.config
        head = (f"llmd bench serve: {self.model} at {self.socket}; workload {c.workload}, {c.num_prompts} "
                f"requests of {c.input_len} in / {c.output_len} out")
        return "\n".join([head, *(r.text() for r in self.runs), self.env.line()])


@dataclass
class _Record:
    prompt_tokens: int
    sent: float = 0.0
    end: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each delta with tokens
    counts: list[int] = field(default_factory=list)  # its number of tokens
    completion_tokens: int = 0
    cached_tokens: int = 0
    outcome: str = "completed"  # or "failed", "aborted"
    error: str | None = None

    def latencies_ms(self) -> dict[str, float]:
        ttft = self.times[0] - self.sent if self.times else self.end - self.sent
        n = self.completion_tokens
        tpot = (self.end - self.sent - ttft) / (n - 1) if n > 1 else 0.0
        return {"ttft": ttft * 1e3, "tpot": tpot * 1e3, "e2e": (self.end - self.sent) * 1e3}


def make_workload(config: ServeConfig, seed: int | str) -> list[workloads.Req]:
    c = config
    if c.workload == "shared-prefix":
        return workloads.shared_prefix(c.num_prompts, c.num_prefixes, c.prefix_len, c.input_len, c.output_len,
                                       c.vocab_size, seed)
    if c.workload in ("random", "abort"):
        return workloads.fixed(c.num_prompts, c.input_len, c.output_len, c.vocab_size, seed)
    raise ValueError(f"unknown workload {c.workload!r}; known: {', '.join(WORKLOADS)}")


def run_serve(socket: str | None, config: ServeConfig, rates: list[float | None],
              backends: tuple[str, ...] = ("socket",), *, base_url: str | None = None,
              http_socket: str | None = None, api_key: str | None = None) -> ServeSweep:
    return asyncio.run(_sweep(socket, config, rates, backends, base_url, http_socket, api_key))


async def _sweep(socket: str | None, config: ServeConfig, rates: list[float | None], backends: tuple[str, ...],
                 base_url: str | None, http_socket: str | None, api_key: str | None) -> ServeSweep:
    """Every backend is warmed up first; then each rate runs on each backend in turn, so
    a drift in the machine's state over the sweep does not favour one backend."""
    async with contextlib.AsyncExitStack() as stack:
        opened = []
        for name in backends:
            backend = await stack.enter_async_context(make_backend(
                name, socket=socket, base_url=base_url, http_socket=http_socket, api_key=api_key))
            try:
                opened.append((backend, await backend.describe()))
            except BackendError as exc:
                raise ValueError(str(exc)) from None
            warm = workloads.fixed(1, 16, 4, config.vocab_size, seed=workloads.WARM_UP_SEED)[0]
            record = await _one(backend, warm, None, contextlib.nullcontext(), None)
            if record.outcome == "failed":
                raise ValueError(f"the warm-up request failed ({name}): {record.error}")
        runs: list[ServeReport] = []
        for i, r in enumerate(rates):
            for backend, here in opened:
                seed = f"{config.seed}:{i}" if backend.name == "socket" else f"{config.seed}:{backend.name}:{i}"
                report = await _run(backend, config, r, seed, timing_seed=f"{config.seed}:{i}")
                report.backend, report.target = backend.name, here.where
                runs.append(report)
    described = next((d for _, d in opened if d.device != "?"), opened[0][1])
    return ServeSweep(model=described.model, socket=described.where, config=config, runs=runs,
                      env=Env.here(described.device, described.dtype))


async def _run(backend, config: ServeConfig, request_rate: float | None, seed: str,
               timing_seed: str | None = None) -> ServeReport:
    """`seed` draws the prompts; `timing_seed` the arrival times and aborts, shared by the
    backends of one rate so they are compared on the same schedule."""
    reqs = make_workload(config, seed)
    rng = random.Random(timing_seed or seed)
    abort_after = {}
    if config.workload == "abort":
        abort_after = {i: rng.randint(1, r.output_len - 1) for i, r in enumerate(reqs)
                       if rng.random() < config.abort_fraction}
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    bar = progress(len(reqs), f"{backend.name} rate {'inf' if request_rate is None else request_rate}")
    tasks = []
    start = time.perf_counter()
    async for i in _arrivals(len(reqs), request_rate, config.burstiness, rng):
        tasks.append(asyncio.create_task(_one(backend, reqs[i], abort_after.get(i), limit, bar)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return summarize(records, request_rate, start, duration, config.slos_ms)


async def _arrivals(n: int, request_rate: float | None, burstiness: float, rng: random.Random):
    """Yields 0..n-1 at the arrival times: gaps gamma-distributed with shape
    `burstiness` and mean 1/rate (exponential, i.e. Poisson arrivals, at burstiness 1)."""
    loop = asyncio.get_running_loop()
    start, due = loop.time(), 0.0
    for i in range(n):
        if request_rate is not None and i:
            due += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
            delay = start + due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        yield i


async def _one(backend, req: workloads.Req, abort_after: int | None, limit, bar) -> _Record:
    async with limit:
        rec = _Record(len(req.prompt))
        rec.sent = time.perf_counter()
        stream = backend.stream(req)
        try:
            async for delta in stream:
                if delta.num_tokens:
                    rec.times.append(time.perf_counter())
                    rec.counts.append(delta.num_tokens)
                if delta.completion_tokens is not None:
                    rec.completion_tokens = delta.completion_tokens
                    rec.cached_tokens = delta.cached_tokens
                elif abort_after is not None and sum(rec.counts) >= abort_after:
                    rec.outcome = "aborted"
                    break
            rec.end = time.perf_counter()
        except BackendError as exc:
            rec.outcome, rec.error = "failed", str(exc)
        finally:
            await stream.aclose()  # cancels the request unless it ended
    if bar is not None:
        bar.update()
    return rec


def summarize(records: list[_Record], request_rate: float | None, start: float, duration: float,
              slos_ms: dict[str, float]) -> ServeReport:
    done = [r for r in records if r.outcome == "completed"]
    aborted = [r for r in records if r.outcome == "aborted"]
    lat = [r.latencies_ms() for r in done]
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.completion_tokens for r in done)
    goodput = None
    if slos_ms:
        good = sum(all(m[k] <= limit for k, limit in slos_ms.items()) for m in lat)
        goodput = rate(good, duration)
    errors = list(dict.fromkeys(r.error for r in records if r.error))[:MAX_ERRORS_SHOWN]
    return ServeReport(
        request_rate=request_rate, sent=len(records), completed=len(done),
        failed=sum(r.outcome == "failed" for r in records), aborted=len(aborted), duration_s=duration,
        total_input_tokens=n_in, total_output_tokens=n_out,
        aborted_output_tokens=sum(sum(r.counts) for r in aborted),
        cached_prompt_tokens=sum(r.cached_tokens for r in done),
        request_throughput=rate(len(done), duration), output_throughput=rate(n_out, duration),
        total_token_throughput=rate(n_in + n_out, duration),
        peak_output_throughput=_peak_rate(records, start, duration), goodput=goodput,
        ttft_ms=Stats.of([m["ttft"] for m in lat]),
        tpot_ms=Stats.of([m["tpot"] for r, m in zip(done, lat) if r.completion_tokens > 1]),
        itl_ms=Stats.of([b - a for r in done for a, b in zip(r.times, r.times[1:])], scale=1e3),
        e2e_ms=Stats.of([m["e2e"] for m in lat]), errors=errors)


def _peak_rate(records: list[_Record], start: float, duration: float) -> float:
    """Most output tokens streamed within one whole second since the start (the last,
    partial second is left out; a run shorter than a second counts as its own rate)."""
    per_second: collections.Counter[int] = collections.Counter()
    for r in records:
        for t, n in zip(r.times, r.counts):
            per_second[int(t - start)] += n
    if duration < 1.0:
        return rate(sum(per_second.values()), duration)
    return float(max((n for second, n in per_second.items() if second < int(duration)), default=0))
