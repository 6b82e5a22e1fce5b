"""The scheduler with pooling requests (embeddings), without a model: a pooling request
is chunked under the step budget like any prompt, samples nothing, finishes with the
step that returns its pooled state (a step that returns none fails it) and frees its
blocks; only LAST-token pooling takes a cached prefix (MEAN and CLS read positions a
hit would skip)."""
from __future__ import annotations

from collections import defaultdict

import pytest

from llmd.config import EngineConfig
from llmd.core.kv_cache_manager import KVCacheManager
from llmd.core.request import Request, RequestStatus
from llmd.core.scheduler import Scheduler
from llmd.core.step_messages import RunnerOutput
from llmd_client.protocol import PoolingParams

BS = 4  # small blocks: a few tokens cross a block boundary


def _pooling_scheduler(pooling_type: str, budget: int = 8) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=budget, block_size=BS, pooling_type=pooling_type)
    return Scheduler(config, KVCacheManager(64, BS, enable_prefix_caching=True))


def _pooling_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, None, pooling_params=PoolingParams(), max_tokens=0)


def _run_pooling(scheduler: Scheduler, pooled_at_end: bool = True) -> tuple[list[list[tuple[str, int]]], list]:
    """Step until every request ends; the worker pools a request in the step that reaches
    its prompt's end (unless `pooled_at_end` is False: a worker that forgets to)."""
    computed: dict[str, int] = defaultdict(int)
    steps, updates = [], []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        assert all(new.sampling_params is None and new.pooling_params is not None for new in so.scheduled_new_reqs)
        out = RunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=[[] for _ in so.num_scheduled_tokens])
        for req_id, n in so.num_scheduled_tokens.items():
            computed[req_id] += n
            if pooled_at_end and computed[req_id] == scheduler.requests[req_id].num_prompt_tokens:
                out.pooled[req_id] = [float(computed[req_id])]
        steps.append(list(so.num_scheduled_tokens.items()))
        updates += scheduler.update_from_output(so, out)
    return steps, updates


def test_a_pooling_request_is_chunked_and_finishes_with_its_pooled_state():
    scheduler = _pooling_scheduler("MEAN")
    scheduler.add_request(_pooling_request("long", list(range(1, 21))))
    scheduler.add_request(_pooling_request("short", [7, 8, 9]))
    steps, updates = _run_pooling(scheduler)
    assert [dict(s).get("long") for s in steps] == [8, 8, 4]  # chunks under the step budget
    assert [(u.req_id, u.finish_reason, u.pooled, u.new_token_ids) for u in updates] == [
        ("long", "stop", [20.0], []), ("short", "stop", [3.0], [])]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks  # blocks freed
    assert not scheduler.running and scheduler.schedule().finished_req_ids == []  # nothing left behind


def test_a_step_that_returns_no_pooled_state_fails_its_request():
    scheduler = _pooling_scheduler("LAST")
    scheduler.add_request(_pooling_request("p", list(range(1, 12))))
    _, updates = _run_pooling(scheduler, pooled_at_end=False)
    assert [(u.req_id, u.finish_reason) for u in updates] == [("p", "error")]
    assert "no pooled hidden state" in updates[0].error


@pytest.mark.parametrize("pooling_type, hit", [("LAST", True), ("MEAN", False), ("CLS", False)])
def test_only_last_token_pooling_takes_a_cached_prefix(pooling_type, hit):
    scheduler = _pooling_scheduler(pooling_type, budget=64)
    prompt = list(range(1, 18))
    for req_id in ("first", "second"):
        scheduler.add_request(_pooling_request(req_id, prompt))
        scheduler.schedule()
        request = scheduler.requests[req_id]
        assert request.num_cached_tokens == (16 if hit and req_id == "second" else 0)
        scheduler.finish_requests([req_id], RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv.prefix_cache_stats.queries == (2 * len(prompt) if hit else 0)
