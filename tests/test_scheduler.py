"""The scheduler, stepped against a fake model runner (scheduler_harness: its module doc
says what the harness checks after every step). No torch, no model."""
from __future__ import annotations

import random

import pytest

from llmd.core.request import RequestStatus
from scheduler_harness import BS, Harness, Step, random_tokens, scripted_sample


# -- budget and sequence cap ----------------------------------------------------------
def test_token_budget_and_max_num_seqs_are_respected_and_used():
    h = Harness(budget=16, max_num_seqs=3)
    rng = random.Random(1)
    for i in range(12):
        h.add(f"r{i}", random_tokens(rng, rng.randint(1, 30)), max_tokens=rng.randint(1, 8))
    h.run()
    for step in h.steps:
        assert step.output.total_num_scheduled_tokens <= 16
        assert step.num_running <= 3
        # The pool is huge, so a step leaves budget unused only for lack of work or slots.
        assert (step.output.total_num_scheduled_tokens == 16 or step.num_waiting == 0
                or step.num_running == 3)
    assert any(s.num_running == 3 for s in h.steps)
    assert any(s.output.total_num_scheduled_tokens == 16 for s in h.steps)
    h.check_outputs()
    h.check_drained()


# -- mixed prefill and decode ---------------------------------------------------------
@pytest.mark.parametrize("threshold", [0, 5])
def test_decodes_run_every_step_while_a_long_prompt_is_chunked(threshold):
    budget = 16
    h = Harness(budget=budget, threshold=threshold)
    rng = random.Random(2)
    decoders = ["a", "b", "c"]
    for req_id in decoders:
        h.add(req_id, random_tokens(rng, 3), max_tokens=40)
    h.step()
    assert all(len(h.outputs[r]) == 1 for r in decoders)

    h.add("long", random_tokens(rng, 100), max_tokens=3)
    expected_chunks, remaining = [], 100
    while remaining:
        chunk = min(remaining, budget - len(decoders), threshold or remaining)
        expected_chunks.append(chunk)
        remaining -= chunk
    for i, chunk in enumerate(expected_chunks):
        step = h.step()
        assert step.scheduled == {"a": 1, "b": 1, "c": 1, "long": chunk}
        last = i == len(expected_chunks) - 1
        assert set(step.sampled) == set(decoders) | ({"long"} if last else set())
    assert h.runner.chunks["long"][:len(expected_chunks)] == \
        [(sum(expected_chunks[:i]), c) for i, c in enumerate(expected_chunks)]
    h.run()
    h.check_outputs()
    h.check_drained()


# -- chunked prefill ------------------------------------------------------------------
@pytest.mark.parametrize("threshold, expected_prefill", [
    (5, [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]),  # the threshold binds
    (0, [(0, 7), (7, 7), (14, 7), (21, 2)]),  # the budget binds
])
def test_chunks_of_one_request_follow_threshold_and_budget(threshold, expected_prefill):
    h = Harness(budget=7, threshold=threshold, prefix_caching=False)
    h.add("a", list(range(1, 24)), max_tokens=4)  # 23 prompt tokens
    h.run()
    assert h.runner.chunks["a"] == expected_prefill + [(23, 1), (24, 1), (25, 1)]
    h.check_outputs()
    h.check_drained()


@pytest.mark.parametrize("threshold", [0, 3])
def test_chunked_prefill_covers_every_position_once(threshold):
    h = Harness(budget=12, threshold=threshold, max_num_seqs=4, prefix_caching=False)
    rng = random.Random(3)
    for i in range(8):
        h.add(f"r{i}", random_tokens(rng, rng.randint(5, 40)), max_tokens=rng.randint(1, 6))
    h.run()
    for req_id, request in h.requests.items():
        chunks = h.runner.chunks[req_id]
        covered = [pos for s, n in chunks for pos in range(s, s + n)]
        # Every known token but the last sampled one is computed exactly once, in order.
        assert covered == list(range(request.num_prompt_tokens + len(h.outputs[req_id]) - 1))
        prefill = [n for s, n in chunks if s < request.num_prompt_tokens]
        assert sum(prefill) == request.num_prompt_tokens
        assert all(n <= (threshold or 12) for n in prefill)
    assert any(len([c for c in h.runner.chunks[r] if c[0] < h.requests[r].num_prompt_tokens]) > 1
               for r in h.requests), "no prompt was chunked"
    h.check_outputs()
    h.check_drained()


# -- admission order ------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order():
    h = Harness(max_num_seqs=1)
    order = ["e", "a", "d", "b", "c"]
    for req_id in order:
        h.add(req_id, [7, 8, 9], max_tokens=2)
    h.run()
    assert [r for s in h.steps for r in s.admitted] == order
    h.check_drained()


