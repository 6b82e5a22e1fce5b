"""A request is the unit of failure (issue 25, rows 1 and 2).

First wall: every integer a request carries has a range checked at intake, with an
error naming the field (values that do not fit int64 used to pass, then kill the
scheduler actor: `OverflowError: can't serialize ints` on the worker pipe, `Overflow
when unpacking long long` in the sampling metadata), and token ids are checked against
the vocabulary (a stop token id outside it made xgrammar's matcher raise RuntimeError
inside the scheduler, which caught only ValueError).

Second wall, for what the checks miss: the scheduler actor turns an exception of one
request into that request's error (queueing it, starting its grammar), and a step that
raises into a failure of the step's requests and a worker restart, as after a worker
crash; the actor (and so the daemon) goes on. Both are tested with faults injected into
a real engine, and over the socket against a real daemon."""
from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest

from daemon_util import Daemon, RawConn
from llmd import LLM
from llmd.actors.messages import AddRequest, RequestsAborted, StepTokens
from llmd.actors.runtime import Actor
from llmd.actors.scheduler_actor import SchedulerActor
from llmd.core.restart_policy import RestartPolicy
from llmd_client.protocol import INT32_MAX, ClientMessage, GuidedDecodingParams, SamplingParams, Submit
from llmd_tools.make_model import fixture_path

HUGE = 2**70


# -- first wall: ranges at the door -------------------------------------------------------------
@pytest.mark.parametrize("fields,name", [
    ({"top_k": HUGE}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"max_tokens": HUGE}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": HUGE, "max_tokens": None}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [HUGE]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": HUGE}, "seed"), ({"seed": -1}, "seed"), ({"n": HUGE}, "n"),
    ({"logprobs": HUGE}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"min_p": float("inf")}, "min_p"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_every_numeric_field_has_a_range(fields: dict, name: str) -> None:
    """Out of range (huge, negative, NaN, infinite) is refused by name, built in Python
    and decoded from JSON and msgpack alike; a huge value is not echoed whole."""
    with pytest.raises(ValueError, match=f"^{name} ") as info:
        SamplingParams(**fields)
    assert str(HUGE) not in str(info.value)
    for codec in (msgspec.json, msgspec.msgpack):
        if codec is msgspec.json and any(v != v or v in (float("inf"), float("-inf"))
                                         for v in fields.values() if isinstance(v, float)):
            continue  # JSON has no NaN or infinity
        try:
            frame = codec.encode({"type": "submit", "prompt": "x", "sampling": fields})
        except OverflowError:  # msgpack has no integers past 64 bits: no client can send one
            assert codec is msgspec.msgpack
            continue
        with pytest.raises(msgspec.ValidationError, match=name):
            codec.decode(frame, type=ClientMessage)


