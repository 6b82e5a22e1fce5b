"""`llmd serve`: bind (or adopt) the socket, load the model, run the actors, drain on
SIGTERM. Connections that arrive while the model loads wait in the listen backlog."""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import resource
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

from llmd import sd_notify
from llmd.config import EngineConfig
from llmd.daemon_config import DaemonConfig
from llmd.unix_socket import bind_path, bind_socket, close_socket, socket_name
from llmd.watchdog import feed_watchdog

logger = logging.getLogger("llmd.server")
try:
    SERVER_VERSION = importlib.metadata.version("llmd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    SERVER_VERSION = "0+unknown"


async def _serve(daemon: DaemonConfig, engine_config: EngineConfig) -> int:
    from llmd.actors.detokenizer_actor import DetokenizerActor
    from llmd.actors.intake import IntakeActor
    from llmd.actors.loading import LoadingResponder
    from llmd.load_progress import LoadProgress
    from llmd_client.protocol import Error
    from llmd.actors.messages import AbortRequest, Draining
    from llmd.actors.metrics import MetricsActor
    from llmd.actors.quotas import QuotaLimits
    from llmd.actors.runtime import Supervisor
    from llmd.actors.scheduler_actor import SchedulerActor
    from llmd.engine import LLMEngine
    from llmd.restart_policy import RestartPolicy

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    open_files = _raise_open_files_limit()
    closers: list = []  # what to close and remove on every way out, last bound first
    try:
        metrics_sock, sock, created_path, http_socks = _bind_listeners(daemon, closers)
    except BaseException:
        _close_all(closers)
        raise

    sd_notify.status("loading model")
    progress = LoadProgress()
    # Clients that connect while the model loads get hello and status answered
    # ("loading (n%)"); what they submit waits for the intake.
    responder = LoadingResponder(sock, progress, model=Path(engine_config.model or "built-in model").name,
                                 server_version=SERVER_VERSION, listen_backlog=daemon.listen_backlog)
    await responder.start()
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
    load = loop.run_in_executor(model_thread, functools.partial(LLMEngine, engine_config, progress))
    done, _ = await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if load not in done:
        logger.info("stopped while loading the model")
        responder.close(Error(code="shutting_down", message="the daemon stopped while loading its model"))
        model_thread.shutdown(wait=False, cancel_futures=True)
        _close_all(closers)
        return 0
    try:
        engine = load.result()
    except BaseException:
        responder.close(Error(code="internal", message="the model failed to load; see the daemon log"))
        _close_all(closers)
        raise
    model_name = Path(engine.model_dir).name

    metrics = MetricsActor(model=model_name, server_version=SERVER_VERSION, device=str(engine.device),
                           dtype=str(engine.dtype).removeprefix("torch."), kv_blocks_total=engine.num_blocks,
                           health_stall_s=daemon.health_stall_s)
    detokenizer = DetokenizerActor(engine.tokenizer, metrics)
    scheduler = SchedulerActor(engine, detokenizer, metrics, model_thread, RestartPolicy(
        backoff_s=daemon.worker_restart_backoff_s, backoff_max_s=daemon.worker_restart_backoff_max_s,
        max_failures=daemon.worker_max_failures, window_s=daemon.worker_failure_window_s))
    detokenizer.scheduler = scheduler
    intake = IntakeActor(sock, engine.input_processor, scheduler=scheduler, detokenizer=detokenizer,
                         metrics=metrics, model_name=model_name, server_version=SERVER_VERSION,
                         admin_group=daemon.admin_group, max_pending_requests=daemon.max_pending_requests,
                         prefix_cache_scope=daemon.prefix_cache_scope, listen_backlog=daemon.listen_backlog,
                         max_connections=max(1, min(daemon.max_connections, open_files - 256)),
                         max_connections_per_user=daemon.max_connections_per_user,
                         idle_timeout_s=daemon.idle_timeout_s,
                         quotas=QuotaLimits(requests_per_user=daemon.max_pending_requests_per_user,
                                            requests_per_connection=daemon.max_pending_requests_per_connection,
                                            tokens_per_user=daemon.max_pending_tokens_per_user))
    actors = [metrics, detokenizer, scheduler, intake]
    if http_socks:
        from llmd.actors.http_intake import HttpIntakeActor
        from llmd.http.context import describe_model
        from llmd.http.listeners import api_keys
        actors.append(HttpIntakeActor(http_socks, intake, metrics, describe_model(engine), api_keys=api_keys(daemon),
                                      listen_backlog=daemon.listen_backlog))
    supervisor = Supervisor()
    for actor in actors:
        supervisor.start(actor)
    await asyncio.sleep(0)  # the intake's run() starts serving the socket
    await responder.hand_over(intake.adopt)
    metrics_server = None
    if metrics_sock is not None:
        from llmd.actors.metrics_http import serve_metrics
        metrics_server = await serve_metrics(metrics_sock, metrics)
        logger.info("Prometheus metrics on http://127.0.0.1:%d/metrics", daemon.metrics_port)
    watchdog = asyncio.ensure_future(feed_watchdog(scheduler.making_progress))
    sd_notify.ready(f"serving {model_name}")
    logger.info("serving %s on %s (%s, %s)", model_name, created_path or "the adopted socket",
                engine.device, engine.dtype)

    waits = [asyncio.ensure_future(e.wait()) for e in (stop, supervisor.failed, scheduler.dead)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()
    code = 1 if supervisor.failed.is_set() or scheduler.dead.is_set() else 0
    if supervisor.failed.is_set():
        logger.error("stopping: %s", supervisor.failure)
    else:
        if scheduler.dead.is_set():
            # Exit non-zero for the service manager to restart the daemon, once every
            # request (the scheduler failed them all) has its final message.
            logger.error("stopping: the engine is dead")
        # Drain: stop accepting, let running requests finish up to the timeout, then
        # abort the rest; every request gets its final message.
        sd_notify.stopping()
        metrics.send(Draining())
        intake.stop_accepting(close_listener=created_path is None)
        logger.info("draining %d request(s) for up to %.0f s", len(intake.registry), daemon.drain_timeout_s)
        await _wait_until(lambda: not intake.registry, daemon.drain_timeout_s, supervisor)
        if intake.registry:
            scheduler.send(AbortRequest(intake.live_request_ids()))
            await _wait_until(lambda: not intake.registry, 5.0, supervisor)
        # One deadline for flushing every connection, so the stop stays within bounds.
        flushes = [asyncio.ensure_future(conn.writer.drain()) for conn in list(intake.connections)]
        if flushes:
            done, pending = await asyncio.wait(flushes, timeout=2.0)
            for task in pending:
                task.cancel()
            for task in done:
                task.exception()  # a peer that went away is not an error here
    watchdog.cancel()
    if metrics_server is not None:
        metrics_server.close()
    await supervisor.stop(["http", "intake", "scheduler", "detokenizer", "metrics"])
    for conn in list(intake.connections):
        conn.writer.close()
    _close_all(closers)
    engine.executor.shutdown()
    return code


async def _wait_until(done, timeout: float, supervisor) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done() and not supervisor.failed.is_set():
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(0.02)


def _bind_listeners(daemon: DaemonConfig, closers: list):
    """(metrics socket or None, protocol socket, its path if we created it, HTTP sockets),
    each added to `closers` as it is bound."""
    metrics_sock = None
    if daemon.metrics_port is not None:
        from llmd.actors.metrics_http import bind_metrics_socket
        metrics_sock = bind_metrics_socket(daemon.metrics_port)
        closers.append((metrics_sock, None))
    adopted = sd_notify.listen_fds()
    adopted_http = None
    if daemon.http:
        from llmd.http.listeners import is_http_socket
        adopted_http = next((s for s in adopted if is_http_socket(s)), None)
    adopted = [s for s in adopted if s is not adopted_http]
    created_path = None
    if adopted:
        sock = adopted[0]
        sock.setblocking(False)
        closers.append((sock, None))
        logger.info("adopted socket from the service manager")
    else:
        created_path = daemon.socket or bind_path()
        sock = bind_socket(created_path, daemon.socket_group, daemon.listen_backlog)
        closers.append((sock, created_path))
        logger.info("listening on %s", created_path)
    http_socks: list[socket.socket] = []
    if daemon.http:
        from llmd.http.listeners import api_keys, bind_http
        api_keys(daemon)  # a missing key for TCP is a configuration error: report it before loading
        protocol_path = created_path or socket_name(sock)
        http_socks, http_path = bind_http(daemon, protocol_path, adopted_http)
        closers.extend((s, None) for s in http_socks)
        if http_path:
            closers.append((None, http_path))
            logger.info("HTTP APIs on %s", http_path)
        if daemon.http_port is not None:
            logger.info("HTTP APIs on %s:%d", daemon.http_host, daemon.http_port)
    return metrics_sock, sock, created_path, http_socks


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


def _close_all(closers: list) -> None:
    for sock, path in reversed(closers):
        close_socket(sock, path)


def serve(daemon: DaemonConfig, engine_config: EngineConfig) -> int:
    return uvloop.run(_serve(daemon, engine_config))
