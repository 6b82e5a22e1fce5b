"""`llmd serve`: bind (or adopt) the sockets, load the model, run the actors, drain on
SIGTERM. Connections that arrive while the model loads wait in the listen backlog, or
are answered by the loading responder and handed to the intake once it is ready."""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import resource
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from llmd.server import sd_notify
from llmd.actors.detokenizer_actor import DetokenizerActor
from llmd.actors.intake import IntakeActor
from llmd.actors.loading import LoadingResponder
from llmd.actors.messages import AbortRequest, Draining
from llmd.actors.metrics import MetricsActor
from llmd.actors.runtime import Actor, Supervisor
from llmd.actors.scheduler_actor import SchedulerActor
from llmd.config import EngineConfig
from llmd.daemon_config import DaemonConfig
from llmd.engine import LLMEngine
from llmd.load_progress import LoadCancelled, LoadProgress
from llmd.core.restart_policy import RestartPolicy
from llmd.server.unix_socket import bind_path, bind_socket, close_socket, socket_name
from llmd.server.watchdog import feed_watchdog
from llmd_client.protocol import Error

logger = logging.getLogger("llmd.server")
try:
    SERVER_VERSION = importlib.metadata.version("llmd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    SERVER_VERSION = "0+unknown"
# The actors in the order they stop: the faces first, so nothing new comes in.
STOP_ORDER = ["http", "intake", "scheduler", "detokenizer", "metrics"]
LOAD_CANCEL_WAIT_S = 10.0  # a stopped load: how long its model thread may take to give up


@dataclass
class Listeners:
    """The daemon's listening sockets, bound (or adopted from the service manager) before
    the model loads, so a busy port or a bad path is reported at once and early clients
    wait in the backlog."""

    protocol: socket.socket | None = None
    protocol_path: str | None = None  # the socket file we created; None when the service manager passed it
    metrics: socket.socket | None = None
    http: list[socket.socket] = field(default_factory=list)
    # What to close and remove on every way out, in the order bound (closed last first).
    closers: list[tuple[socket.socket | None, str | None]] = field(default_factory=list)

    @classmethod
    def bind(cls, daemon: DaemonConfig) -> Listeners:
        """Bind the metrics port, the protocol socket and the HTTP sockets; what was bound
        is closed again when a later one fails."""
        listeners = cls()
        try:
            if daemon.metrics_port is not None:
                from llmd.actors.metrics_http import bind_metrics_socket
                listeners.metrics = bind_metrics_socket(daemon.metrics_port)
                listeners.closers.append((listeners.metrics, None))
            adopted = sd_notify.listen_fds()
            adopted_http = None
            if daemon.http:
                from llmd.http.listeners import is_http_socket
                adopted_http = next((s for s in adopted if is_http_socket(s)), None)
            listeners._bind_protocol(daemon, [s for s in adopted if s is not adopted_http])
            if daemon.http:
                listeners._bind_http(daemon, adopted_http)
        except BaseException:
            listeners.close()
            raise
        return listeners

    def _bind_protocol(self, daemon: DaemonConfig, adopted: list[socket.socket]) -> None:
        """The protocol socket: the first one the service manager passed, or one bound at
        the configured (or default) path."""
        if adopted:
            self.protocol = adopted[0]
            self.protocol.setblocking(False)
            self.closers.append((self.protocol, None))
            logger.info("adopted socket from the service manager")
            return
        self.protocol_path = daemon.socket or bind_path()
        self.protocol = bind_socket(self.protocol_path, daemon.socket_group, daemon.listen_backlog)
        self.closers.append((self.protocol, self.protocol_path))
        logger.info("listening on %s", self.protocol_path)

    def _bind_http(self, daemon: DaemonConfig, adopted: socket.socket | None) -> None:
        """The HTTP APIs' Unix socket beside the protocol socket (or the one passed in),
        and the TCP port when configured."""
        from llmd.http.listeners import api_keys, bind_http
        api_keys(daemon)  # a missing key for TCP is a configuration error: report it before loading
        self.http, path = bind_http(daemon, self.protocol_path or socket_name(self.protocol), adopted)
        self.closers.extend((s, None) for s in self.http)
        if path:
            self.closers.append((None, path))
            logger.info("HTTP APIs on %s", path)
        if daemon.http_port is not None:
            logger.info("HTTP APIs on %s:%d", daemon.http_host, daemon.http_port)

    def close(self) -> None:
        for sock, path in reversed(self.closers):
            close_socket(sock, path)


def _raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (each client holds a descriptor;
    the default soft limit of 1,024 runs out first); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM (the service manager's stop) or SIGINT (Ctrl-C)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _load_engine(engine_config: EngineConfig, daemon: DaemonConfig, sock: socket.socket,
                       model_thread: ThreadPoolExecutor, stop: asyncio.Event
                       ) -> tuple[LLMEngine | None, LoadingResponder]:
    """Load the model on `model_thread` while the loading responder answers early clients.
    (None, responder) when stopped first; a model that fails to load raises, its clients
    told so."""
    sd_notify.status("loading model")
    progress = LoadProgress()
    # Clients that connect while the model loads get hello and status answered
    # ("loading (n%)"); what they submit waits for the intake.
    responder = LoadingResponder(sock, progress, model=Path(engine_config.model or "built-in model").name,
                                 server_version=SERVER_VERSION, listen_backlog=daemon.listen_backlog,
                                 max_connections=daemon.max_connections,
                                 max_connections_per_user=daemon.max_connections_per_user,
                                 idle_timeout_s=daemon.idle_timeout_s)
    await responder.start()
    load = asyncio.get_running_loop().run_in_executor(model_thread,
                                                      functools.partial(LLMEngine, engine_config, progress))
    done, _ = await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if load not in done:
        logger.info("stopped while loading the model")
        responder.close(Error(code="shutting_down", message="the daemon stopped while loading its model"))
        await _cancel_load(load, progress)
        model_thread.shutdown(wait=False, cancel_futures=True)
        return None, responder
    try:
        return load.result(), responder
    except BaseException:
        responder.close(Error(code="internal", message="the model failed to load; see the daemon log"))
        raise


async def _cancel_load(load: asyncio.Future, progress: LoadProgress) -> None:
    """End a load the daemon stopped during: the model thread gives up at its next tensor
    or phase, worker processes still loading are killed, a kernel build is killed (else
    the process, exiting, would wait for all of it on the model thread)."""
    from llmd.gpu.layers.cpu.kernel_build import cancel_builds
    progress.cancel()
    cancel_builds()
    done, _ = await asyncio.wait([load], timeout=LOAD_CANCEL_WAIT_S)
    if not done:
        logger.warning("the model load did not stop within %.0f s of the cancel; exiting after it", LOAD_CANCEL_WAIT_S)
        return
    exc = load.exception()
    if exc is not None and not isinstance(exc, LoadCancelled):
        logger.info("the cancelled load ended with %s", type(exc).__name__)


@dataclass
class Actors:
    """The running actors the daemon's stop speaks to, and their supervisor."""

    metrics: MetricsActor
    scheduler: SchedulerActor
    intake: IntakeActor
    supervisor: Supervisor


def _start_actors(engine: LLMEngine, model_names: tuple[str, ...], daemon: DaemonConfig, listeners: Listeners,
                  model_thread: ThreadPoolExecutor, open_files: int) -> Actors:
    """Wire the actors around the loaded engine (intake -> scheduler -> detokenizer, all
    reporting to metrics; the HTTP intake in front of the intake) and start them. The
    model goes by its first name; the HTTP faces accept any of them."""
    model_name = model_names[0]
    metrics = MetricsActor(model=model_name, server_version=SERVER_VERSION, device=str(engine.device),
                           dtype=str(engine.dtype).removeprefix("torch."), kv_blocks_total=engine.num_blocks,
                           health_stall_s=daemon.health_stall_s, memory=engine.memory)
    detokenizer = DetokenizerActor(engine.tokenizer, metrics)
    scheduler = SchedulerActor(engine, detokenizer, metrics, model_thread, RestartPolicy(
        backoff_s=daemon.worker_restart_backoff_s, backoff_max_s=daemon.worker_restart_backoff_max_s,
        max_failures=daemon.worker_max_failures, window_s=daemon.worker_failure_window_s))
    detokenizer.scheduler = scheduler
    intake = IntakeActor(listeners.protocol, engine.input_processor, scheduler=scheduler, detokenizer=detokenizer,
                         metrics=metrics, model_name=model_name, server_version=SERVER_VERSION, config=daemon,
                         max_connections=max(1, min(daemon.max_connections, open_files - 256)))
    actors: list[Actor] = [metrics, detokenizer, scheduler, intake]
    if listeners.http:
        from llmd.actors.http_intake import HttpIntakeActor
        from llmd.http.context import describe_model
        from llmd.http.listeners import api_keys
        served = describe_model(engine, model_names, tool_call_parser=daemon.tool_call_parser,
                                guided_tool_calls=daemon.guided_tool_calls, task=engine.config.task)
        actors.append(HttpIntakeActor(listeners.http, intake, metrics, served, api_keys=api_keys(daemon),
                                      listen_backlog=daemon.listen_backlog))
    supervisor = Supervisor()
    for actor in actors:
        supervisor.start(actor)
    return Actors(metrics, scheduler, intake, supervisor)


async def _until_stopped(stop: asyncio.Event, actors: Actors) -> int:
    """Wait for a stop signal, an actor's death or the engine's; the exit code that calls for."""
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, actors.supervisor.failed, actors.scheduler.dead)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()
    if actors.supervisor.failed.is_set():
        logger.error("stopping: %s", actors.supervisor.failure)
        return 1
    if actors.scheduler.dead.is_set():
        # Exit non-zero for the service manager to restart the daemon, once every
        # request (the scheduler failed them all) has its final message.
        logger.error("stopping: the engine is dead")
        return 1
    return 0


