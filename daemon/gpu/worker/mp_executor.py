"""The multiprocess executor: one worker process per device (`python -m
llmd.gpu.worker.process`, started fresh: nothing is pickled and the parent's __main__ is
never re-imported), SchedulerOutputs broadcast as msgpack bytes over socketpairs,
RunnerOutputs from rank 0, one per step in order, read when a step's handle is asked
for its output (RemoteStep). A step's grammar bitmask rows follow it to rank 0 (the rank
that samples) in a second message, sent once they are filled: the worker's forward runs
meanwhile, and it reads them just before sampling. Rank r runs on cuda:r on CUDA
(cuda:(i + r) when given cuda:i), on the CPU otherwise. With world_size > 1 (tensor parallelism) the workers also
form a process group, NCCL on CUDA and gloo on CPU, that meets through a file in a
private (0700) temporary directory made here: no TCP port, so nothing to race for, and
nobody else on the machine can join. Every rank runs every step. A worker that dies
closes its end of the pair, so the parent sees EOF at once and raises WorkerError naming
how it exited. A worker that stops answering (stopped, deadlocked) is caught by the
step's deadline (`step_deadline`): it is killed and the step raises WorkerError saying
it hung. Between steps, `exit_fds()` lets the caller watch for a worker that exits.

The parent never touches CUDA beyond counting devices: the model, its memory profile
and the KV cache live in the workers only."""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Callable

import msgspec

from llmd.core.executor import ExecutorError
from llmd.gpu.worker.kv_budget import MemoryBreakdown
from llmd.gpu.worker.runner_types import RunnerSettings
from llmd.load_progress import LoadCancelled
from llmd.gpu.worker.process import (Execute, Flush, FromWorker, GrammarBitmask, InitKVCache, KVBudget, KVReady,
                                     ProfileKV, Shutdown, Sleep, SleepState, StepReply, WakeUp, WorkerFailed,
                                     WorkerInit, WorkerReady)
from llmd.core.step_messages import GrammarRows, RunnerOutput, SchedulerOutput

logger = logging.getLogger("llmd.executor")
CANCEL_POLL_S = 0.1  # how often a load's wait for its workers looks at the cancel


class WorkerError(ExecutorError):
    """A worker failed to start, raised, or died. The message names the cause."""


class RemoteStep:
    """A step sent to the workers (the step contract's handle): `output()` reads its
    RunnerOutput back, after those of the steps launched before it."""

    def __init__(self, executor: MultiprocExecutor, num_tokens: int) -> None:
        self._executor = executor
        self.num_tokens = num_tokens
        self.result: RunnerOutput | None = None
        self.flushed = False

    def output(self) -> RunnerOutput:
        if self.result is None:
            self._executor._read_until(self)
        return self.result


