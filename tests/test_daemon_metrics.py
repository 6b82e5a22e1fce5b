"""After a known workload, the daemon's counters equal the exact numbers: requests by
finish reason, prompt and generated tokens; the TTFT and E2E histograms count every
request. Read back with prometheus_client's parser (an independent reader), which must
see every family typed and every counter family holding its `_total` sample."""
from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import pytest
from prometheus_client import parser

from daemon_util import Daemon, RawConn
from llmd.actors.messages import ModelLoaded, RequestEvent, StepStats
from llmd.actors.metrics import MetricsActor
from llmd.core.spec_decode import SpecDecodeStats
from llmd_tools.make_model import fixture_path


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, labels but model_name) -> value, after checking the text is well-formed
    for the official parser: no untyped family, no counter family without samples (what a
    `# TYPE x counter` sampled as `x_total` by hand used to give)."""
    out = {}
    for family in parser.text_string_to_metric_families(text):
        assert family.type != "unknown", family.name
        assert family.samples, f"{family.type} family {family.name} has no samples"
        if family.type == "counter":
            assert {s.name for s in family.samples} == {family.name + "_total"}, family.name
        if family.name.startswith("llmd:"):
            assert all("model_name" in s.labels for s in family.samples), family.name
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_counters_equal_the_workload():
    d = Daemon(str(fixture_path("tiny-llama")), Path(tempfile.mkdtemp(prefix="llmd-m-")) / "s.sock").wait_ready()
    try:
        prompts = [[5 + i] * (10 + i) for i in range(6)]  # 10..15 prompt tokens
        max_tokens = [3, 4, 5, 6, 7, 8]
        with RawConn(d.sock) as conn:
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
                conn.send({"type": "submit", "id": f"q{i}", "token_ids": prompt,
                           "sampling": {"max_tokens": n, "ignore_eos": True}})
            finals = {}
            while len(finals) < len(prompts):
                m = conn.recv()
                if m.get("usage"):
                    finals[m["id"]] = m
            conn.send({"type": "metrics"})
            early = samples(conn.recv()["text"])
            # One aborted request: its tokens count too, under finished_reason="abort".
            conn.send({"type": "submit", "id": "ab", "token_ids": [9] * 12,
                       "sampling": {"max_tokens": 200, "ignore_eos": True}})
            assert conn.recv()["type"] == "accepted"
            conn.send({"type": "abort", "id": "ab"})
            aborted = conn.until_final("ab")[-1]
            conn.send({"type": "metrics"})
            text = conn.recv()["text"]
        got = samples(text)
        generated = sum(max_tokens) + aborted["usage"]["completion_tokens"]
        assert got[("llmd:prompt_tokens_total", ())] == sum(len(p) for p in prompts) + 12
        assert got[("llmd:generation_tokens_total", ())] == generated
        assert got[("llmd:request_success_total", (("finished_reason", "length"),))] == 6
        assert got[("llmd:request_success_total", (("finished_reason", "abort"),))] == 1
        assert got[("llmd:e2e_request_latency_seconds_count", ())] == 7
        # TTFT counts requests that produced a token (the aborted one may not have).
        assert got[("llmd:time_to_first_token_seconds_count", ())] in (6, 7)
        assert got[("llmd:num_requests_running", ())] == 0
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in got.items()
                         if k[0] == "llmd:e2e_request_latency_seconds_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        assert buckets[-1][1] == 7

        # Before the abort, every figure is exact: each prompt token is computed once and
        # each generated token but the last is fed back once (no preemption, no cache hits).
        prompt_total, decoded = sum(map(len, prompts)), sum(n - 1 for n in max_tokens)
        assert early[("llmd:request_prompt_tokens_count", ())] == 6
        assert early[("llmd:request_prompt_tokens_sum", ())] == prompt_total
        assert early[("llmd:request_generation_tokens_sum", ())] == sum(max_tokens)
        assert early[("llmd:scheduled_prefill_tokens_total", ())] == prompt_total
        assert early[("llmd:scheduled_decode_tokens_total", ())] == decoded
        assert early[("llmd:iteration_tokens_total_sum", ())] == prompt_total + decoded
        assert early[("llmd:batch_size_count", ())] == early[("llmd:step_duration_seconds_count", ())]
        # One gap per request per step after its first token; one queue time per request.
        assert early[("llmd:inter_token_latency_seconds_count", ())] == decoded
        assert early[("llmd:request_queue_time_seconds_count", ())] == 6
        # Every request ran its three phases and produced more than one token.
        for phase in ("prefill", "decode", "inference"):
            assert early[(f"llmd:request_{phase}_time_seconds_count", ())] == 6
        assert early[("llmd:request_time_per_output_token_seconds_count", ())] == 6
        # The phases partition the latencies: TTFT = queue + prefill, E2E = queue + inference.
        assert early[("llmd:time_to_first_token_seconds_sum", ())] == pytest.approx(
            early[("llmd:request_queue_time_seconds_sum", ())] + early[("llmd:request_prefill_time_seconds_sum", ())])
        assert early[("llmd:e2e_request_latency_seconds_sum", ())] == pytest.approx(
            early[("llmd:request_queue_time_seconds_sum", ())] + early[("llmd:request_inference_time_seconds_sum", ())])
        assert early[("llmd:request_success_total", (("finished_reason", "stop"),))] == 0  # exposed before any
        assert early[("llmd:grammar_compile_seconds_count", ())] == 0
        assert not any(name.startswith("llmd:spec_decode") for name, _ in early)  # speculation is off
        assert got[("llmd:request_queue_time_seconds_count", ())] in (6, 7)  # the abort may beat scheduling
    finally:
        assert d.stop() == 0, d.stderr()


def test_grammar_compiles_are_counted_once_per_spec():
    d = Daemon(str(fixture_path("tiny-llama")), Path(tempfile.mkdtemp(prefix="llmd-m-")) / "s.sock").wait_ready()
    try:
        with RawConn(d.sock) as conn:
            for i, choice in enumerate((["red", "green"], ["red", "green"], ["a", "b", "c"])):
                conn.send({"type": "submit", "id": f"g{i}", "prompt": "pick",
                           "sampling": {"max_tokens": 8, "guided": {"choice": choice}}})
                conn.until_final(f"g{i}")
            conn.send({"type": "metrics"})
            got = samples(conn.recv()["text"])
            conn.send({"type": "status"})
            status = conn.recv()
        assert got[("llmd:grammar_compile_seconds_count", ())] == 2  # the repeated spec is cached
        assert status["grammar_compiles_total"] == 2
        assert status["grammar_compile_seconds_total"] == pytest.approx(got[("llmd:grammar_compile_seconds_sum", ())])
    finally:
        assert d.stop() == 0, d.stderr()


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_speculative_decoding_counters_equal_the_offline_engine():
    """One greedy request at a time schedules exactly as the offline engine does, so the
    daemon's draft and acceptance counters must equal the engine's own."""
    import json

    from llmd import LLM, SamplingParams

    model = str(fixture_path("tiny-llama"))
    prompts = [[11, 12, 13] * 10, [5, 6, 7, 8] * 8]
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=128, speculative_config=SPEC)
    for prompt in prompts:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    ref = llm.engine.scheduler.spec_stats
    llm.engine.shutdown()
    assert ref.num_draft_tokens > 0  # the workload does speculate

    d = Daemon(model, Path(tempfile.mkdtemp(prefix="llmd-m-")) / "s.sock",
               "--speculative-config", json.dumps(SPEC)).wait_ready()
    try:
        with RawConn(d.sock) as conn:
            for i, prompt in enumerate(prompts):
                conn.send({"type": "submit", "id": f"s{i}", "token_ids": prompt,
                           "sampling": {"max_tokens": 80, "ignore_eos": True, "temperature": 0}})
                conn.until_final(f"s{i}")
            conn.send({"type": "metrics"})
            got = samples(conn.recv()["text"])
            conn.send({"type": "status"})
            spec = conn.recv()["spec_decode"]
    finally:
        assert d.stop() == 0, d.stderr()
    assert got[("llmd:spec_decode_num_drafts_total", ())] == ref.num_drafts == spec["num_drafts"]
    assert got[("llmd:spec_decode_num_draft_tokens_total", ())] == ref.num_draft_tokens == spec["num_draft_tokens"]
    assert got[("llmd:spec_decode_num_accepted_tokens_total", ())] == ref.num_accepted_tokens \
        == spec["num_accepted_tokens"]
    per_pos = [got[("llmd:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(len(ref.accepted_per_position))]
    assert per_pos == ref.accepted_per_position == spec["accepted_per_position"]
    assert spec["mean_accepted_length"] == pytest.approx(ref.mean_accepted_length)


def test_every_family_parses_without_a_model():
    """The exposition alone, fed events by hand: with speculative decoding and device
    memory on, every family (spec-decode and GPU ones included) parses, with exact values."""
    actor = MetricsActor(default_model="tiny", server_version="0")
    t0 = time.monotonic()  # health() compares with the clock
    spec = SpecDecodeStats()
    spec.record(3, 2)
    spec.record(3, 0)
    step = StepStats(time=t0 + 1.5, duration_s=0.01, num_reqs=1, num_tokens=4, num_prefill_tokens=4, num_decode_reqs=0,
                     num_generated=1, generated={"r1": 1}, running_ids=["r1"], num_waiting=0, kv_blocks_used=2,
                     kv_blocks_total=8, prefix_queries=4, prefix_hits=0, num_preemptions_total=0,
                     grammar_compile_times=[0.02], spec=spec, device_memory_bytes=3 << 30)

    async def feed() -> None:
        await actor.handle(ModelLoaded(model="tiny", device="cuda:0", dtype="bfloat16", kv_blocks_total=8))
        await actor.handle(RequestEvent("r1", "queued", t0, uid=7, prompt_tokens=4))
        await actor.handle(RequestEvent("r1", "scheduled", t0 + 0.5))
        await actor.handle(step)
        await actor.handle(RequestEvent("r1", "first_token", t0 + 1.5))

    asyncio.run(feed())
    got = samples(actor.prometheus())
    assert got[("llmd:num_requests_running", ())] == 1 and got[("llmd:kv_cache_usage_perc", ())] == 0.25
    assert got[("llmd:prefix_cache_queries_total", ())] == 4
    assert got[("llmd:time_to_first_token_seconds_sum", ())] == pytest.approx(1.5)
    assert got[("llmd:request_prefill_time_seconds_sum", ())] == pytest.approx(1.0)
    assert got[("llmd:time_to_first_token_seconds_bucket", (("le", "2.5"),))] == 1
    assert got[("llmd:time_to_first_token_seconds_bucket", (("le", "1.0"),))] == 0
    assert got[("llmd:grammar_compile_seconds_count", ())] == 1
    assert got[("llmd:gpu_memory_reserved_bytes", (("device", "cuda:0"),))] == 3 << 30
    assert got[("llmd:spec_decode_num_drafts_total", ())] == 2
    assert got[("llmd:spec_decode_num_accepted_tokens_total", ())] == 2
    assert [got[("llmd:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(3)] == [1, 1, 0]
    assert got[("process_resident_memory_bytes", ())] > 0  # prometheus_client's process collector
    assert actor.health() == (True, "ok")
