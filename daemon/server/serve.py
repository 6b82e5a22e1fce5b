"""`llmd serve`: bind (or adopt) the sockets, load the default model, run the actors and
the model pool (more models load on demand), drain on SIGTERM. Connections that arrive
while the default model loads wait in the listen backlog, or are answered by the
loading responder and handed to the intake once it is ready."""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import resource
import signal
import socket
from dataclasses import dataclass, field

import uvloop

from llmd.server import sd_notify
from llmd.actors.intake import IntakeActor
from llmd.actors.loading import LoadingResponder
from llmd.actors.messages import Draining
from llmd.actors.metrics import MetricsActor
from llmd.actors.runtime import Actor, Supervisor
from llmd.config import EngineConfig
from llmd.daemon_config import DaemonConfig, model_registry
from llmd.heap import one_arena
from llmd.pool.budget import MemoryBudget
from llmd.pool.loaded_model import LoadedModel, estimate_memory
from llmd.pool.pool import ModelPool
from llmd.pool.slot import ModelSlot, ModelUnavailable, SlotState
from llmd.server.unix_socket import bind_path, bind_socket, close_socket, socket_name
from llmd.server.watchdog import feed_watchdog
from llmd_client.protocol import Error

logger = logging.getLogger("llmd.server")
try:
    SERVER_VERSION = importlib.metadata.version("llmd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    SERVER_VERSION = "0+unknown"
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


class _SlotProgress:
    """The default model's load as the loading responder reports it."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot

    @property
    def fraction(self) -> float:
        return 1.0 if self.slot.state is SlotState.SERVING else self.slot.view().load_progress or 0.0

    @property
    def phase(self) -> str:
        return "done" if self.slot.state is SlotState.SERVING else self.slot.view().load_phase or "starting"


async def _load_default(pool: ModelPool, daemon: DaemonConfig, sock: socket.socket,
                        stop: asyncio.Event) -> LoadingResponder | None:
    """Load the default model while the loading responder answers early clients. None
    when stopped first; a model that fails to load raises, its clients told so."""
    sd_notify.status("loading model")
    spec = pool.registry.default
    # Clients that connect while the model loads get hello and status answered
    # ("loading (n%)"); what they submit waits for the intake.
    responder = LoadingResponder(sock, _SlotProgress(pool.slot(spec)), model=spec.name,
                                 server_version=SERVER_VERSION, listen_backlog=daemon.listen_backlog,
                                 max_connections=daemon.max_connections,
                                 max_connections_per_user=daemon.max_connections_per_user,
                                 idle_timeout_s=daemon.idle_timeout_s)
    await responder.start()
    load = asyncio.ensure_future(pool.load(spec))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not load.done():
        logger.info("stopped while loading the model")
        responder.close(Error(code="shutting_down", message="the daemon stopped while loading its model"))
        await _shutdown_pool(pool)
        load.cancel()
        return None
    try:
        load.result()
    except ModelUnavailable as exc:
        responder.close(Error(code="internal", message="the model failed to load; see the daemon log"))
        if isinstance(exc.__cause__, (ValueError, OSError)):
            raise exc.__cause__ from None  # the load's own error: `llmd serve` says what it means
        raise ValueError(str(exc)) from None
    return responder


async def _shutdown_pool(pool: ModelPool) -> None:
    """Unload every model; a load in progress is told to stop (a kernel build it waits
    for is killed, else the process, exiting, would wait for all of it)."""
    from llmd.gpu.layers.cpu.kernel_build import cancel_builds

    pool.stop_loading()
    cancel_builds()
    await pool.shutdown(LOAD_CANCEL_WAIT_S)


@dataclass
class Actors:
    """The running actors and the pool the daemon's stop speaks to, and their supervisor."""

    metrics: MetricsActor
    intake: IntakeActor
    pool: ModelPool
    supervisor: Supervisor
    faces: list[str] = field(default_factory=lambda: ["intake"])  # what stops first (nothing new comes in)


def _start_faces(pool: ModelPool, metrics: MetricsActor, supervisor: Supervisor, daemon: DaemonConfig,
                 listeners: Listeners, open_files: int) -> Actors:
    """Start the intake (and the HTTP intake in front of it) over the model pool."""
    intake = IntakeActor(listeners.protocol, pool, metrics=metrics, server_version=SERVER_VERSION, config=daemon,
                         max_connections=max(1, min(daemon.max_connections, open_files - 256)))
    pool.on_failed = intake.fail_model_requests
    faces: list[Actor] = [intake]
    if listeners.http:
        from llmd.actors.http_intake import HttpIntakeActor
        from llmd.http.listeners import api_keys
        faces.insert(0, HttpIntakeActor(listeners.http, intake, metrics, pool, api_keys=api_keys(daemon),
                                        listen_backlog=daemon.listen_backlog))
    for actor in faces:
        supervisor.start(actor)
    return Actors(metrics, intake, pool, supervisor, [actor.name for actor in faces])


async def _until_stopped(stop: asyncio.Event, actors: Actors) -> int:
    """Wait for a stop signal, an actor's death or the only model's engine's; the exit code that calls for."""
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, actors.supervisor.failed, actors.pool.fatal)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()
    if actors.supervisor.failed.is_set():
        logger.error("stopping: %s", actors.supervisor.failure)
        return 1
    if actors.pool.fatal.is_set():
        # Exit non-zero for the service manager to restart the daemon, once every
        # request (the scheduler failed them all) has its final message.
        logger.error("stopping: the model %s", actors.pool.fatal_reason)
        return 1
    return 0