async def _drain(actors: Actors, daemon: DaemonConfig, close_listener: bool) -> None:
    """Stop accepting, let running requests finish up to the drain timeout, then abort
    the rest; every request gets its final message before the connections close."""
    intake, supervisor = actors.intake, actors.supervisor
    sd_notify.stopping()
    actors.metrics.send(Draining())
    intake.stop_accepting(close_listener=close_listener)
    logger.info("draining %d request(s) for up to %.0f s", len(intake.registry), daemon.drain_timeout_s)
    await _wait_until(lambda: not intake.registry, daemon.drain_timeout_s, supervisor)
    if intake.registry:
        actors.scheduler.send(AbortRequest(intake.live_request_ids()))
        await _wait_until(lambda: not intake.registry, 5.0, supervisor)
    await intake.flush_connections(2.0)


async def _wait_until(done, timeout: float, supervisor: Supervisor) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done() and not supervisor.failed.is_set():
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(0.02)


async def _serve_metrics(listeners: Listeners, metrics: MetricsActor, daemon: DaemonConfig) -> asyncio.Server | None:
    if listeners.metrics is None:
        return None
    from llmd.actors.metrics_http import serve_metrics
    from llmd.http.guard import BrowserGuard
    guard = BrowserGuard(daemon.http_allowed_origins or [], daemon.http_host)
    server = await serve_metrics(listeners.metrics, metrics, guard)
    logger.info("Prometheus metrics on http://127.0.0.1:%d/metrics", daemon.metrics_port)
    return server


