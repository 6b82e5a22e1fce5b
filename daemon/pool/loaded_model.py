"""One loaded model: its engine (worker processes or in-process model, KV cache), its
scheduler and detokenizer actors, the thread all its torch work runs on, and what the
HTTP faces say of it (ServedModel). `load` builds it; `stop` takes it down and frees
its memory: the actors stop, the executor shuts down (worker processes exit; an
in-process model loses its last reference), and the freed memory goes back to the
system. Several can run side by side, each with its own thread (a load never stalls
another model's steps)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from llmd.actors.detokenizer_actor import DetokenizerActor
from llmd.actors.messages import ChangeSleep, ModelLoaded, ModelSlept, ModelUnloaded
from llmd.actors.runtime import Actor
from llmd.actors.scheduler_actor import SchedulerActor
from llmd.core.restart_policy import RestartPolicy
from llmd.daemon_config import DaemonConfig
from llmd.heap import release_memory
from llmd.load_progress import LoadProgress
from llmd.pool.estimate import loaded_need
from llmd.pool.registry import ModelSpec

logger = logging.getLogger("llmd.pool")
DETOKENIZER_DRAIN_S = 2.0  # at a stop: how long its last outputs (a dead engine's finals) may take
# (model, reason, requests_ended): its engine or an actor died.
OnFailed = Callable[[Any, str, bool], None]


class LoadedModel:
    def __init__(self, spec: ModelSpec, engine: Any, served: Any, scheduler: SchedulerActor,
                 detokenizer: DetokenizerActor, thread: ThreadPoolExecutor, metrics: Actor) -> None:
        self.spec, self.engine, self.served = spec, engine, served
        self.scheduler, self.detokenizer, self.thread, self.metrics = scheduler, detokenizer, thread, metrics
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def input_processor(self) -> Any:
        return self.engine.input_processor

    @classmethod
    async def load(cls, spec: ModelSpec, progress: LoadProgress, *, metrics: Actor,
                   daemon: DaemonConfig) -> LoadedModel:
        """Load `spec` on a thread of its own (the one its steps will run on)."""
        from llmd.http.context import describe_model

        loop = asyncio.get_running_loop()
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-model")
        started = time.monotonic()
        try:
            engine = await _in_thread(loop, thread, progress, _new_engine, spec, progress)
        except BaseException:
            thread.shutdown(wait=False, cancel_futures=True)
            raise
        try:
            served = await _in_thread(loop, thread, progress, describe_model, engine, spec.names,
                                      tool_call_parser=spec.tool_call_parser,
                                      guided_tool_calls=daemon.guided_tool_calls, task=engine.config.task)
        except BaseException:
            engine.shutdown()
            thread.shutdown(wait=False, cancel_futures=True)
            raise
        detokenizer = DetokenizerActor(engine.tokenizer, metrics)
        scheduler = SchedulerActor(engine, detokenizer, metrics, thread, RestartPolicy(
            backoff_s=daemon.worker_restart_backoff_s, backoff_max_s=daemon.worker_restart_backoff_max_s,
            max_failures=daemon.worker_max_failures, window_s=daemon.worker_failure_window_s), model=spec.name)
        detokenizer.scheduler = scheduler
        metrics.send(ModelLoaded(model=spec.name, device=str(engine.device),
                                 dtype=str(engine.dtype).removeprefix("torch."), kv_blocks_total=engine.num_blocks,
                                 kv_cache_dtype=engine.kv_cache_dtype, kv_cache_scales=engine.kv_cache_scales,
                                 memory=_weak_memory(engine), load_seconds=time.monotonic() - started))
        return cls(spec, engine, served, scheduler, detokenizer, thread, metrics)

    def held_memory(self) -> dict[str, int]:
        """Device -> bytes its weights and KV pool hold (what the budget counts). Asleep:
        no KV pool, and the weights at level 1 in host memory ("cpu", pinned for a GPU
        model), at level 2 none."""
        m = self.engine.memory()
        if m.sleep_level is not None:
            return {"cpu": sum(m.weights.values())} if m.weights else {}
        return loaded_need(str(self.engine.device), sum(m.weights.values()), m.kv_cache,
                           self.spec.engine.tensor_parallel_size)

    async def sleep(self, level: int) -> None:
        """Free its KV cache and keep (1) or drop (2) its weights (llmd.engine.LLMEngine.sleep);
        only while it has no request. Its worker processes stay."""
        await self._change_sleep(level)

    async def wake_up(self) -> None:
        """Restore what sleep freed (level 2: the weights read from the files again)."""
        await self._change_sleep(None)

    async def _change_sleep(self, level: int | None) -> None:
        """Through its scheduler actor, which owns the engine and runs it between steps."""
        started = time.monotonic()
        done = asyncio.get_running_loop().create_future()
        self.scheduler.send(ChangeSleep(level, done))
        await done
        self.metrics.send(ModelSlept(model=self.name, level=level, seconds=time.monotonic() - started))

    def start(self, on_failed: OnFailed) -> None:
        """Run its actors; `on_failed` hears of its engine's death or an actor's."""
        loop = asyncio.get_running_loop()
        for actor in (self.detokenizer, self.scheduler):
            task = loop.create_task(actor.run(), name=f"actor:{actor.name}:{self.name}")
            task.add_done_callback(lambda t, name=actor.name: self._actor_ended(name, t, on_failed))
            self._tasks.append(task)
        watch = loop.create_task(self._watch_engine(on_failed), name=f"engine-watch:{self.name}")
        self._tasks.append(watch)

    async def _watch_engine(self, on_failed: OnFailed) -> None:
        await self.scheduler.dead.wait()
        on_failed(self, f"its engine is dead ({self.scheduler.dead_error})", True)

    def _actor_ended(self, name: str, task: asyncio.Task, on_failed: OnFailed) -> None:
        if self._stopping or task.cancelled():
            return
        exc = task.exception()
        logger.error("model %s: actor %s %s", self.name, name, "died" if exc else "returned", exc_info=exc)
        on_failed(self, f"its {name} actor stopped ({type(exc).__name__ if exc else 'returned'})", False)

    async def stop(self) -> None:
        """Stop its actors (after the detokenizer hands out what it holds), shut its
        executor down and let go of everything, then give the freed memory back."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DETOKENIZER_DRAIN_S
        while not self.detokenizer.inbox.empty() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        self.metrics.send(ModelUnloaded(model=self.name))
        engine, self.engine, self.served, self.scheduler, self.detokenizer = self.engine, None, None, None, None
        self.thread.shutdown(wait=False)
        try:
            await loop.run_in_executor(None, engine.shutdown)
        finally:
            del engine
            await loop.run_in_executor(None, release_memory)


