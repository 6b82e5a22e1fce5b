"""Async scheduling: step N+1 is scheduled while step N runs, with N's tokens as
placeholders. Whatever the overlap, every request must get exactly the tokens (and
logprobs) it gets with plain step-by-step scheduling: under chunked prefill,
preemption, prefix-cache hits, stop strings, n > 1, guided decoding, aborts, the
worker-process executor and the daemon."""
from __future__ import annotations

import json
import random
import re
import tempfile
from pathlib import Path

import pytest

from daemon_util import Daemon, RawConn
from engine_util import drain
from llmd import LLM, GuidedDecodingParams, SamplingParams
from llmd.config import load_engine_config
from llmd_tools.make_model import fixture_path

TEXT = "def parse(path):\n    with open(path) as f:\n        return json.load(f)\n"
SHARED = TEXT * 3  # a prefix several blocks long that later prompts hit in the cache


def workload() -> tuple[list[str], list[SamplingParams]]:
    prompts = [SHARED + "x = 1", "import os", TEXT * 4, SHARED + "y = 2", "class A:", TEXT,
               SHARED + "z", "for x in y:", "a", TEXT * 2]
    params = []
    for i, _ in enumerate(prompts):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=20 + 8 * i,
                                         ignore_eos=True, logprobs=2))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + 9 * i, ignore_eos=True, logprobs=1))
    return prompts, params


def make(**settings) -> LLM:
    base = dict(model=str(fixture_path("tiny-llama")), max_model_len=256, max_num_seqs=6,
                max_num_batched_tokens=64, long_prefill_token_threshold=40, num_gpu_blocks_override=16)
    return LLM(**{**base, **settings})


def results(outputs) -> list[tuple]:
    return [(tuple(c.token_ids), c.finish_reason) for o in outputs for c in o.outputs]


def logprobs(outputs) -> list[list[float]]:
    return [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for o in outputs for c in o.outputs]


def assert_clean(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_integrity()
    kv.assert_all_free()
    assert all(r.num_output_placeholders == 0 for r in llm.engine.scheduler.requests.values())


@pytest.fixture(scope="module")
def reference():
    llm = make()
    prompts, params = workload()
    out = llm.generate(prompts, params)
    assert llm.engine.get_stats()["num_preemptions"] > 0  # the workload does preempt
    llm.engine.shutdown()
    return out


@pytest.fixture(scope="module")
def overlapped():
    llm = make(async_scheduling=True)
    yield llm
    llm.engine.shutdown()


def test_same_tokens_and_logprobs_as_plain_scheduling(reference, overlapped):
    prompts, params = workload()
    got = overlapped.generate(prompts, params)
    assert results(got) == results(reference)
    for a, b in zip(logprobs(got), logprobs(reference)):
        assert a == pytest.approx(b, abs=1e-4)
    stats = overlapped.engine.pipeline.stats
    assert stats.overlapped > stats.steps // 2  # most steps were launched before the last one's tokens landed
    assert overlapped.engine.get_stats()["num_preemptions"] > 0
    assert overlapped.engine.get_stats()["prefix_cache_hits"] > 0
    assert_clean(overlapped)


def test_max_tokens_is_never_overrun(overlapped):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 17)]
    out = overlapped.generate([TEXT, "a", "import os", TEXT * 2], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 2, 3, 17]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    assert_clean(overlapped)


@pytest.mark.parametrize("max_tokens", [1, 9, None])  # None: up to max_model_len
def test_no_step_computes_past_the_last_token(overlapped, max_tokens):
    """The token in flight may be a request's last: nothing is scheduled after it, so a
    lone request computes exactly its prompt and every output token but the last (and
    never a position past max_model_len)."""
    stats = overlapped.engine.pipeline.stats
    before = stats.tokens
    prompt = overlapped.engine.tokenizer(TEXT).input_ids
    out = overlapped.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    generated = len(out[0].outputs[0].token_ids)
    assert generated == (max_tokens or 256 - len(prompt))
    assert stats.tokens - before == len(prompt) - out[0].num_cached_tokens + generated - 1
    assert_clean(overlapped)


def test_stop_strings_and_n_samples(overlapped):
    plain = make()
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=["e", "(", "\n"]),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5, 17, 200])]
    prompts = [TEXT, "import sys", "class B:"]
    ref = plain.generate(prompts, params)
    plain.engine.shutdown()
    got = overlapped.generate(prompts, params)
    assert results(got) == results(ref)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    assert_clean(overlapped)


def test_guided_rows_wait_for_the_tokens_in_flight(overlapped):
    regex = r"[a-z]{2,6}(-[0-9]{1,3}){1,3}"
    guided = [SamplingParams(temperature=0.0, max_tokens=30, guided=GuidedDecodingParams(regex=regex)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                             guided=GuidedDecodingParams(choice=["alpha", "beta", "gamma delta"]))]
    plain_params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    prompts = ["id:", "pick", TEXT, "x"]
    params = guided + plain_params
    plain = make()
    ref = plain.generate(prompts, params)
    plain.engine.shutdown()
    deferred = overlapped.engine.pipeline.stats.deferred
    got = overlapped.generate(prompts, params)
    assert results(got) == results(ref)
    assert re.fullmatch(regex, got[0].outputs[0].text)
    assert got[1].outputs[0].text in ("alpha", "beta", "gamma delta")
    assert overlapped.engine.pipeline.stats.deferred > deferred
    assert_clean(overlapped)


def test_abort_with_steps_in_flight(overlapped):
    engine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"ab{i}", TEXT * (1 + i % 2), params)
    for _ in range(6):
        engine.step()
    assert engine.pipeline.in_flight is not None
    engine.abort_request(["ab1", "ab3"])
    finished = drain(engine)
    assert sorted(finished) == ["ab0", "ab2", "ab4"]
    assert all(len(o.outputs[0].token_ids) == 60 for o in finished.values())
    assert_clean(overlapped)