def test_priority_admits_lower_value_first_then_earlier_arrival():
    h = Harness(policy="priority", max_num_seqs=1)
    h.add("p3", [1, 2], priority=3, arrival_time=0.0)
    h.add("p1-late", [1, 2], priority=1, arrival_time=5.0)
    h.add("p2", [1, 2], priority=2, arrival_time=1.0)
    h.add("p1-early", [1, 2], priority=1, arrival_time=2.0)
    h.add("p0", [1, 2], priority=0, arrival_time=9.0)
    h.run()
    assert [r for s in h.steps for r in s.admitted] == ["p0", "p1-early", "p1-late", "p2", "p3"]
    h.check_drained()


# -- preemption -----------------------------------------------------------------------
def three_growing_requests(num_blocks: int, prefix_caching: bool) -> Harness:
    h = Harness(num_blocks=num_blocks, prefix_caching=prefix_caching)
    for i, req_id in enumerate(["A", "B", "C"]):
        h.add(req_id, [10 * i + j for j in range(1, 9)], max_tokens=12)  # 2 blocks each
    h.run()
    return h


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fcfs_preempts_the_latest_admitted_and_loses_no_tokens(prefix_caching):
    h = three_growing_requests(8, prefix_caching)
    # Step 0 admits A, B, C (6 of 8 blocks); at step 1 each needs a third block: A and B
    # take the last two and C, the latest admitted, is preempted rather than crashing.
    assert h.steps[0].admitted == ["A", "B", "C"]
    assert h.steps[1].preempted == ["C"] and set(h.steps[1].scheduled) == {"A", "B"}
    assert "C" in h.steps[1].output.finished_req_ids
    assert h.num_preemptions >= 2 and h.scheduler.stats.num_preemptions_total == h.num_preemptions
    for req_id in {r for s in h.steps for r in s.preempted}:
        first = h.preemptions_of(req_id)[0]
        resumed = next(s for s in h.steps[first + 1:] if req_id in s.admitted)
        assert resumed.new_req(req_id).output_token_ids, f"{req_id} resumed without its outputs"
    h.check_outputs()
    h.check_drained()

    roomy = three_growing_requests(1000, prefix_caching)
    assert roomy.num_preemptions == 0
    assert h.outputs == roomy.outputs


@pytest.mark.parametrize("case", ["lower-priority", "later-arrival"])
def test_priority_preempts_the_worst_not_the_latest_admitted(case):
    h = Harness(num_blocks=8, policy="priority", prefix_caching=False)
    if case == "lower-priority":
        h.add("victim", list(range(1, 9)), priority=5, max_tokens=12)
        h.step()
        h.add("x", list(range(11, 19)), priority=0, max_tokens=12)
        h.add("y", list(range(21, 29)), priority=1, max_tokens=12)
    else:
        h.add("victim", list(range(1, 9)), priority=2, arrival_time=10.0, max_tokens=12)
        h.step()
        h.add("x", list(range(11, 19)), priority=2, arrival_time=1.0, max_tokens=12)
        h.add("y", list(range(21, 29)), priority=2, arrival_time=2.0, max_tokens=12)
    step = h.step()
    assert step.admitted == ["x", "y"]
    # Next step "y" (latest admitted) has no block to grow into; FCFS would preempt it,
    # priority preempts "victim" although it was already scheduled in that step.
    step = h.step()
    assert step.preempted == ["victim"]
    assert set(step.scheduled) == {"x", "y"}
    assert "victim" not in step.output.scheduled_cached_reqs.req_ids
    assert step.output.total_num_scheduled_tokens == 2
    h.run()
    assert sum("victim" in s.admitted for s in h.steps) >= 2  # admitted, then resumed
    h.check_outputs()
    h.check_drained()


def test_priority_victim_already_scheduled_gives_its_budget_back():
    h = Harness(num_blocks=12, policy="priority", budget=16, threshold=8, prefix_caching=False)
    h.add("victim", list(range(1, 41)), priority=9, max_tokens=2)
    assert h.step().scheduled == {"victim": 8}
    h.add("x", [101, 102, 103], priority=0, max_tokens=4)
    h.add("y", list(range(201, 241)), priority=1, max_tokens=2)
    assert h.step().scheduled == {"victim": 8, "x": 3, "y": 5}
    assert h.step().scheduled == {"victim": 8, "x": 1, "y": 7}  # 10 of 12 blocks held
    # "victim" takes 2 more blocks, then "x" needs its second: "victim" is preempted and
    # its 8 tokens return to the budget, so "y" runs a full threshold chunk, not 7.
    step = h.step()
    assert step.preempted == ["victim"]
    assert step.scheduled == {"x": 1, "y": 8}
    h.run()
    h.check_outputs()
    h.check_drained()