def _new_engine(spec: ModelSpec, progress: LoadProgress) -> Any:
    """The engine, built on the model's thread (torch is imported there too, the first
    time: the event loop goes on answering meanwhile)."""
    from llmd.engine import LLMEngine

    return LLMEngine(spec.engine, progress)


async def _in_thread(loop: asyncio.AbstractEventLoop, thread: ThreadPoolExecutor, progress: LoadProgress,
                     fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on the model's thread. If the awaiting task is cancelled,
    the load is told to give up and is waited for (no half-built engine is left
    running unowned)."""
    future = loop.run_in_executor(thread, lambda: fn(*args, **kwargs))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        progress.cancel()
        with contextlib.suppress(BaseException):
            result = await future
            if hasattr(result, "shutdown"):
                result.shutdown()
        raise


def _weak_memory(engine: Any) -> Callable[[], Any]:
    """engine.memory for the metrics actor, without keeping the engine alive: a model
    being unloaded must have no reference left."""
    ref = weakref.ref(engine)

    def memory() -> Any:
        live = ref()
        return live.memory() if live is not None else None

    return memory


async def estimate_memory(spec: ModelSpec) -> dict[str, int]:
    """Device -> bytes `spec` will hold once loaded (llmd.pool.estimate), read off the
    event loop."""
    return await asyncio.to_thread(_estimate_memory, spec)


def _estimate_memory(spec: ModelSpec) -> dict[str, int]:
    import psutil

    from llmd.builtin_model import builtin_model_path
    from llmd.pool.estimate import estimate_need, read_shape

    device, total = spec.engine.device, None
    if device != "cpu":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
    shape = read_shape(spec.path or str(builtin_model_path()))
    return estimate_need(spec.engine, shape, device, available_ram=psutil.virtual_memory().available,
                         device_total=total)
