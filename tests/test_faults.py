"""Fault injection on the real daemon with its model in a worker process (`mp`): worker
SIGKILL twice in a row and during a restart, SIGSTOP (a hang, caught by a short step
deadline), an idle worker killed, and too many failures (the engine declared dead).
Every request gets its final message, and each scenario prints its figures: time to
error (the fault to the last failed request's final message) and time to service (the
fault to a new request's completion). Backoffs are made small through the settings.
`pytest -s tests/test_faults.py` prints the table that docs/benchmarks.md records."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from daemon_util import Daemon, RawConn
from llmd.actors.messages import EngineState, ModelLoaded
from llmd.core.restart_policy import RestartPolicy
from llmd_tools.make_model import fixture_path

STEP_TIMEOUT_S = 3.0  # the hang test's deadline; a tiny-model step takes milliseconds
LONG = {"max_tokens": 200, "ignore_eos": True}  # ~20 tokens/s streamed: runs long enough
FIGURES: list[tuple[str, float | None, float | None]] = []


def write_config(path: Path, **settings: object) -> str:
    toml = lambda v: str(v).lower() if isinstance(v, bool) else repr(v)  # noqa: E731
    path.write_text("".join(f"{k} = {toml(v)}\n" for k, v in settings.items()))
    return str(path)


def start_daemon(tmp: Path, max_failures: int) -> Daemon:
    config = write_config(tmp / "faults.toml", worker_restart_backoff_s=0.1, worker_restart_backoff_max_s=0.4,
                          worker_max_failures=max_failures, worker_failure_window_s=600.0, http=False)
    return Daemon(str(fixture_path("tiny-llama")), tmp / "s.sock", "--distributed-executor-backend", "mp",
                  "--step-timeout-s", str(STEP_TIMEOUT_S), "--step-timeout-per-token-s", "0.01",
                  "--config", config).wait_ready(120)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("faults"), max_failures=50)
    yield d
    assert d.stop() == 0, d.stderr()


def workers(d: Daemon) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "llmd.gpu.worker.process", "-P", str(d.proc.pid)],
                         capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def new_worker(d: Daemon, old: set[int], timeout: float = 30.0) -> int:
    """The pid of a worker process the daemon started after `old` ones (it may still be
    loading the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = [pid for pid in workers(d) if pid not in old]
        if fresh:
            return fresh[0]
        time.sleep(0.01)
    raise TimeoutError(f"no new worker:\n{d.stderr()}")


def status(d: Daemon) -> dict:
    with RawConn(d.sock) as conn:
        conn.send({"type": "status"})
        return conn.recv()


def wait_status(d: Daemon, done, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = status(d)
        if done(reply):
            return reply
        time.sleep(0.02)
    raise TimeoutError(f"status never matched; last {reply}\n{d.stderr()}")


def submit(conn: RawConn, ident: str, sampling: dict) -> None:
    conn.send({"type": "submit", "id": ident, "prompt": "hello", "sampling": sampling})


def started(conn: RawConn, idents: list[str]) -> None:
    """Wait until each request is accepted and has streamed a token (it runs on the worker)."""
    waiting = set(idents)
    while waiting:
        message = conn.recv()
        if message["type"] == "output" and message.get("token_ids"):
            waiting.discard(message["id"])
        assert message.get("finish_reason") is None, message


def finals(conn: RawConn, idents: list[str]) -> dict[str, dict]:
    """Each request's final message (the one with usage), whatever order they come in."""
    final: dict[str, dict] = {}
    while len(final) < len(idents):
        message = conn.recv()
        if message.get("id") in idents and (message["type"] == "error" or message.get("usage") is not None):
            final[message["id"]] = message
    return final


def served(d: Daemon, ident: str) -> dict:
    with RawConn(d.sock) as conn:
        submit(conn, ident, {"max_tokens": 4, "temperature": 0})
        final = conn.until_final(ident)[-1]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 4, final
    return final


def record(name: str, time_to_error: float | None, time_to_service: float | None) -> None:
    FIGURES.append((name, time_to_error, time_to_service))
    shown = lambda t: "-" if t is None else f"{t:.2f} s"  # noqa: E731
    print(f"\n{name}: time to error {shown(time_to_error)}, time to service {shown(time_to_service)}")


def assert_lost(final: dict, cause: str) -> None:
    assert final["finish_reason"] == "error", final
    assert cause in final["error"] and final["error"].endswith("the request was lost"), final


# -- the scenarios ------------------------------------------------------------------------

def test_worker_killed_twice_in_a_row(daemon):
    restarts = status(daemon)["engine_restarts"]
    with RawConn(daemon.sock) as conn:
        first = workers(daemon)
        for ident in ("a1", "a2", "a3"):
            submit(conn, ident, LONG)
        started(conn, ["a1", "a2", "a3"])
        killed = time.monotonic()
        os.kill(first[0], signal.SIGKILL)
        for final in finals(conn, ["a1", "a2", "a3"]).values():
            assert_lost(final, f"(pid {first[0]}) exited with signal SIGKILL")
        first_error = time.monotonic() - killed
        # The next requests wait for the new worker; it dies under them too.
        for ident in ("b1", "b2"):
            submit(conn, ident, LONG)
        started(conn, ["b1", "b2"])
        second = new_worker(daemon, set(first))
        killed_again = time.monotonic()
        os.kill(second, signal.SIGKILL)
        for final in finals(conn, ["b1", "b2"]).values():
            assert_lost(final, f"(pid {second}) exited with signal SIGKILL")
        second_error = time.monotonic() - killed_again
    served(daemon, "c")
    record("SIGKILL, running requests (1st)", first_error, None)
    record("SIGKILL again, on the restarted worker (2nd)", second_error, time.monotonic() - killed_again)
    reply = status(daemon)
    assert reply["engine_state"] == "serving" and reply["engine_restarts"] == restarts + 2
    assert "SIGKILL" in reply["engine_error"]


def test_worker_killed_during_restart(daemon):
    restarts = status(daemon)["engine_restarts"]
    with RawConn(daemon.sock) as conn:
        first = workers(daemon)
        submit(conn, "a", LONG)
        started(conn, ["a"])
        killed = time.monotonic()
        os.kill(first[0], signal.SIGKILL)
        assert_lost(finals(conn, ["a"])["a"], "exited with signal SIGKILL")
        time_to_error = time.monotonic() - killed
        # Killed while it loads the model: a failed restart, tried again after a backoff.
        loading = new_worker(daemon, set(first))
        os.kill(loading, signal.SIGKILL)
        reply = wait_status(daemon, lambda s: s["engine_restarts"] == restarts + 2)
        assert reply["engine_state"] == "restarting" and "restart failed" in reply["engine_error"], reply
        # A request sent while restarting waits for the new worker, then is served.
        submit(conn, "b", {"max_tokens": 4, "temperature": 0})
        final = conn.until_final("b")[-1]
        assert final["finish_reason"] == "length", final
    record("SIGKILL, then the new worker killed while loading", time_to_error, time.monotonic() - killed)
    assert wait_status(daemon, lambda s: s["engine_state"] == "serving")["engine_restarts"] == restarts + 2


def test_hung_worker_is_killed_and_replaced(daemon):
    with RawConn(daemon.sock) as conn:
        pid = workers(daemon)[0]
        submit(conn, "a", LONG)
        started(conn, ["a"])
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        final = finals(conn, ["a"])["a"]
        time_to_error = time.monotonic() - stopped
        assert_lost(final, "worker hung: no reply to a step of")
        assert f"within {STEP_TIMEOUT_S + 0.01:.1f} s" in final["error"], final
        assert STEP_TIMEOUT_S - 0.5 < time_to_error < STEP_TIMEOUT_S + 5, time_to_error
        try:
            os.kill(pid, signal.SIGCONT)  # too late: it was killed
        except ProcessLookupError:
            pass
    served(daemon, "b")
    record(f"SIGSTOP (hang; step deadline {STEP_TIMEOUT_S:g} s + 0.01 s/token)", time_to_error,
           time.monotonic() - stopped)
    assert pid not in workers(daemon)
    assert "worker hung" in daemon.stderr()


def test_idle_worker_death_is_noticed_and_the_next_request_served(daemon):
    pid = workers(daemon)[0]
    restarts = status(daemon)["engine_restarts"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    reply = wait_status(daemon, lambda s: s["engine_restarts"] == restarts + 1, timeout=5)
    noticed = time.monotonic() - killed
    assert noticed < 1.0, noticed
    assert f"(pid {pid}) exited with signal SIGKILL" in reply["engine_error"], reply
    final = served(daemon, "after")  # waits for the restart if it is still under way
    record("SIGKILL while idle (noticed / next request served)", noticed, time.monotonic() - killed)
    assert "error" not in final


def test_too_many_failures_declare_the_engine_dead(tmp_path):
    d = start_daemon(tmp_path, max_failures=3)
    try:
        with RawConn(d.sock) as conn:
            old = set(workers(d))
            submit(conn, "a", LONG)
            started(conn, ["a"])
            os.kill(next(iter(old)), signal.SIGKILL)
            assert_lost(finals(conn, ["a"])["a"], "exited with signal SIGKILL")
            submit(conn, "b", LONG)  # waits for (or runs on) the next worker
            for _ in range(2):
                pid = new_worker(d, old)
                old.add(pid)
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
            final = finals(conn, ["b"])["b"]
            time_to_error = time.monotonic() - killed
            # It never ran (each new worker was killed while loading): it ends with the death.
            assert final["finish_reason"] == "error", final
            assert final["error"].startswith("the engine is dead after 3 worker failures within 600 s; the last: "
                                             "worker restart failed: worker process 0 "), final
        code = d.proc.wait(30)
        time_to_exit = time.monotonic() - killed
    finally:
        d.stop()
    assert code == 1, d.stderr()
    assert "the engine is dead after 3 worker failures" in d.stderr()
    assert not workers(d)
    record("3rd failure in the window: engine dead, daemon exits 1 (error / exit)", time_to_error, time_to_exit)


def test_figures_table():
    """The figures of the scenarios above, as docs/benchmarks.md shows them."""
    print("\n| scenario | time to error | time to service |\n|---|---|---|")
    for name, to_error, to_service in FIGURES:
        print(f"| {name} | {'-' if to_error is None else f'{to_error:.2f} s'} | "
              f"{'-' if to_service is None else f'{to_service:.2f} s'} |")


# -- the pieces, without a model -----------------------------------------------------------

def test_restart_backoff_doubles_to_its_cap_and_too_many_failures_are_death():
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=4.0, max_failures=5, window_s=600.0)
    assert [policy.record_failure(t) for t in (0, 10, 20, 30)] == [1.0, 2.0, 4.0, 4.0]
    assert policy.record_failure(40) is None  # the 5th within 600 s
    spaced = RestartPolicy(backoff_s=1.0, max_failures=2, window_s=60.0)
    assert [spaced.record_failure(t) for t in (0, 61, 122)] == [1.0, 1.0, 1.0]  # never 2 in a window
    assert spaced.total_failures == 3


def test_health_and_status_say_restarting_and_dead():
    from llmd.actors.metrics import MetricsActor
    from llmd_client.llmctl import format_status

    metrics = MetricsActor(default_model="m", server_version="0")
    asyncio.run(metrics.handle(ModelLoaded(model="m", device="cpu", dtype="float32", kv_blocks_total=8)))
    assert metrics.health() == (True, "idle")
    asyncio.run(metrics.handle(EngineState("restarting", 2, "worker process 0 (pid 7) exited with signal SIGKILL")))
    assert metrics.health()[0] is False
    shown = format_status(metrics.status(0, True))
    assert "engine       restarting (2): worker process 0 (pid 7) exited with signal SIGKILL" in shown
    asyncio.run(metrics.handle(EngineState("dead", 5, "the engine is dead after 5 worker failures")))
    healthy, why = metrics.health()
    assert not healthy and why.startswith("engine dead")
    assert metrics.status(0, True).engine_state == "dead"


def test_watchdog_is_fed_only_while_the_engine_makes_progress(monkeypatch, caplog):
    from llmd.server import sd_notify
    from llmd.server.watchdog import feed_watchdog as _watchdog

    fed: list[float] = []
    monkeypatch.setattr(sd_notify, "watchdog", lambda: fed.append(time.monotonic()))
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a check every 10 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    stuck_from = time.monotonic() + 0.2  # from then on a step is past its deadline

    async def run() -> None:
        task = asyncio.ensure_future(_watchdog(lambda now: now < stuck_from))
        await asyncio.sleep(0.5)
        task.cancel()

    asyncio.run(run())
    assert len(fed) >= 5 and max(fed) < stuck_from
    assert [r.message for r in caplog.records].count(
        "an engine step is stuck past its deadline: no longer feeding the systemd watchdog") == 1


def test_sigterm_under_load_gives_every_request_its_final_message(tmp_path):
    """Twelve clients streaming when SIGTERM comes: each gets a final message (finished
    in the drain, or aborted when it outlasts it), and the daemon exits 0."""
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path / "s.sock", "--drain-timeout-s", "0.25",
               "--max-model-len", "1024").wait_ready()
    conns = [RawConn(d.sock) for _ in range(12)]
    try:
        # All twelve sent before any answer is read, so the long ones start together and
        # SIGTERM comes right after: the tiny model decodes fast enough (C++ layers, ~1 ms
        # a step) that a long one sent first and waited on would near 1000 tokens.
        for i, conn in enumerate(conns):
            tokens = 5 if i % 2 else 1000  # half finish within the drain, half outlast it
            conn.send({"type": "submit", "id": "q", "prompt": "hi", "sampling": {"max_tokens": tokens,
                                                                                 "ignore_eos": True}})
        assert [conn.recv()["type"] for conn in conns] == ["accepted"] * 12
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        finals = [conn.until_final("q")[-1] for conn in conns]
        # The long ones cannot finish 1000 tokens in the drain; the short ones may or may
        # not (a loaded machine), but each has its final message either way.
        assert [f["finish_reason"] for f in finals[::2]] == ["abort"] * 6
        assert {f["finish_reason"] for f in finals[1::2]} <= {"length", "abort"}
        assert d.proc.wait(30) == 0
        FIGURES.append(("SIGTERM with 12 streaming clients (1 s drain)", time.monotonic() - started, None))
    finally:
        for conn in conns:
            conn.close()
        d.stop()


def test_a_log_that_cannot_be_written_does_not_stop_service(tmp_path):
    """stderr on a full disk (/dev/full: every write fails with ENOSPC): the daemon still
    starts, serves and stops cleanly."""
    sock = tmp_path / "s.sock"
    with open("/dev/full", "wb") as full:
        proc = subprocess.Popen([*Daemon.command(str(fixture_path("tiny-llama")), str(sock)), "--log-level", "debug"],
                                stdout=full, stderr=full, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with RawConn(str(sock)) as conn:
                    conn.send({"type": "submit", "id": "a", "prompt": "hi", "sampling": {"max_tokens": 4}})
                    assert conn.until_final("a")[-1]["usage"]["completion_tokens"] == 4
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