# Regression: a priority victim already scheduled in the step must not leave the blocks
# allocate_slots cached for its never-computed tokens findable (a hit would read garbage).
def test_priority_victim_scheduled_this_step_leaves_no_uncomputed_cached_blocks():
    # "v" (priority 9) prefills 24 tokens in chunks of 8. At step 2 it allocates blocks
    # 4-5 for tokens 16-23 (cached at once, being full), then "h" cannot grow and "v" is
    # preempted before those tokens are computed. "h" takes one freed block and finishes;
    # "v" is readmitted and hits its own block 4, whose KV was never written.
    h = Harness(num_blocks=7, policy="priority", threshold=8)
    h.add("v", list(range(1, 25)), priority=9, max_tokens=2)
    h.step()
    h.add("h", list(range(101, 105)), priority=0, max_tokens=2)
    h.step()
    step = h.step()  # fails here: "cached block 5 does not hold the tokens of its key"
    assert step.preempted == ["v"]
    h.run()  # and, without that check, here: "v read other tokens from its KV blocks"
    h.check_outputs()
    h.check_drained()


def test_priority_ties_preempt_the_latest_admitted():
    h = Harness(num_blocks=6, policy="priority", prefix_caching=False)
    h.add("first", list(range(1, 9)), arrival_time=1.0, max_tokens=12)
    h.add("second", list(range(11, 19)), arrival_time=1.0, max_tokens=12)
    h.add("third", list(range(21, 29)), arrival_time=1.0, max_tokens=12)
    h.step()
    step = h.step()
    assert step.preempted == ["third"]


