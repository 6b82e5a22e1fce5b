"""A worker process: one per device (rank = TP rank). It loads the model, sizes its KV
cache when told, then runs SchedulerOutputs as they arrive on its pipe and (rank 0)
replies with RunnerOutputs. A step's grammar bitmask rows come to rank 0 as the next
message after the step (GrammarRows), sent once filled; the runner reads it just before
sampling, after the forward. Messages are msgspec-encoded bytes, never pickles.

The worker dies with its parent: PR_SET_PDEATHSIG on Linux, and an EOF on the pipe
everywhere (the parent's end closes when the parent exits)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from typing import Any

import msgspec

from llmd.gpu.worker.kv_budget import MemoryBreakdown
from llmd.core.step_messages import RunnerOutput, SchedulerOutput


class WorkerInit(msgspec.Struct):
    rank: int
    world_size: int
    model_dir: str
    device: str  # this rank's own: "cpu" or "cuda:N"
    dtype: str
    settings: dict[str, Any]  # RunnerSettings fields
    torch_threads: int | None = None
    # world_size > 1: the process group's backend ("nccl" on CUDA, "gloo" on CPU) and
    # its file:// rendezvous (in a private directory the parent owns).
    dist_backend: str = "gloo"
    dist_init_method: str | None = None


class WorkerReady(msgspec.Struct, tag="ready"):
    bytes_per_block: int
    pid: int


class WorkerFailed(msgspec.Struct, tag="failed"):
    message: str


class ProfileKV(msgspec.Struct, tag="profile_kv"):
    gpu_memory_utilization: float
    extra_reserved_bytes: int = 0


class KVBudget(msgspec.Struct, tag="kv_budget"):
    """The profile's breakdown, or (a budget that does not fit) the reason."""

    breakdown: MemoryBreakdown | None = None
    error: str | None = None


class InitKVCache(msgspec.Struct, tag="init_kv"):
    num_blocks: int


class Execute(msgspec.Struct, tag="execute"):
    scheduler_output: SchedulerOutput


class GrammarRows(msgspec.Struct, tag="grammar_rows"):
    """Rank 0 only: the grammar bitmask rows of the step just sent (SchedulerOutput.
    grammar_bitmask), sent once filled; the worker reads it just before sampling."""

    bitmask: bytes


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class ExecuteChained(msgspec.Struct, tag="execute_chained"):
    """Async scheduling: launch this step, reply with the step before's output."""

    scheduler_output: SchedulerOutput


class Flush(msgspec.Struct, tag="flush"):
    """Reply with the last chained step's output."""


class KVReady(msgspec.Struct, tag="kv_ready"):
    pass


class StepResult(msgspec.Struct, tag="result"):
    output: RunnerOutput


class ChainedResult(msgspec.Struct, tag="chained_result"):
    output: RunnerOutput | None  # None: no step was waiting for its tokens


ToWorker = ProfileKV | InitKVCache | Execute | ExecuteChained | Flush | GrammarRows | Shutdown
FromWorker = WorkerReady | WorkerFailed | KVBudget | KVReady | StepResult | ChainedResult


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _stop_loading(signum, frame) -> None:
    """SIGTERM (the parent stopped while this worker loaded): end a kernel build with its
    compilers (killed outright, they would go on) and exit."""
    from llmd.gpu.layers.cpu.kernel_build import cancel_builds
    cancel_builds()
    raise SystemExit(128 + signum)


def worker_main(conn) -> None:
    """Serve one parent over `conn` (a multiprocessing Connection): the first message is
    the WorkerInit, then ToWorker messages until Shutdown or EOF."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _stop_loading)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    try:
        init = msgspec.msgpack.decode(conn.recv_bytes(), type=WorkerInit)
    except (EOFError, OSError):
        return
    try:
        import torch

        from llmd.gpu.worker.model_runner import ModelRunner
        from llmd.gpu.worker.runner_types import RunnerSettings

        if init.torch_threads:
            torch.set_num_threads(init.torch_threads)
        dtype = getattr(torch, init.dtype)
        device = torch.device(init.device)
        if device.type == "cuda":
            # Before anything allocates: the CUDA context, the caching allocator and
            # NCCL's communicator all bind to the current device.
            torch.cuda.set_device(device)
        if init.world_size > 1:
            import datetime

            import torch.distributed as dist

            dist.init_process_group(init.dist_backend, init_method=init.dist_init_method,
                                    rank=init.rank, world_size=init.world_size,
                                    timeout=datetime.timedelta(seconds=600))
        runner = ModelRunner(init.model_dir, RunnerSettings(**init.settings), device, dtype,
                             init.rank, init.world_size)
        conn.send_bytes(encoder.encode(WorkerReady(runner.kv_cache_bytes_per_block(), os.getpid())))
    except Exception as exc:  # start-up errors go back as a message, not a child traceback
        conn.send_bytes(encoder.encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
        return
    try:
        _serve(conn, init, runner, encoder, decoder)
    finally:
        if init.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _serve(conn, init: WorkerInit, runner, encoder, decoder) -> None:
    while True:
        try:
            message = decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if isinstance(message, Shutdown):
            return
        step = message.scheduler_output if isinstance(message, (Execute, ExecuteChained)) else None
        if step is not None and init.rank == 0 and step.grammar_req_ids:
            _follow_grammar_rows(step, conn, decoder)
        try:
            reply = _handle(message, runner, init.rank)
            if step is not None:
                step.wait_grammar_bitmask()  # read if sampling did not: the next message is not the rows
        except Exception as exc:  # the worker is done: the parent fails what it had in flight
            traceback.print_exc()
            conn.send_bytes(encoder.encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
            return
        if reply is not None:
            conn.send_bytes(encoder.encode(reply))


def _follow_grammar_rows(step: SchedulerOutput, conn, decoder) -> None:
    """The step's grammar rows are the next message on the pipe: the parent sends them
    once they are filled, so they are read when sampling needs them, not before the forward."""
    def read() -> bytes:
        message = decoder.decode(conn.recv_bytes())
        if not isinstance(message, GrammarRows):
            raise TypeError(f"worker expected the step's grammar rows, got {type(message).__name__}")
        return message.bitmask

    step.follow_grammar_bitmask(read)


def _handle(message: ToWorker, runner, rank: int) -> FromWorker | None:
    """The reply to one message (None: this rank sends none)."""
    match message:
        case ProfileKV(gpu_memory_utilization=util, extra_reserved_bytes=extra):
            try:
                return KVBudget(breakdown=runner.profile_kv_budget(util, extra))
            except ValueError as exc:  # the budget does not fit: the parent reports it
                return KVBudget(error=str(exc))
        case InitKVCache(num_blocks=n):
            runner.initialize_kv_cache(n)
            return KVReady()
        case Execute(scheduler_output=so):
            output = runner.execute_model(so)
            return StepResult(output) if rank == 0 else None
        case ExecuteChained(scheduler_output=so):  # chaining runs on one rank only
            return ChainedResult(runner.execute_model_chained(so))
        case Flush():
            return ChainedResult(runner.flush())
    raise TypeError(f"worker got {type(message).__name__}")

if __name__ == "__main__":
    # python -m llmd.gpu.worker.process FD: FD is this process's end of a socketpair.
    from multiprocessing.connection import Connection

    worker_main(Connection(int(sys.argv[1])))