class MultiprocExecutor:
    def __init__(self, model_dir: str, settings: RunnerSettings, device, dtype, world_size: int = 1,
                 start_timeout: float = 600.0,
                 step_deadline: Callable[[int], float | None] = lambda num_tokens: None,
                 cancelled: threading.Event | None = None) -> None:
        """`step_deadline(num_tokens)`: seconds a step may go unanswered before its
        workers count as hung and are killed (None: no limit). `cancelled`, once set,
        ends a wait for the workers' start, KV profile or KV cache: they are killed and
        LoadCancelled raised (the daemon stopped while it loaded)."""
        if world_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self.bytes_sent_last_step = 0
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._step_deadline = step_deadline
        self._cancelled = cancelled
        self._unread: collections.deque[RemoteStep] = collections.deque()  # launched, result not read yet
        self._pidfds: list[int] = []
        self._rendezvous_dir: str | None = None
        dtype_name = str(dtype).removeprefix("torch.")
        devices = worker_devices(device, world_size)  # refuses before anything is spawned
        backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        torch_threads = None
        if world_size > 1 and backend == "gloo":
            torch_threads = max(1, (os.cpu_count() or 1) // world_size)  # ranks share the cores
        try:
            init_method = None
            if world_size > 1:
                self._rendezvous_dir = tempfile.mkdtemp(prefix="llmd-dist-")  # mode 0700
                init_method = "file://" + os.path.join(self._rendezvous_dir, "rendezvous")
            for rank in range(world_size):
                parent_sock, child_sock = socket.socketpair()
                proc = subprocess.Popen([sys.executable, "-m", "llmd.gpu.worker.process", str(child_sock.fileno())],
                                        pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL)
                child_sock.close()
                conn = Connection(os.dup(parent_sock.fileno()))
                parent_sock.close()
                self.procs.append(proc)
                self.conns.append(conn)
                init = WorkerInit(rank=rank, world_size=world_size, model_dir=str(model_dir),
                                  device=devices[rank], dtype=dtype_name, settings=dataclasses.asdict(settings),
                                  torch_threads=torch_threads, dist_backend=backend,
                                  dist_init_method=init_method)
                conn.send_bytes(msgspec.msgpack.encode(init))
            ready = self._recv_all(start_timeout)
            for rank, message in enumerate(ready):
                if not isinstance(message, WorkerReady):
                    raise WorkerError(f"worker {rank} did not start: unexpected {type(message).__name__}")
        except BaseException:
            self.shutdown()
            raise
        self._bytes_per_block = min(m.bytes_per_block for m in ready)
        self._weight_bytes: dict[str, int] = {}
        for message in ready:
            for kind, n in message.weight_bytes.items():
                self._weight_bytes[kind] = self._weight_bytes.get(kind, 0) + n
        self._kv_scales = ready[0].kv_scales  # every rank's source is the same
        self.pids = [p.pid for p in self.procs]

    def _recv(self, rank: int, timeout: float | None) -> object:
        conn, proc = self.conns[rank], self.procs[rank]
        if not wait([conn], timeout):
            raise WorkerError(f"worker {rank} did not answer within {timeout:.0f} s")
        try:
            message = self._decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
            raise WorkerError(f"worker process {rank} (pid {proc.pid}) {exit_text(proc.returncode)}") from None
        if isinstance(message, WorkerFailed):
            raise WorkerError(f"worker {rank} failed: {message.message}")
        return message

    def _recv_all(self, timeout: float, check=None) -> list[object]:
        """One message from every rank, in whatever order they come: a rank that fails
        is reported at once (the others may be blocked waiting for it in a collective).
        `check(rank, message)`, when given, sees each message as it comes and may raise.
        The load's cancel ends the wait (LoadCancelled)."""
        messages: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(messages) < len(self.conns):
            pending = [c for r, c in enumerate(self.conns) if r not in messages]
            left = deadline - time.monotonic()
            if self._cancelled is not None:
                if self._cancelled.is_set():
                    raise LoadCancelled("the daemon stopped while the workers loaded")
                left = min(left, CANCEL_POLL_S)
            ready = wait(pending, max(left, 0.0))
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                rank = next(r for r in range(len(self.conns)) if r not in messages)
                raise WorkerError(f"worker {rank} did not answer within {timeout:.0f} s")
            for conn in ready:
                rank = self.conns.index(conn)
                messages[rank] = self._recv(rank, 0)
                if check is not None:
                    check(rank, messages[rank])
        return [messages[r] for r in range(len(self.conns))]

    def _recv_step(self, num_tokens: int) -> object:
        """Rank 0's reply to a step of `num_tokens` tokens, within the step's deadline;
        past it the workers are killed (a stopped process cannot be asked to exit) and
        the step fails as a hang. With several ranks, anything readable from another
        rank first is its failure (only rank 0 replies), which _recv raises."""
        limit = self._step_deadline(num_tokens)
        ready = wait(self.conns, limit)
        if not ready:
            pids = ", ".join(str(p.pid) for p in self.procs)
            self.kill()
            raise WorkerError(f"worker hung: no reply to a step of {num_tokens} tokens within {limit:.1f} s "
                              f"(killed worker pid {pids})")
        if self.conns[0] not in ready:
            rank = self.conns.index(ready[0])
            self._recv(rank, 0)
            raise WorkerError(f"worker {rank} sent an unexpected message")
        return self._recv(0, 0)

    def _broadcast(self, message: object) -> None:
        data = self._encoder.encode(message)
        self.bytes_sent_last_step = len(data)
        for rank in range(len(self.conns)):
            self._send(rank, data)

    def _send(self, rank: int, data: bytes) -> None:
        try:
            self.conns[rank].send_bytes(data)
        except OSError:
            proc = self.procs[rank]
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
            raise WorkerError(f"worker process {rank} (pid {proc.pid}) {exit_text(proc.returncode)}") from None

    def _send_grammar_rows(self, grammar_rows: GrammarRows) -> None:
        """The step's grammar rows to rank 0 (the rank that samples), once they are filled:
        the step went first, so the workers' forward runs while they are."""
        self._send(0, self._encoder.encode(GrammarBitmask(grammar_rows.wait())))

    def exit_fds(self) -> list[int]:
        """One descriptor per worker that becomes readable when the worker process
        exits (a pidfd), for watching the workers while no step runs; owned here."""
        if not self._pidfds and hasattr(os, "pidfd_open"):
            try:
                for proc in self.procs:
                    self._pidfds.append(os.pidfd_open(proc.pid))
            except OSError as exc:  # a kernel before 5.3, or a seccomp filter: seen at the next step
                for fd in self._pidfds:
                    os.close(fd)
                self._pidfds = []
                logger.warning("cannot watch the worker processes between steps (%s); a worker that "
                               "exits while idle is noticed at the next request", exc.strerror)
        return self._pidfds

    def exit_cause(self) -> str | None:
        """How the first worker that exited did, or None while all run."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                return f"worker process {rank} (pid {proc.pid}) {exit_text(proc.returncode)}"
        return None

    def _stop_loading(self) -> None:
        """SIGTERM the workers (one building kernels kills its compilers and exits); SIGKILL
        those still there after 5 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        until = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def kill(self) -> None:
        """SIGKILL every worker (it reaches a stopped process too)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def kv_cache_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def weight_bytes(self) -> dict[str, int]:
        """Every rank's weight bytes, by how they are kept (summed over ranks)."""
        return dict(self._weight_bytes)

    def kv_scale_source(self) -> str:
        """Where the quantized KV cache's scales come from (ModelRunner.kv_scale_source)."""
        return self._kv_scales

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def profile_kv_budget(self, gpu_memory_utilization: float,
                          extra_reserved_bytes: int = 0) -> list[MemoryBreakdown]:
        """Every rank profiles its own device (they run the forward together: it has
        collectives); one breakdown per rank. A budget too small is a ValueError."""
        self._broadcast(ProfileKV(gpu_memory_utilization, extra_reserved_bytes))
        many = len(self.conns) > 1

        def check(rank: int, reply: object) -> None:
            # At once: a rank whose profile step ran out of memory leaves the others
            # waiting in a collective.
            if not isinstance(reply, KVBudget):
                raise WorkerError(f"worker {rank} sent {type(reply).__name__} instead of its KV budget")
            if reply.error is not None:
                raise ValueError(f"tensor-parallel rank {rank}: {reply.error}" if many else reply.error)

        replies = self._recv_all(600.0, check)
        return [reply.breakdown for reply in replies]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks))
        replies = self._recv_all(600.0)
        for rank, reply in enumerate(replies):
            if not isinstance(reply, KVReady):
                raise WorkerError(f"worker {rank} did not confirm its KV cache")

    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache and keeps (level 1) or drops (level 2) its weights."""
        self._change_sleep(Sleep(level), level)

    def wake_up(self) -> None:
        """Every rank restores its weights (or loads them again) and its KV cache; this
        may take as long as a load (level 2 reads the files)."""
        self._change_sleep(WakeUp(), None)

    def _change_sleep(self, message: Sleep | WakeUp, expected: int | None) -> None:
        self._broadcast(message)
        for rank, reply in enumerate(self._recv_all(600.0)):
            if not isinstance(reply, SleepState) or (reply.level is None) != (expected is None):
                raise WorkerError(f"worker {rank} did not confirm its {type(message).__name__}")

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_rows: GrammarRows | None = None) -> RemoteStep:
        """Send the step to every rank (and its grammar rows to rank 0 once filled); its
        output comes from the handle, read back in step order (RemoteStep.output)."""
        if scheduler_output.grammar_req_ids and grammar_rows is None:
            raise ValueError("a step with guided requests needs their grammar rows")
        self._broadcast(Execute(scheduler_output))
        if scheduler_output.grammar_req_ids:
            self._send_grammar_rows(grammar_rows)
        step = RemoteStep(self, scheduler_output.total_num_scheduled_tokens)
        self._unread.append(step)
        return step

    def _read_until(self, step: RemoteStep) -> None:
        """Read rank 0's step results, one per step in launch order, until `step` has its
        own. The worker sends a step's result once its tokens are on the host or the next
        step launched: for the newest step, a Flush asks for it (a worker that sent it
        already ignores the Flush). Every unread step's tokens count for the deadline."""
        while step.result is None:
            if self._unread[-1] is step and not step.flushed:
                step.flushed = True
                self._send(0, self._encoder.encode(Flush()))  # rank 0 alone replies
            reply = self._recv_step(sum(s.num_tokens for s in self._unread))
            if not isinstance(reply, StepReply):
                raise WorkerError(f"worker 0 sent {type(reply).__name__} instead of a step result")
            self._unread.popleft().result = reply.output

    def shutdown(self) -> None:
        if self._cancelled is not None and self._cancelled.is_set():
            self._stop_loading()  # still loading: they would read the Shutdown only once loaded
        for conn in self.conns:
            try:
                conn.send_bytes(self._encoder.encode(Shutdown()))
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds = []
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None


