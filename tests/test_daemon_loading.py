"""Clients while the model loads (issue 25, rows 4 and 5): the serving limits hold, a
client that goes away frees its descriptor at once, and every connection made during
the load goes on after the hand-over to the intake (hello- and status-only ones were
closed there: `llmctl chat` started during a load failed on its first line)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from pathlib import Path

import msgspec
import uvloop

from daemon_util import Daemon, RawConn
from llmd.actors.loading import LoadingResponder
from llmd.load_progress import LoadProgress
from llmd_tools.make_model import fixture_path


def test_connections_made_during_the_load_survive_the_hand_over(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    d = Daemon(str(fixture_path("small-llama")), path)
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert time.monotonic() < deadline and d.proc.poll() is None
            time.sleep(0.01)
        with RawConn(str(path)) as hello, RawConn(str(path), json_mode=True) as status:
            hello.send({"type": "hello", "protocol_version": 1})
            assert hello.recv()["type"] == "welcome"
            status.send({"type": "status"})
            assert status.recv()["engine_state"] == "loading"  # the hand-over is ahead
            d.wait_ready(120)
            hello.send({"type": "submit", "id": "a", "prompt": "hi", "sampling": {"max_tokens": 3}})
            assert hello.until_final("a")[-1]["usage"]["completion_tokens"] == 3
            status.send({"type": "status"})
            assert status.recv()["engine_state"] == "serving"
    finally:
        assert d.stop() == 0, d.stderr()


def _submit_frame() -> bytes:
    body = msgspec.msgpack.encode({"type": "submit", "prompt": "x" * 1000, "sampling": {"max_tokens": 3}})
    return len(body).to_bytes(4, "big") + body


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_serving_limits_hold_while_loading(tmp_path: Path) -> None:
    """In-process, against the responder alone: 300 clients that submit and hang up are
    forgotten at once (no descriptor, no frame kept); one that stays keeps its frames
    for the intake; a silent one meets the idle timeout; past the per-user limit a
    client is told `overloaded`."""
    async def main() -> None:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "l.sock"))
        listener.listen(512)
        # The idle timeout is long while 300 connections come and go (on a loaded machine
        # that can take longer than a short one), short for the silent client after.
        responder = LoadingResponder(listener, LoadProgress(), model="m", server_version="v",
                                     max_connections=1000, max_connections_per_user=310, idle_timeout_s=60.0)
        await responder.start()
        try:
            before = _open_fds()
            stays_r, stays_w = await asyncio.open_unix_connection(str(tmp_path / "l.sock"))
            stays_w.write(_submit_frame() * 2)
            await stays_w.drain()
            for _ in range(300):
                _, w = await asyncio.open_unix_connection(str(tmp_path / "l.sock"))
                w.write(_submit_frame())
                await w.drain()
                w.close()
            deadline = time.monotonic() + 10
            while len(responder._connections) > 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert [len(h.frames) for h in responder._connections] == [2]  # the one that stays
            responder.idle_timeout_s = 0.5
            silent = await asyncio.open_unix_connection(str(tmp_path / "l.sock"))
            deadline = time.monotonic() + 10
            while len(responder._connections) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(responder._connections) == 2  # the silent one is held, for now
            # past the idle timeout: the silent one goes, the other stays
            assert await asyncio.wait_for(silent[0].read(), 10) == b""
            assert [len(h.frames) for h in responder._connections] == [2]
            # Descriptors: the test's own client end of the one that stays, and its server end.
            assert _open_fds() <= before + 4
            # The per-user limit (310; this test's connections are all one user's). Opening
            # 310 connections can take longer than the idle timeout on a loaded machine: the
            # first would be closed, and the last let in.
            responder.idle_timeout_s = 60.0
            extra = [await asyncio.open_unix_connection(str(tmp_path / "l.sock")) for _ in range(310)]
            for _, w in extra:
                w.write(b"{")
            reply = await asyncio.wait_for(extra[-1][0].readline(), 5)
            assert b'"overloaded"' in reply and b"too many connections from this user" in reply
            for _, w in extra:
                w.close()
            stays_w.close()
        finally:
            responder.close()
            listener.close()

    asyncio.run(main())


def test_a_frame_read_as_the_load_fails_is_dropped_not_answered_on_the_closed_connection(tmp_path: Path) -> None:
    """The load failed and close() closed every client while one's status frame was
    already read: answering it wrote to a closed transport (uvloop's RuntimeError, an
    unhandled exception with its traceback in the daemon's log, seen in about half of
    the starts whose load failed while a client polled status)."""
    async def main() -> None:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "l.sock"))
        listener.listen(16)
        responder = LoadingResponder(listener, LoadProgress(), model="m", server_version="v")
        await responder.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "l.sock"))
            status = msgspec.msgpack.encode({"type": "status"})
            writer.write(len(status).to_bytes(4, "big") + status)
            await writer.drain()
            assert (await reader.readexactly(4))  # the first status answered: the codec is set
            held = responder._connections[0]
            responder.close(None)  # what a failed load does, with this frame's twin still to answer
            await asyncio.sleep(0.05)  # the transport's close completes
            assert responder._answer(held, status) is True  # taken, and nothing written
            writer.close()
        finally:
            responder.close()
            listener.close()

    uvloop.run(main())  # the daemon's loop: stock asyncio ignores a write to a closed transport


def test_a_failed_load_exits_while_clients_flood_it_and_never_read(tmp_path: Path) -> None:
    """Four clients send status frames as fast as they can and never read the replies
    while the load fails (max_model_len past the model's positions): the daemon exits 1
    naming the cause, with no traceback, while they still send. Before, the loading
    responder closed such clients gracefully, a close that waits for the client to read
    what backed up; their tasks' reads never ended and the daemon hung in asyncio's
    teardown until they went away (1 start in 3-5; four starts here)."""
    for attempt in range(4):
        path = tmp_path / f"s{attempt}.sock"
        d = Daemon(str(fixture_path("tiny-qwen3")), path, "--max-model-len", "4096")
        conns: list[RawConn] = []
        try:
            deadline = time.monotonic() + 60
            while not path.exists():
                assert time.monotonic() < deadline and d.proc.poll() is None
                time.sleep(0.005)
            conns = [RawConn(str(path), timeout=2.0) for _ in range(4)]
            deadline = time.monotonic() + 15
            while d.proc.poll() is None:
                assert time.monotonic() < deadline, f"start {attempt}: still running 15 s on"
                for conn in conns:
                    with contextlib.suppress(OSError):
                        conn.send({"type": "status"})
                time.sleep(0.001)
            assert d.proc.poll() == 1
            log = d.log.read_text()
            assert "max_model_len 4096 exceeds the model's max_position_embeddings" in log
            assert "Traceback" not in log, log
        finally:
            for conn in conns:
                conn.close()
            d.stop()
