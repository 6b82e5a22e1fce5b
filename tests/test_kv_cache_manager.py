"""The block pool and the KV cache manager's allocation, checked without a model (prefix
cache hits: test_prefix_cache.py).

The randomized test keeps its own record of what each physical block holds, so a hit is
judged against what was really written there, not against the manager's own bookkeeping.
"""
from __future__ import annotations

import random

import pytest

from llmd.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from llmd.core.kv_cache_manager import KVCacheManager
from llmd.core.request import Request

from kv_cache_helpers import BS, admit, decode, make_request, snapshot


# -- free block queue -----------------------------------------------------------------
def test_free_block_queue_is_lru_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 6
    assert queue.popleft() is blocks[0]

    queue.remove(blocks[3])
    # Removal relinks the neighbours directly: no walk over the list.
    assert blocks[2].next_free is blocks[4] and blocks[4].prev_free is blocks[2]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 4, 5]

    queue.append(blocks[3])
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 4, 5, 3, 0]
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 2, 4]
    queue.append_n([blocks[1], blocks[2]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [5, 3, 0, 1, 2]
    assert queue.num_free_blocks == 5
    queue.check_integrity(6)

    with pytest.raises(ValueError):
        queue.remove(blocks[4])  # not in the queue
    with pytest.raises(ValueError):
        queue.popleft_n(6)
    assert queue.popleft_n(0) == []
    queue.popleft_n(5)
    with pytest.raises(ValueError):
        queue.popleft()
    queue.check_integrity(6)


def test_block_pool_touch_and_free_keep_the_invariants():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks, pool.usage) == (1, 1, 2, 0.5)
    pool.cache_block(a, 7, None, (1, 2), None)
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(7, None, (1, 2), None) is a
    pool.touch([a])  # a cached block nobody held leaves the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.check_integrity()
    pool.free_blocks([a])
    pool.check_integrity()


# -- allocation -----------------------------------------------------------------------
def test_allocate_and_free_accounting():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    request = make_request("a", list(range(100, 110)))  # 10 tokens: 3 blocks
    new_blocks = admit(kv, request)
    assert len(new_blocks) == 3
    assert kv.get_block_ids("a") == [b.block_id for b in new_blocks]
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)

    assert decode(kv, request, 1) == []  # 11 tokens: still 3 blocks
    assert decode(kv, request, 2) == []  # 12
    grown = decode(kv, request, 3)  # 13: a fourth block
    assert len(grown) == 1 and kv.num_free_blocks == 6
    assert kv.get_block_ids("a") == [b.block_id for b in new_blocks + grown]

    kv.free(request)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0 and kv.get_block_ids("a") == []
    kv.free(request)  # twice is harmless
    kv.free(make_request("never-seen", [1]))
    kv.check_integrity()
    kv.assert_all_free()


def test_assert_all_free_catches_a_leak():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", [1, 2, 3]))
    with pytest.raises(AssertionError):
        kv.assert_all_free()


def test_out_of_blocks_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))  # blocks [0..3] [4..7] cached, [8] partial
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4

    # 17 tokens: 2 hit blocks + 3 new. Four blocks look free, but two of them are the
    # hits themselves, so only 2 are left for new blocks.
    b = make_request("b", list(range(8)) + list(range(50, 59)))
    before = snapshot(kv, ["a", "b"])
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hit_blocks, num_hit) is None
    assert snapshot(kv, ["a", "b"]) == before
    kv.check_integrity()

    # 13 tokens: 2 hit blocks + 2 new fits exactly.
    c = make_request("c", list(range(8)) + list(range(50, 55)))
    assert len(admit(kv, c)) == 2
    assert kv.num_free_blocks == 0

    # A running request that cannot grow is left exactly as it was.
    c.append_output_token(99)
    c.append_output_token(98)
    c.append_output_token(97)
    c.append_output_token(96)
    before = snapshot(kv, ["c"])
    assert kv.allocate_slots(c, 4) is None
    assert snapshot(kv, ["c"]) == before
    kv.free(c)
    kv.assert_all_free()