def test_worker_process_executor(reference):
    llm = make(async_scheduling=True, distributed_executor_backend="mp")
    try:
        prompts, params = workload()
        assert results(llm.generate(prompts, params)) == results(reference)
        assert llm.engine.pipeline.stats.overlapped > 0
        assert_clean(llm)
    finally:
        llm.engine.shutdown()


def test_not_with_speculative_decoding():
    with pytest.raises(ValueError, match="async_scheduling does not run with speculative_config"):
        load_engine_config(async_scheduling=True, speculative_config={"method": "ngram"})


def test_daemon_with_async_scheduling(reference):
    prompts, params = workload()
    model = str(fixture_path("tiny-llama"))
    d = Daemon(model, Path(tempfile.mkdtemp(prefix="llmd-async-")) / "s.sock", "--async-scheduling",
               "--max-num-seqs", "6", "--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "40",
               "--num-gpu-blocks-override", "16").wait_ready()
    try:
        with RawConn(d.sock) as conn:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                sampling = {"temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_tokens,
                            "ignore_eos": True}
                if p.seed is not None:
                    sampling["seed"] = p.seed
                conn.send({"type": "submit", "id": f"r{i}", "prompt": prompt, "sampling": sampling})
            tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
            done = set()
            while len(done) < len(prompts):
                m = conn.recv()
                if m["type"] != "output":
                    assert m["type"] == "accepted", json.dumps(m)[:200]
                    continue
                tokens[m["id"]] += m.get("token_ids", [])
                if m.get("usage"):
                    done.add(m["id"])
            conn.send({"type": "status"})
            status = conn.recv()
        assert [tuple(tokens[f"r{i}"]) for i in range(len(prompts))] == [t for t, _ in results(reference)]
        assert status["kv_blocks_used"] == 0 and status["num_running"] == 0
    finally:
        assert d.stop() == 0, d.stderr()


def random_workload(seed: int):
    rng = random.Random(seed)
    items = []
    for i in range(14):
        prompt = TEXT * rng.randint(0, 3) + rng.choice(["x", "import os", "class A:", "for i in range(10):"])
        kind = rng.random()
        kw = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7)
        if kind < 0.2:
            kw.update(temperature=0.8, seed=rng.randrange(1000), n=rng.randint(1, 3), top_p=0.9)
        elif kind < 0.35:
            kw.update(temperature=0.0, stop=[rng.choice(["e", "(", ":"])])
        elif kind < 0.5:
            kw.update(temperature=0.0, guided=GuidedDecodingParams(regex=r"[a-z]{1,5}(,[0-9]{1,2}){0,4}"))
        elif kind < 0.6:
            kw.update(temperature=0.0, prompt_logprobs=2, logprobs=1)
        elif kind < 0.7:
            kw.update(temperature=1.0, seed=rng.randrange(1000), repetition_penalty=1.2,
                      min_tokens=min(3, kw["max_tokens"]))
        else:
            kw.update(temperature=0.0)
        items.append((rng.randint(0, 25), f"q{i}", prompt, SamplingParams(**kw)))
    aborts = {rng.randint(1, 40): f"q{rng.randrange(14)}" for _ in range(2)}
    return sorted(items, key=lambda item: item[0]), aborts


def run_random(llm: LLM, seed: int) -> dict:
    """Arrivals and aborts by step number; the finished outputs of requests not aborted."""
    engine = llm.engine
    pending, aborts = random_workload(seed)
    finished, aborted, step = {}, set(), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(f"{seed}-{rid}", prompt, params)
        victim = f"{seed}-{aborts.get(step)}"
        if victim in engine.output_processor.requests:
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
    assert_clean(llm)
    return {rid: ([(tuple(c.token_ids), c.text, c.finish_reason) for c in out.outputs], out.prompt_logprobs)
            for rid, out in finished.items() if rid not in aborted}


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_match_plain_scheduling(seed):
    """Penalties with min_tokens, prompt logprobs, n > 1, stop strings, guided requests,
    arrivals mid-run and aborts, under preemption: whatever both runs finish, they
    finish alike (aborts hit different states, so aborted requests are left out)."""
    plain = make(max_num_batched_tokens=48, long_prefill_token_threshold=24, num_gpu_blocks_override=24)
    overlapped_tight = make(max_num_batched_tokens=48, long_prefill_token_threshold=24, num_gpu_blocks_override=24,
                            async_scheduling=True)
    try:
        want, got = run_random(plain, seed), run_random(overlapped_tight, seed)
    finally:
        plain.engine.shutdown()
        overlapped_tight.engine.shutdown()
    assert len(set(want) & set(got)) >= 10
    for rid in set(want) & set(got):
        assert got[rid][0] == want[rid][0], rid
        assert (got[rid][1] is None) == (want[rid][1] is None)


def test_penalties_count_the_token_in_flight(overlapped):
    """A chained step samples before the host has the token sampled just before it: its
    penalty counts must have that token all the same. The fixtures loop on prompts like
    these, so the strongest penalties change the greedy path; plain scheduling is the
    reference."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=2.0, repetition_penalty=2.0)
    prompts = [[11, 12, 13] * 10, [5, 6, 7, 8] * 8, TEXT]
    plain = make()
    ref = plain.generate(prompts, params)
    plain.engine.shutdown()
    got = overlapped.generate(prompts, params)
    assert results(got) == results(ref)
    unpenalized = [o.outputs[0].token_ids for o in overlapped.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))]
    assert unpenalized != [o.outputs[0].token_ids for o in ref]  # the penalties do bite
    assert_clean(overlapped)
