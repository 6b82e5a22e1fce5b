"""The multiprocess executor: one worker process per device (`python -m
llmd.gpu.worker`, started fresh: nothing is pickled and the parent's __main__ is never
re-imported), SchedulerOutputs broadcast as msgpack bytes over socketpairs,
RunnerOutputs from rank 0. A worker that dies closes its end of the pair, so the parent
sees EOF at once and raises WorkerError naming the exit code: never a hang."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection, wait

import msgspec

from llmd.executor_error import ExecutorError
from llmd.gpu.model_runner import RunnerSettings
from llmd.gpu.worker import (Execute, FromWorker, InitKVCache, KVReady, Shutdown, StepResult,
                             WorkerFailed, WorkerInit, WorkerReady)
from llmd.messages import RunnerOutput, SchedulerOutput


class WorkerError(ExecutorError):
    """A worker failed to start, raised, or died. The message names the cause."""


class MultiprocExecutor:
    def __init__(self, model_dir: str, settings: RunnerSettings, device, dtype, world_size: int = 1,
                 start_timeout: float = 600.0) -> None:
        if world_size != 1:
            raise ValueError("tensor_parallel_size > 1 is not supported yet")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self.bytes_sent_last_step = 0
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        dtype_name = str(dtype).removeprefix("torch.")
        try:
            for rank in range(world_size):
                parent_sock, child_sock = socket.socketpair()
                proc = subprocess.Popen([sys.executable, "-m", "llmd.gpu.worker", str(child_sock.fileno())],
                                        pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL)
                child_sock.close()
                conn = Connection(os.dup(parent_sock.fileno()))
                parent_sock.close()
                self.procs.append(proc)
                self.conns.append(conn)
                init = WorkerInit(rank=rank, world_size=world_size, model_dir=str(model_dir),
                                  device=str(device), dtype=dtype_name, settings=dataclasses.asdict(settings))
                conn.send_bytes(msgspec.msgpack.encode(init))
            ready = [self._recv(rank, start_timeout) for rank in range(world_size)]
            for rank, message in enumerate(ready):
                if not isinstance(message, WorkerReady):
                    raise WorkerError(f"worker {rank} did not start: unexpected {type(message).__name__}")
        except BaseException:
            self.shutdown()
            raise
        self._bytes_per_block = min(m.bytes_per_block for m in ready)
        self.pids = [p.pid for p in self.procs]

    def _recv(self, rank: int, timeout: float | None) -> object:
        conn, proc = self.conns[rank], self.procs[rank]
        if not wait([conn], timeout):
            raise WorkerError(f"worker {rank} did not answer within {timeout:.0f} s")
        try:
            message = self._decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            try:
                code = proc.wait(5.0)
            except subprocess.TimeoutExpired:
                code = None
            raise WorkerError(f"worker {rank} (pid {proc.pid}) died with exit code {code}") from None
        if isinstance(message, WorkerFailed):
            raise WorkerError(f"worker {rank} failed: {message.message}")
        return message

    def _broadcast(self, message: object) -> None:
        data = self._encoder.encode(message)
        self.bytes_sent_last_step = len(data)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                raise WorkerError(f"worker {rank} (pid {self.procs[rank].pid}) is gone "
                                  f"(exit code {self.procs[rank].poll()})") from None

    def kv_cache_bytes_per_block(self) -> int:
        return self._bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks))
        for rank in range(len(self.conns)):
            if not isinstance(self._recv(rank, 600.0), KVReady):
                raise WorkerError(f"worker {rank} did not confirm its KV cache")

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self._broadcast(Execute(scheduler_output))
        message = self._recv(0, None)
        if not isinstance(message, StepResult):
            raise WorkerError(f"worker 0 sent {type(message).__name__} instead of a step result")
        return message.output

    def shutdown(self) -> None:
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