def test_lookahead_gets_room_but_is_never_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", [1, 2, 3])
    new_blocks = kv.allocate_slots(request, 3, num_lookahead_tokens=5)  # room for 8 tokens
    assert len(new_blocks) == 2
    assert kv.block_pool.cached_block_map == {}
    # Asking for more tokens than the request has does not cache unknown ones either.
    other = make_request("b", [1, 2, 3])
    kv.allocate_slots(other, 8)
    assert kv.block_pool.cached_block_map == {}
    kv.free(request)
    kv.free(other)
    kv.assert_all_free()


# -- randomized -----------------------------------------------------------------------
def test_randomized_against_a_model_of_block_contents():
    """Admit, step, preempt and finish requests over a small pool with shared prefixes.

    `written` records what each physical block holds: (salt, the whole token prefix up
    to the block's end) once full. Every hit must name blocks holding exactly the
    request's prefix, and a block is only ever written while one request holds it.
    """
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=24, block_size=BS)
    pool = kv.block_pool
    bases = [[rng.randrange(6) for _ in range(14)] for _ in range(4)]
    waiting: list[Request] = []
    running: list[Request] = []
    written: dict[int, tuple] = {}
    expected_queries = expected_hits = 0
    num_hit_admissions = num_preemptions = num_evictions = 0
    next_id = 0

    def record_writes(request: Request, new_blocks: list[KVCacheBlock], start: int, end: int) -> None:
        for block in new_blocks:
            written.pop(block.block_id, None)
        ids = kv.get_block_ids(request.request_id)
        for i in range(start // BS, -(-end // BS)):
            block = pool.blocks[ids[i]]
            assert block.ref_cnt == 1, f"block {block.block_id} is written while shared"
            full = (i + 1) * BS <= end
            written[block.block_id] = (request.cache_salt, tuple(request.all_token_ids[:(i + 1) * BS])) \
                if full else ("partial",)

    for _ in range(4000):
        op = rng.random()
        if op < 0.2 or not (waiting or running):
            base = rng.choice(bases)
            suffix = [rng.randrange(6) for _ in range(rng.randrange(4))]
            prompt = base[:rng.randrange(1, len(base) + 1)] + suffix
            salt = "s" if rng.random() < 0.15 else None
            waiting.append(make_request(f"r{next_id}", prompt, cache_salt=salt))
            next_id += 1
        elif op < 0.45 and waiting:
            request = rng.choice(waiting)
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            expected_queries += request.num_tokens
            expected_hits += num_hit
            assert num_hit == len(hit_blocks) * BS and num_hit < request.num_tokens
            for i, block in enumerate(hit_blocks):
                prefix = tuple(request.all_token_ids[:(i + 1) * BS])
                assert written.get(block.block_id) == (request.cache_salt, prefix)
            num_new = rng.randrange(1, request.num_tokens - num_hit + 1)
            free_before = kv.num_free_blocks
            hashed_before = dict(pool.cached_block_map)
            new_blocks = kv.allocate_slots(request, num_new, hit_blocks, num_hit)
            if new_blocks is None:
                assert kv.num_free_blocks == free_before and pool.cached_block_map == hashed_before
                assert kv.get_block_ids(request.request_id) == []
            else:
                num_evictions += sum(1 for h in hashed_before if h not in pool.cached_block_map)
                num_hit_admissions += num_hit > 0
                record_writes(request, new_blocks, num_hit, num_hit + num_new)
                request.num_computed_tokens = num_hit + num_new
                waiting.remove(request)
                running.append(request)
        elif op < 0.9 and running:
            request = rng.choice(running)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(rng.randrange(6))
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = rng.randrange(1, remaining + 1)
            lookahead = rng.choice((0, 0, 0, 2))
            new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                kv.free(request)  # preempt: recomputed later from all its tokens
                request.num_computed_tokens = 0
                running.remove(request)
                waiting.append(request)
                num_preemptions += 1
            else:
                start = request.num_computed_tokens
                record_writes(request, new_blocks, start, start + num_new)
                request.num_computed_tokens += num_new
        elif running:
            request = rng.choice(running)
            running.remove(request)
            kv.free(request)
            if rng.random() < 0.1:
                kv.free(request)
        kv.check_integrity()

    for request in running:
        kv.free(request)
    kv.check_integrity()
    kv.assert_all_free()
    stats = kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (expected_queries, expected_hits)
    # The run exercised what it claims to.
    assert num_hit_admissions > 50 and num_preemptions > 10 and num_evictions > 50
