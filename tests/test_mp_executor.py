"""The multiprocess executor gives the same tokens and logprobs as the in-process one,
and failures are errors, never hangs or orphans: a killed worker fails the in-flight
requests within seconds and a fresh worker serves the next ones; a bad model directory
is a clear start-up message; workers exit with their parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from daemon_util import Daemon, RawConn
from engine_util import drain
from llmd import LLM, SamplingParams
from llmd_tools.make_model import fixture_path

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:\n    pass\n" * 2, "x", "for i in range(3):"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it holds no memory and is not running.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("name, settings", [
    ("tiny-llama", {}),
    ("tiny-qwen2", {"max_num_batched_tokens": 16}),  # chunked prefill
    ("tiny-qwen3", {"num_gpu_blocks_override": 6, "max_model_len": 96}),  # preemption
])
def test_multiprocess_equals_in_process(name, settings):
    path = str(fixture_path(name))
    settings = {"num_gpu_blocks_override": 128, "max_model_len": 256, **settings}
    uni = LLM(model=path, **settings)
    mp = LLM(model=path, distributed_executor_backend="mp", **settings)
    try:
        ref = uni.generate(TEXTS, GREEDY)
        got = mp.generate(TEXTS, GREEDY)
        for a, b in zip(ref, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert pa.keys() == pb.keys()
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa)
        mp.engine.kv_cache_manager.assert_all_free()
        # The worker's weights, as the in-process engine counts its own.
        assert mp.engine.memory().weights == uni.engine.memory().weights
        assert mp.engine.memory().worker_pids == mp.engine.executor.pids
        if settings["num_gpu_blocks_override"] == 6:
            assert mp.engine.get_stats()["num_preemptions"] > 0
        # Decode steps ship diffs only: a few dozen bytes per request, not its history.
        assert mp.engine.executor.bytes_sent_last_step < 64 * len(TEXTS)
    finally:
        mp.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_killed_worker_fails_requests_then_a_new_worker_serves(async_scheduling):
    """Only the requests running on the dead worker fail, saying why; the ones waiting
    for a batch slot (max_num_seqs 2) never reached it and are served by the next."""
    path = str(fixture_path("tiny-llama"))
    llm = LLM(model=path, distributed_executor_backend="mp", num_gpu_blocks_override=128, max_model_len=256,
              async_scheduling=async_scheduling, max_num_seqs=2)
    engine = llm.engine
    old_pid = engine.executor.pids[0]
    try:
        for i, text in enumerate(TEXTS):
            engine.add_request(f"r{i}", text, SamplingParams(max_tokens=100, ignore_eos=True))
        for _ in range(3):
            engine.step()
        running = {engine.output_processor.parent_of[r.request_id] for r in engine.scheduler.running}
        assert len(running) == 2
        os.kill(old_pid, signal.SIGKILL)
        start = time.monotonic()
        failed = []
        while not failed:
            failed = [out for out in engine.step() if out.finished]
        # (the offline engine starts the new worker before it returns the failures: that
        # start is within the bound too, 2-3 s on a quiet machine, 10 s beside a busy one)
        assert time.monotonic() - start < 30
        assert {o.request_id for o in failed} == running
        assert all(o.outputs[0].finish_reason == "error" for o in failed)
        assert all(o.outputs[0].error == f"worker process 0 (pid {old_pid}) exited with signal SIGKILL; "
                   "the request was lost" for o in failed)
        assert wait_gone(old_pid)
        new_pid = engine.executor.pids[0]
        assert new_pid != old_pid and alive(new_pid)
        waited = drain(engine)
        assert set(waited) == {f"r{i}" for i in range(len(TEXTS))} - running
        assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 100
                   for o in waited.values())
        engine.kv_cache_manager.assert_all_free()
        out = llm.generate(["after the crash"], SamplingParams(temperature=0, max_tokens=5))[0]
        assert len(out.outputs[0].token_ids) == 5
    finally:
        engine.shutdown()
    assert wait_gone(engine.executor.pids[0])


def test_worker_start_up_error_is_a_clear_message(tmp_path):
    from llmd.gpu.worker.mp_executor import MultiprocExecutor, WorkerError
    from llmd.gpu.worker.runner_types import RunnerSettings

    bad = tmp_path / "model"
    bad.mkdir()
    src = fixture_path("tiny-llama")
    (bad / "config.json").write_text((src / "config.json").read_text())  # config but no weights
    settings = RunnerSettings(block_size=16, max_model_len=256, valid_vocab_size=1024, eos_token_id=1, seed=0)
    with pytest.raises(WorkerError, match=r"worker 0 failed: FileNotFoundError: no \*\.safetensors"):
        MultiprocExecutor(str(bad), settings, "cpu", "float32")


def _settings():
    from llmd.gpu.worker.runner_types import RunnerSettings

    return RunnerSettings(block_size=16, max_model_len=256, valid_vocab_size=1024, eos_token_id=1, seed=0)


def test_tp_rendezvous_is_a_private_file_removed_at_shutdown(tmp_path, monkeypatch):
    """No TCP port to race for: the ranks meet through a file in a 0700 directory the
    executor makes, and it is gone after shutdown."""
    from llmd.gpu.worker.mp_executor import MultiprocExecutor

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    executor = MultiprocExecutor(str(fixture_path("tiny-llama")), _settings(), "cpu", "float32", world_size=2)
    try:
        made = [p for p in tmp_path.iterdir() if p.name.startswith("llmd-dist-")]
        assert len(made) == 1 and made[0].is_dir()
        assert made[0].stat().st_mode & 0o777 == 0o700
        executor.initialize_kv_cache(8)
    finally:
        executor.shutdown()
    assert not list(tmp_path.iterdir())


def test_tp_rendezvous_is_removed_when_start_fails(tmp_path, monkeypatch):
    from llmd.gpu.worker.mp_executor import MultiprocExecutor, WorkerError

    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text((fixture_path("tiny-llama") / "config.json").read_text())
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(WorkerError, match=r"failed: FileNotFoundError: no \*\.safetensors"):
        MultiprocExecutor(str(bad), _settings(), "cpu", "float32", world_size=2)
    assert not list(tmp.iterdir())


def test_more_ranks_than_cuda_devices_is_refused_before_spawning(monkeypatch):
    import subprocess as sp

    import torch

    from llmd.gpu.worker import mp_executor

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sp, "Popen", lambda *a, **k: pytest.fail("a worker was spawned"))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2 needs 2 CUDA devices but only 1 CUDA "
                                         r"device is visible$"):
        mp_executor.MultiprocExecutor("unused", _settings(), "cuda", "bfloat16", world_size=2)
    with pytest.raises(ValueError, match=r"^device 'cuda:1' is not available: only 1 CUDA device is visible$"):
        mp_executor.MultiprocExecutor("unused", _settings(), "cuda:1", "bfloat16")
    assert mp_executor.worker_devices("cuda", 1) == ["cuda:0"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert mp_executor.worker_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert mp_executor.worker_devices("cuda:2", 2) == ["cuda:2", "cuda:3"]
    assert mp_executor.worker_devices("cpu", 2) == ["cpu", "cpu"]


PARENT = """
import sys, time
from llmd import LLM
llm = LLM(model=sys.argv[1], distributed_executor_backend="mp", num_gpu_blocks_override=32, max_model_len=128)
print(llm.engine.executor.pids[0], flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_parent_dies():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(fixture_path("tiny-llama"))],
                              stdout=subprocess.PIPE, text=True)
    worker_pid = int(parent.stdout.readline())
    assert alive(worker_pid)
    parent.kill()
    parent.wait()
    assert wait_gone(worker_pid), "worker outlived its parent"