def test_the_ranges_admit_their_ends() -> None:
    SamplingParams(top_k=INT32_MAX, max_tokens=INT32_MAX, min_tokens=INT32_MAX, stop_token_ids=[INT32_MAX],
                   seed=2**63 - 1, temperature=0.0)
    Submit(prompt="x", priority=-INT32_MAX - 1)
    Submit(prompt="x", priority=INT32_MAX)
    for priority in (INT32_MAX + 1, -INT32_MAX - 2, HUGE):
        with pytest.raises(ValueError, match="^priority "):
            Submit(prompt="x", priority=priority)


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(model=str(fixture_path("tiny-llama")), device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    yield llm
    llm.engine.shutdown()


def test_token_ids_are_checked_against_the_vocabulary(llm: LLM) -> None:
    processor = llm.engine.input_processor
    vocab = processor.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        processor.prepare("r1", "hello", SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        processor.prepare("r2", [1, vocab], SamplingParams())
    processor.prepare("r3", "hello", SamplingParams(stop_token_ids=[vocab - 1]))  # the last id is fine


# -- second wall: the scheduler actor ----------------------------------------------------------
class Recorder(Actor):
    """Stands in for the detokenizer and the metrics actor: keeps what it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[object] = []

    def send(self, message: object) -> None:
        self.messages.append(message)

    def finals(self) -> dict[str, tuple[str, str | None]]:
        """request id -> (finish reason, error) of every request that ended."""
        out = {}
        for m in self.messages:
            if isinstance(m, RequestsAborted):
                out.update({rid: (m.reason, m.error) for rid in m.request_ids})
            elif isinstance(m, StepTokens):
                out.update({u.req_id.split("#")[0]: (u.finish_reason, u.error) for u in m.updates if u.finish_reason})
        return out


def run_actor(llm: LLM, requests: dict[str, SamplingParams], until, timeout: float = 60.0,
              later: tuple | None = None) -> Recorder:
    """A SchedulerActor over the engine, fed `requests`, run until `until(recorder)`;
    `later` (predicate, requests): those are sent once predicate(recorder) holds."""
    recorder = Recorder()

    async def main() -> None:
        actor = SchedulerActor(llm.engine, recorder, recorder, restart_policy=RestartPolicy(backoff_s=0.0))
        task = asyncio.get_running_loop().create_task(actor.run())

        def send(batch: dict[str, SamplingParams]) -> None:
            for rid, params in batch.items():
                prepared = llm.engine.input_processor.prepare(rid, "def f(x):", params)
                actor.send(AddRequest(rid, prepared.children))

        send(requests)
        pending = later
        try:
            async with asyncio.timeout(timeout):
                while not until(recorder):
                    assert not task.done(), task.exception()  # the actor never dies
                    if pending is not None and pending[0](recorder):
                        send(pending[1])
                        pending = None
                    await asyncio.sleep(0.01)
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return recorder


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_request_that_cannot_be_queued_fails_alone(llm: LLM, monkeypatch) -> None:
    scheduler = llm.engine.core.scheduler
    add = scheduler.add_request

    def add_request(request) -> None:
        if request.request_id.startswith("bad"):
            raise OverflowError("Python int too large to convert to C long")
        add(request)

    monkeypatch.setattr(scheduler, "add_request", add_request)
    finals = run_actor(llm, {"good": greedy(6), "bad": greedy(6)}, lambda r: len(r.finals()) == 2).finals()
    assert finals["bad"][0] == "error" and "could not be queued (OverflowError)" in finals["bad"][1]
    assert finals["good"] == ("length", None)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks  # no leak


def test_a_grammar_matcher_that_raises_fails_its_request_alone(llm: LLM, monkeypatch) -> None:
    """xgrammar's matcher raised RuntimeError (a stop id outside the vocabulary) where
    only ValueError was caught: the scheduler actor died. Any exception type now fails
    that request alone, and the message names no internals."""
    import xgrammar

    def matcher(*args, **kwargs):
        raise RuntimeError("GrammarMatcher: internal detail")

    monkeypatch.setattr(xgrammar, "GrammarMatcher", matcher)
    guided = SamplingParams(temperature=0, max_tokens=4, guided=GuidedDecodingParams(regex="[a-z]+"))
    finals = run_actor(llm, {"plain": greedy(6), "guided": guided}, lambda r: len(r.finals()) == 2).finals()
    assert finals["guided"] == ("error", "guided decoding could not start for this request (RuntimeError)")
    assert finals["plain"] == ("length", None)


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(llm: LLM, monkeypatch) -> None:
    """One step raises (as the sampling metadata did on an int64 overflow): the requests
    in it end with an error, the worker is restarted, a later request is served."""
    core = llm.engine.core
    begin = core.begin_step
    calls = {"n": 0}
    lock = threading.Lock()

    def begin_step():
        with lock:
            calls["n"] += 1
            if calls["n"] == 3:
                raise OverflowError("Overflow when unpacking long long")
        return begin()

    monkeypatch.setattr(core, "begin_step", begin_step)
    recorder = run_actor(llm, {"first": greedy(20)}, lambda r: "later" in r.finals(),
                         later=(lambda r: "first" in r.finals(), {"later": greedy(5)}))
    finals = recorder.finals()
    assert finals["first"][0] == "error" and "a step failed (OverflowError)" in finals["first"][1]
    assert finals["later"] == ("length", None)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.kv_cache_manager.num_blocks


# -- over the socket: the real daemon ----------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(fixture_path("tiny-llama")), tmp_path_factory.mktemp("iso") / "s.sock").wait_ready(120)
    yield d
    d.stop()


HOSTILE = [
    {"stop_token_ids": [HUGE]}, {"top_k": HUGE}, {"min_tokens": HUGE, "max_tokens": None},
    {"max_tokens": HUGE}, {"stop_token_ids": [100000]},
    {"stop_token_ids": [100000], "guided": {"json_object": True}},
    {"stop_token_ids": [INT32_MAX], "guided": {"regex": "[a-z]+"}},
]


def test_hostile_requests_fail_alone_over_the_socket(daemon: Daemon) -> None:
    """Each hostile request gets an error naming its field while an innocent stream on
    another connection runs to its end unchanged; afterwards a probe is served."""
    with RawConn(daemon.sock, json_mode=True) as innocent:
        innocent.send({"type": "submit", "id": "innocent", "prompt": "def f(x):",
                       "sampling": {"max_tokens": 40, "temperature": 0, "ignore_eos": True}})
        for i, sampling in enumerate(HOSTILE):
            with RawConn(daemon.sock, json_mode=True) as conn:
                conn.send({"type": "submit", "id": f"h{i}", "prompt": "hello", "sampling": sampling})
                reply = conn.recv()
                assert reply["type"] == "error", (sampling, reply)
                field = "stop_token_ids" if "stop_token_ids" in sampling else next(iter(sampling))
                assert field in reply["message"], (sampling, reply)
                assert "Traceback" not in reply["message"] and str(HUGE) not in reply["message"]
        tokens = []
        while True:
            out = innocent.recv()
            if out["type"] == "accepted":
                continue
            assert out["type"] == "output", out
            tokens += out.get("token_ids", [])
            if out.get("finish_reason"):
                break
        assert out["finish_reason"] == "length" and len(tokens) == 40
    with RawConn(daemon.sock, json_mode=True) as probe:
        probe.send({"type": "submit", "id": "probe", "prompt": "hi", "stream": False,
                    "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}})
        final = [m for m in probe.until_final("probe") if m["type"] == "output"][-1]
        assert final["finish_reason"] == "length"
    assert daemon.proc.poll() is None
    assert "Traceback" not in daemon.stderr()


def test_llmctl_abort_tells_the_truth(daemon: Daemon) -> None:
    """An id no request has (a 10,000-character one included: the daemon's answer named
    it cut short, the client never matched it, and llmctl printed "aborted", exit 0) is
    an error with a non-zero exit; ids are random, not a count of the daemon's requests."""
    import subprocess
    import sys
    from pathlib import Path

    llmctl = str(Path(sys.executable).parent / "llmctl")
    for ident in ("x" * 10_000, "r000000000000"):
        proc = subprocess.run([llmctl, "--socket", daemon.sock, "abort", ident], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode != 0 and "unknown_id" in proc.stderr and "aborted" not in proc.stdout, proc
        assert "Traceback" not in proc.stderr and len(proc.stderr) < 500
    ids = set()
    with RawConn(daemon.sock) as conn:
        for i in range(3):
            conn.send({"type": "submit", "id": f"q{i}", "prompt": "hi", "stream": False,
                       "sampling": {"max_tokens": 1}})
            ids.add(next(m for m in conn.until_final(f"q{i}") if m["type"] == "accepted")["request_id"])
    assert len(ids) == 3 and all(len(i) == 13 and i[0] == "r" for i in ids)
    assert len({int(i[1:], 16) // 1000 for i in ids}) == 3  # not consecutive