async def _serve(daemon: DaemonConfig, engine_config: EngineConfig) -> int:
    stop = _stop_on_signals()
    open_files = _raise_open_files_limit()
    listeners = Listeners.bind(daemon)
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
    try:
        engine, responder = await _load_engine(engine_config, daemon, listeners.protocol, model_thread, stop)
    except BaseException:
        listeners.close()
        raise
    if engine is None:
        listeners.close()
        return 0
    model_names = daemon.served_names((Path(engine.model_dir).name,))
    model_name = model_names[0]
    actors = _start_actors(engine, model_names, daemon, listeners, model_thread, open_files)
    await asyncio.sleep(0)  # the intake's run() starts serving the socket
    await responder.hand_over(actors.intake.adopt)
    metrics_server = await _serve_metrics(listeners, actors.metrics, daemon)
    watchdog = asyncio.ensure_future(feed_watchdog(actors.scheduler.making_progress))
    sd_notify.ready(f"serving {model_name}")
    logger.info("serving %s on %s (%s, %s)", model_name, listeners.protocol_path or "the adopted socket",
                engine.device, engine.dtype)

    code = await _until_stopped(stop, actors)
    if not actors.supervisor.failed.is_set():
        await _drain(actors, daemon, close_listener=listeners.protocol_path is None)
    watchdog.cancel()
    if metrics_server is not None:
        metrics_server.close()
    await actors.supervisor.stop(STOP_ORDER)
    actors.intake.close_connections()
    listeners.close()
    engine.executor.shutdown()
    return code


def serve(daemon: DaemonConfig, engine_config: EngineConfig) -> int:
    return uvloop.run(_serve(daemon, engine_config))