async def _drain(actors: Actors, daemon: DaemonConfig, close_listener: bool) -> None:
    """Stop accepting, refuse what waits for a model, let running requests finish up to
    the drain timeout, then abort the rest; every request gets its final message before
    the connections close."""
    intake, supervisor = actors.intake, actors.supervisor
    sd_notify.stopping()
    actors.metrics.send(Draining())
    intake.stop_accepting(close_listener=close_listener)
    actors.pool.stop_loading()
    logger.info("draining %d request(s) for up to %.0f s", len(intake.registry), daemon.drain_timeout_s)
    await _wait_until(lambda: not intake.registry, daemon.drain_timeout_s, supervisor)
    if intake.registry:
        intake.abort(intake.live_request_ids())
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
    registry = model_registry(daemon, engine_config)
    listeners = Listeners.bind(daemon)
    supervisor = Supervisor()
    metrics = MetricsActor(default_model=registry.default.name, server_version=SERVER_VERSION,
                           health_stall_s=daemon.health_stall_s)
    pool = ModelPool(registry, MemoryBudget(daemon.max_loaded_models, daemon.model_memory_budget_bytes or {}),
                     loader=functools.partial(LoadedModel.load, metrics=metrics, daemon=daemon),
                     estimator=estimate_memory)
    metrics.models_view = pool.snapshot
    supervisor.start(metrics)
    try:
        responder = await _load_default(pool, daemon, listeners.protocol, stop)
    except BaseException:
        await supervisor.stop(["metrics"])
        listeners.close()
        raise
    if responder is None:
        await supervisor.stop(["metrics"])
        listeners.close()
        return 0
    actors = _start_faces(pool, metrics, supervisor, daemon, listeners, open_files)
    await asyncio.sleep(0)  # the intake's run() starts serving the socket
    await responder.hand_over(actors.intake.adopt)
    metrics_server = await _serve_metrics(listeners, metrics, daemon)
    watchdog = asyncio.ensure_future(feed_watchdog(pool.making_progress))
    default = pool.slot(registry.default).model
    sd_notify.ready(f"serving {registry.default.name}")
    logger.info("serving %s on %s (%s, %s)%s", registry.default.name, listeners.protocol_path or "the adopted socket",
                default.engine.device, default.engine.dtype,
                "" if registry.single_model else f"; {len(registry.specs) - 1} more model(s) load on demand")

    code = await _until_stopped(stop, actors)
    if not supervisor.failed.is_set():
        await _drain(actors, daemon, close_listener=listeners.protocol_path is None)
    watchdog.cancel()
    if metrics_server is not None:
        metrics_server.close()
    await supervisor.stop(actors.faces)
    await actors.intake.close_connections()  # while the actors their frames may ask still answer
    await _shutdown_pool(pool)
    await supervisor.stop(["metrics"])
    listeners.close()
    return code


def serve(daemon: DaemonConfig, engine_config: EngineConfig) -> int:
    one_arena()  # before the models' threads: their freed memory can be given back whole
    return uvloop.run(_serve(daemon, engine_config))