def exit_text(returncode: int | None) -> str:
    """How a worker process ended, for people: "exited with signal SIGKILL"."""
    if returncode is None:  # its socket closed, yet it still runs
        return "closed its connection without exiting"
    if returncode < 0:
        try:
            return f"exited with signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"exited with signal {-returncode}"
    return f"exited with code {returncode}"


def worker_devices(device, world_size: int) -> list[str]:
    """Each rank's device: "cpu" for all on CPU; on CUDA cuda:(i + r) for rank r, where
    cuda:i is the device given (i = 0 for plain "cuda"). Raises ValueError when there
    are not that many devices. Counting devices creates no CUDA context here."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return ["cpu"] * world_size
    if device.type != "cuda":
        raise ValueError(f"worker processes run on cpu or cuda devices, got {str(device)!r}")
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + world_size > count:
        if count == 0:
            visible = "no CUDA device is visible"
        else:
            visible = f"only {count} CUDA device{'' if count == 1 else 's'} {'is' if count == 1 else 'are'} visible"
        if world_size == 1:
            raise ValueError(f"device {str(device)!r} is not available: {visible}")
        start = f" from cuda:{first}" if first else ""
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} CUDA devices{start} but {visible}")
    return [f"cuda:{first + r}" for r in range(world_size)]
