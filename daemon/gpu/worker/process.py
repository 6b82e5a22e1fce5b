"""A worker process: one per device (rank = TP rank). It loads the model, sizes its KV
cache when told, then runs SchedulerOutputs as they arrive on its pipe and (rank 0)
replies with one RunnerOutput per step, in order: at once when the step's tokens are on
the host, else once the next step has launched (its decode rows read them on the
device) or the parent asks (Flush). A step's grammar bitmask rows come to rank 0 as the next
message after the step (GrammarBitmask), sent once filled; the runner reads it just before
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
from llmd.core.step_messages import GrammarRows, RunnerOutput, SchedulerOutput


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
    weight_bytes: dict[str, int] = {}  # this rank's, by how they are kept (ModelRunner.weight_bytes)
    kv_scales: str = ""  # ModelRunner.kv_scale_source


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


class GrammarBitmask(msgspec.Struct, tag="grammar_bitmask"):
    """Rank 0 only: the grammar rows of the step just sent (its GrammarRows), sent once
    filled; the worker reads it just before sampling."""

    bitmask: bytes


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Flush(msgspec.Struct, tag="flush"):
    """Send the output of the step launched last, if it is still held (nothing, if it
    was sent already)."""


class KVReady(msgspec.Struct, tag="kv_ready"):
    pass


class Sleep(msgspec.Struct, tag="sleep"):
    """Free the KV cache and, by `level`, keep (1) or drop (2) the weights (ModelRunner.sleep)."""

    level: int


class WakeUp(msgspec.Struct, tag="wake_up"):
    """Restore what Sleep freed (ModelRunner.wake_up)."""


class SleepState(msgspec.Struct, tag="sleep_state"):
    """The answer to Sleep and WakeUp: the level asleep now (None: awake)."""

    level: int | None


class StepReply(msgspec.Struct, tag="result"):
    """Rank 0's answer to one Execute: the step's RunnerOutput, in step order (what the
    engine then makes of it is core.engine_core.StepResult)."""

    output: RunnerOutput




ToWorker = ProfileKV | InitKVCache | Execute | Flush | GrammarBitmask | Sleep | WakeUp | Shutdown
FromWorker = WorkerReady | WorkerFailed | KVBudget | KVReady | SleepState | StepReply


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
        conn.send_bytes(encoder.encode(WorkerReady(runner.kv_cache_bytes_per_block(), os.getpid(),
                                                   runner.weight_bytes(), runner.kv_scale_source())))
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
    """Answer the parent's messages until Shutdown or EOF. Steps: each Execute launches
    one (ModelRunner.execute_model) and rank 0 sends one StepReply per step, in order:
    a complete step's at once, a pending one's (its tokens still on the device) after
    the next step launched or when a Flush asks for it."""
    held = None  # rank 0: the last step's handle, its output not yet sent
    while True:
        try:
            message = decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if isinstance(message, Shutdown):
            return
        step = message.scheduler_output if isinstance(message, Execute) else None
        rows = None
        if step is not None and init.rank == 0 and step.grammar_req_ids:
            rows = _grammar_rows(conn, decoder)
        try:
            replies: list = []
            if step is not None:
                handle = runner.execute_model(step, rows)
                if rows is not None:
                    rows.wait()  # read if sampling did not: the next message is not the rows
                if init.rank == 0:
                    if held is not None:  # the step before: its tokens were read on the device
                        replies.append(StepReply(held.output()))
                    held = handle if handle.pending else None
                    if not handle.pending:
                        replies.append(StepReply(handle.output()))
            elif isinstance(message, Flush):
                if held is not None:
                    replies.append(StepReply(held.output()))
                    held = None
            else:
                replies.append(_handle(message, runner))
        except Exception as exc:  # the worker is done: the parent fails what it had in flight
            traceback.print_exc()
            conn.send_bytes(encoder.encode(WorkerFailed(f"{type(exc).__name__}: {exc}")))
            return
        for reply in replies:
            conn.send_bytes(encoder.encode(reply))


def _grammar_rows(conn, decoder) -> GrammarRows:
    """The step's grammar rows are the next message on the pipe: the parent sends them
    once they are filled, so they are read when sampling needs them, not before the forward."""
    def read() -> bytes:
        message = decoder.decode(conn.recv_bytes())
        if not isinstance(message, GrammarBitmask):
            raise TypeError(f"worker expected the step's grammar rows, got {type(message).__name__}")
        return message.bitmask

    return GrammarRows(read)


def _handle(message: ToWorker, runner) -> FromWorker:
    """The reply to a message that is not a step."""
    match message:
        case ProfileKV(gpu_memory_utilization=util, extra_reserved_bytes=extra):
            try:
                return KVBudget(breakdown=runner.profile_kv_budget(util, extra))
            except ValueError as exc:  # the budget does not fit: the parent reports it
                return KVBudget(error=str(exc))
        case InitKVCache(num_blocks=n):
            runner.initialize_kv_cache(n)
            return KVReady()
        case Sleep(level=level):
            runner.sleep(level)
            return SleepState(runner.sleep_level)
        case WakeUp():
            runner.wake_up()
            return SleepState(runner.sleep_level)
    raise TypeError(f"worker got {type(message).__name__}")

if __name__ == "__main__":
    # python -m llmd.gpu.worker.process FD: FD is this process's end of a socketpair.
    from multiprocessing.connection import Connection

    worker_main(Connection(int(sys.argv[1])))