# With async scheduling, the deeper pipeline (a step launched behind the lost one);
# plain scheduling's loss and restart are test_killed_worker_fails_requests_then_a_new_worker_serves[sync].
@pytest.mark.parametrize("extra", [("--async-scheduling",)], ids=["async"])
def test_daemon_survives_a_worker_crash(extra):
    base = Path(tempfile.mkdtemp(prefix="llmd-mp-"))
    d = Daemon(str(fixture_path("tiny-llama")), base / "s.sock", "--distributed-executor-backend", "mp",
               *extra).wait_ready()
    try:
        workers = subprocess.run(["pgrep", "-f", "llmd.gpu.worker.process", "-P", str(d.proc.pid)],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 1
        with RawConn(d.sock) as conn:
            conn.send({"type": "submit", "id": "a", "prompt": "hi", "sampling": {"max_tokens": 200, "ignore_eos": True}})
            assert conn.recv()["type"] == "accepted"
            conn.recv()
            os.kill(int(workers[0]), signal.SIGKILL)
            final = conn.until_final("a")[-1]
            assert final["finish_reason"] == "error"
            assert final["error"] == f"worker process 0 (pid {workers[0]}) exited with signal SIGKILL; " \
                "the request was lost"
            conn.send({"type": "submit", "id": "b", "prompt": "hi", "sampling": {"max_tokens": 4}})
            assert conn.until_final("b")[-1]["usage"]["completion_tokens"] == 4
            conn.send({"type": "status"})
            memory = conn.recv()["memory"]  # the new worker's, the model in it
            assert memory["workers_rss"] > sum(memory["weights"].values()) > 0
    finally:
        assert d.stop() == 0, d.stderr()