# -- stops ----------------------------------------------------------------------------
SCRIPT = [5, 6, 2, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("params, eos, script, expected", [
    (dict(max_tokens=8), 2, SCRIPT, ([5, 6, 2], "stop", None)),
    (dict(max_tokens=5, ignore_eos=True), 2, SCRIPT, ([5, 6, 2, 7, 8], "length", None)),
    (dict(max_tokens=8, stop_token_ids=[40, 6]), None, SCRIPT, ([5, 6], "stop", 6)),
    (dict(max_tokens=2), 2, SCRIPT, ([5, 6], "length", None)),
    # EOS before min_tokens is generated does not stop; the first one after does.
    (dict(max_tokens=8, min_tokens=4), 2, [5, 2, 2, 2, 9, 2, 2, 2], ([5, 2, 2, 2], "stop", None)),
    (dict(max_tokens=8, min_tokens=3, stop_token_ids=[6]), None, [6] * 8, ([6, 6, 6], "stop", 6)),
], ids=["eos", "ignore_eos", "stop_token_ids", "max_tokens", "min_tokens_eos", "min_tokens_stop_id"])
def test_stop_conditions(params, eos, script, expected):
    h = Harness(eos=eos, sample=scripted_sample({"r": script, "other": [1] * 20}))
    h.add("other", [3, 3, 3, 3, 3], max_tokens=20)
    h.add("r", [4, 4, 4, 4, 4, 4], **params)
    while "r" not in h.done:
        h.step()
    assert (h.outputs["r"], h.finish_reasons["r"], h.stop_reasons["r"]) == expected
    assert h.kv.get_block_ids("r") == [] and h.kv.get_block_ids("other") != []
    step = h.step()
    assert "r" in step.output.finished_req_ids and "r" not in h.runner.requests
    assert "other" in step.scheduled
    h.abort(["other"])
    h.kv.assert_all_free()
    h.check_outputs()
    h.check_drained()


# -- abort ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_waiting_running_finished_and_unknown(policy):
    h = Harness(budget=8, max_num_seqs=2, num_blocks=64, policy=policy)
    h.add("done", [1, 2], max_tokens=1)
    h.step()
    assert h.finish_reasons["done"] == "length"
    h.add("dec", [3, 4, 5], max_tokens=50)
    h.add("pre", list(range(100, 130)), max_tokens=50)
    h.add("wait", [6, 7, 8, 9, 10], max_tokens=50)
    h.add("wait2", [11, 12], max_tokens=3)
    step = h.step()
    assert step.admitted == ["dec", "pre"] and step.scheduled == {"dec": 3, "pre": 5}
    step = h.step()
    assert step.scheduled == {"dec": 1, "pre": 7}
    requests = {r: h.requests[r] for r in ("pre", "wait")}

    assert h.abort(["pre", "wait", "done", "never-added", "pre"]) == ["pre", "wait"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in requests.values())
    assert h.kv.get_block_ids("pre") == [] and h.kv.get_block_ids("dec") != []
    assert h.abort(["pre", "wait"]) == []
    step = h.step()
    assert "pre" in step.output.finished_req_ids
    assert step.admitted == ["wait2"] and set(step.scheduled) == {"dec", "wait2"}

    h.abort(["dec"])
    step = h.step()
    assert "dec" in step.output.finished_req_ids and "dec" not in h.runner.requests
    h.run()
    assert h.finish_reasons == {"done": "length", "pre": "abort", "wait": "abort", "dec": "abort",
                                "wait2": "length"}
    h.check_outputs()
    h.check_drained()


# -- prefix caching -------------------------------------------------------------------
PREFIX = list(range(500, 512))  # 12 tokens: 3 full blocks


@pytest.mark.parametrize("threshold, prefix_caching, prompt_logprobs, expected_hit", [
    (0, True, None, 12),  # all 3 shared blocks, cached by "a" earlier in the same step
    (8, True, None, 8),  # "a" runs only 8 tokens this step: only its first 2 blocks are known
    (0, True, 1, 0),  # prompt logprobs need every prompt position computed
    (0, False, None, 0),
])
def test_prefix_hit_in_the_same_step(threshold, prefix_caching, prompt_logprobs, expected_hit):
    h = Harness(threshold=threshold, prefix_caching=prefix_caching)
    h.add("a", PREFIX + [1, 2, 3])
    h.add("b", PREFIX + [4, 5, 6], prompt_logprobs=prompt_logprobs)
    step = h.step()
    assert step.admitted == ["a", "b"]
    new_a, new_b = step.new_req("a"), step.new_req("b")
    assert new_a.num_computed_tokens == 0
    assert new_b.num_computed_tokens == expected_hit
    assert step.scheduled["b"] == min(15 - expected_hit, threshold or 15)
    num_hit_blocks = expected_hit // BS
    assert new_b.block_ids[:num_hit_blocks] == new_a.block_ids[:num_hit_blocks]
    assert not set(new_b.block_ids[num_hit_blocks:]) & set(new_a.block_ids)
    assert h.requests["b"].num_cached_tokens == expected_hit
    h.run()
    h.check_outputs()
    h.check_drained()


# -- randomized -----------------------------------------------------------------------
@pytest.mark.parametrize("seed, policy", [
    *((seed, policy) for policy in ("fcfs", "priority") for seed in range(16)
      if (seed, policy) != (12, "priority")),
    # This seed runs into the bug above: a scheduled priority victim leaves a cached block
    # whose KV was never written.
    (12, "priority"),
])
def test_randomized_small_pool(seed, policy):
    rng = random.Random(seed)
    max_prompt, max_out = 30, 12
    prefix_caching = seed % 2 == 0
    h = Harness(
        num_blocks=-(-(max_prompt + max_out) // BS) + rng.randint(0, 6),
        policy=policy,
        prefix_caching=prefix_caching,
        budget=rng.choice([4, 8, 16, 32]),
        max_num_seqs=rng.randint(1, 6),
        threshold=rng.choice([0, 0, 3, 8]),
        eos=rng.choice([None, 0]),
        sample=lambda req_id, context, num_prompt: hash(tuple(context)) % 50,
    )
    prefixes = [random_tokens(rng, rng.randint(4, 16)) for _ in range(3)]
    pending = []
    for i in range(30):
        prompt = rng.choice(prefixes) if rng.random() < 0.5 else []
        prompt = (prompt + random_tokens(rng, rng.randint(1, max_prompt)))[:max_prompt]
        max_tokens = rng.randint(1, max_out)
        params = dict(max_tokens=max_tokens, priority=rng.randint(0, 3),
                      min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]),
                      stop_token_ids=rng.sample(range(50), rng.choice([0, 0, 1, 2])),
                      ignore_eos=rng.random() < 0.2)
        pending.append((rng.randint(0, 80), f"r{i}", prompt, params))
    pending.sort(key=lambda p: p[0])

    for step_index in range(3000):
        while pending and pending[0][0] <= step_index:
            _, req_id, prompt, params = pending.pop(0)
            h.add(req_id, prompt, **params)
        if rng.random() < 0.05 and h.requests:
            h.abort([rng.choice(list(h.requests) + ["unknown"])])
        if not pending and not h.scheduler.has_unfinished_requests():
            break
        h.step()
    else:
        raise AssertionError("requests did not finish")
    assert len(h.requests) == 30
    h.check_outputs()
    h.check_drained()

