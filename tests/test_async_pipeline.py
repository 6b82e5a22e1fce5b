"""The step pipeline with async scheduling, against the fake paged runner of
test_scheduler (no torch): random workloads with shared prefixes, chunked prefill,
preemption, stop tokens, EOS and aborts arriving between steps. Every request that is
not aborted must end with exactly the tokens and finish reason a direct decode loop gives
(`reference_decode`), every read of the fake KV cache must return the request's own
tokens, and the prefix cache must only ever offer blocks holding their key's tokens."""
from __future__ import annotations

import random

import pytest

from llmd.config import EngineConfig
from llmd.core.kv_cache_manager import KVCacheManager
from llmd.core.request import Request, RequestStatus
from llmd.core.scheduler import Scheduler
from llmd.core.step_pipeline import StepPipeline, output_of, run_now
from llmd_client.protocol import SamplingParams
from scheduler_harness import BS, FakeRunner, hash_sample, reference_decode

EOS = 7


class Finished:
    """The handle of a step the fake runner ran when it was launched."""

    def __init__(self, output) -> None:
        self._output = output

    def output(self):
        return self._output


def run_workload(seed: int, overlap: bool) -> tuple[dict, set[str], StepPipeline]:
    rng = random.Random(seed)
    num_blocks = rng.choice([24, 40, 96])
    config = EngineConfig(block_size=BS, max_num_batched_tokens=rng.choice([16, 32, 64]), max_num_seqs=8,
                          long_prefill_token_threshold=rng.choice([0, 8]), enable_prefix_caching=True,
                          async_scheduling=overlap)
    kv = KVCacheManager(num_blocks, BS, True)
    scheduler = Scheduler(config, kv)
    runner = FakeRunner(num_blocks, hash_sample)
    pipeline = StepPipeline(scheduler, run_now(lambda so, grammar_rows: Finished(runner.execute(so))), run_now(output_of),
                            overlap=overlap)
    shared = [rng.randrange(10, 1000) for _ in range(12)]
    arrivals: dict[int, list[Request]] = {}
    for i in range(24):
        prompt = (shared[:rng.choice([0, 4, 8, 12])] + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 20))])
        params = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=[rng.randrange(10, 1000)] if rng.random() < 0.3 else [])
        request = Request(f"r{i}", prompt, params, eos_token_id=EOS, arrival_time=float(i),
                          max_tokens=params.max_tokens)
        arrivals.setdefault(rng.randint(0, 30), []).append(request)
    abort_at = {rng.randint(1, 40): f"r{rng.randrange(24)}" for _ in range(4)}

    outputs: dict[str, tuple[list[int], str]] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    added: dict[str, Request] = {}
    for step in range(3000):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
            added[request.request_id] = request
        victim = abort_at.get(step)
        if victim in added and victim not in outputs:
            if scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED):
                aborted.add(victim)
        if not scheduler.has_unfinished_requests() and not arrivals:
            break
        current = pipeline.start()
        if current is None:
            assert not scheduler.has_schedulable_requests(), "no progress with requests pending"
            continue
        done, updates = pipeline.finish(current.future.result())
        for req_id in done.output.num_scheduled_tokens:
            # Never a step for a token past the last: the last sampled token is not fed back.
            start, n = runner.chunks[req_id][-1]
            request = added[req_id]
            assert start + n <= request.num_prompt_tokens + request.max_tokens - 1, f"seed {seed}: {req_id}"
        for update in updates:
            tokens.setdefault(update.req_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                outputs[update.req_id] = (tokens[update.req_id], update.finish_reason)
        kv.check_integrity()
        for block in kv.block_pool.cached_block_map.values():
            start = block.block_id * BS
            assert tuple(runner.kv_slots[start:start + BS]) == block.token_ids, \
                f"cached block {block.block_id} does not hold the tokens of its key"
        for request in scheduler.running:
            assert request.num_output_placeholders <= (1 if overlap else 0)
            assert request.num_output_tokens + request.num_output_placeholders <= request.max_tokens
    else:
        raise AssertionError("the workload did not finish")
    while pipeline.in_flight is not None:  # steps whose requests all finished: let them end
        pipeline.finish(pipeline.in_flight.future.result())
    kv.assert_all_free()
    for req_id, request in added.items():
        if req_id in aborted:
            continue
        want, reason, _ = reference_decode(req_id, request.prompt_token_ids, request.sampling_params, EOS,
                                           request.max_tokens, hash_sample)
        assert outputs[req_id] == (want, reason), f"seed {seed}, {req_id}"
    return outputs, aborted, pipeline


@pytest.mark.parametrize("seed", range(12))
def test_async_pipeline_gives_every_request_its_reference_output(seed):
    outputs, aborted, pipeline = run_workload(seed, overlap=True)
    assert pipeline.stats.overlapped > 0
    plain, plain_aborted, _ = run_workload(seed, overlap=False)
    for req_id in set(outputs) - aborted - plain_aborted:
        assert outputs[req_id] == plain[req_id]
