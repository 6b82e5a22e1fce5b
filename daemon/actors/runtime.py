"""A minimal actor runtime: each actor is an asyncio task with an inbox; a supervisor
starts them, fails the daemon loudly if one dies, and stops them in order."""
from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger("llmd.actors")


class Actor:
    name = "actor"

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()

    def send(self, message: object) -> None:
        self.inbox.put_nowait(message)

    async def run(self) -> None:
        while True:
            await self.handle(await self.inbox.get())

    async def handle(self, message: object) -> None:
        raise NotImplementedError


class Supervisor:
    """Watches actor tasks. An actor that returns or raises while the daemon runs is a
    fatal error: it is logged with its traceback and `failed` is set, so the daemon
    exits non-zero (and systemd restarts it) instead of serving with a dead part."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self._stopping = False

    def start(self, actor: Actor) -> None:
        task = asyncio.get_running_loop().create_task(actor.run(), name=f"actor:{actor.name}")
        task.add_done_callback(lambda t, name=actor.name: self._on_done(name, t))
        self.tasks[actor.name] = task

    def _on_done(self, name: str, task: asyncio.Task) -> None:
        if self._stopping or task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("actor %s died", name, exc_info=exc)
            self.failure = f"actor {name} died: {type(exc).__name__}: {exc}"
        else:
            logger.error("actor %s returned unexpectedly", name)
            self.failure = f"actor {name} stopped"
        self.failed.set()

    async def stop(self, order: list[str]) -> None:
        self._stopping = True
        for name in order:
            task = self.tasks.get(name)
            if task is None or task.done():
                continue
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
