"""The block pool and prefix cache, checked without a model.

Expected hits are worked out by hand from the token lists, and the randomized test keeps
its own record of what each physical block holds, so a hit is judged against what was
really written there, not against the manager's own bookkeeping.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from llmd.core import kv_cache_manager
from llmd.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from llmd.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from llmd.core.request import Request
from llmd_client.protocol import SamplingParams

BS = 4  # small blocks keep the token lists readable


def make_request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), max_tokens=64, cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request,
          num_new_tokens: int | None = None) -> list[KVCacheBlock] | None:
    """Look up the prefix cache and allocate like the scheduler does at admission."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new_blocks = kv.allocate_slots(request, num_new_tokens, hit_blocks, num_hit)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit + num_new_tokens
    kv.check_integrity()
    return new_blocks


def decode(kv: KVCacheManager, request: Request, token_id: int) -> list[KVCacheBlock] | None:
    request.append_output_token(token_id)
    new_blocks = kv.allocate_slots(request, 1)
    if new_blocks is not None:
        request.num_computed_tokens += 1
    kv.check_integrity()
    return new_blocks


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(kv: KVCacheManager, request_ids: list[str]) -> tuple:
    pool = kv.block_pool
    return (free_ids(kv), [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            dict(pool.cached_block_map), {rid: kv.get_block_ids(rid) for rid in request_ids})


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


# -- prefix cache hits ----------------------------------------------------------------
def test_shared_prefix_hits_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)

    # 9 tokens in common with a: two full blocks.
    b = make_request("b", list(range(9)) + [77, 78, 79])
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert [blk.block_id for blk in hit_blocks] == kv.get_block_ids("a")[:2]

    # Exactly two full blocks of a: only one may hit, the last token must be computed.
    c = make_request("c", list(range(8)))
    hit_blocks, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 4 and [blk.block_id for blk in hit_blocks] == kv.get_block_ids("a")[:1]

    # One more token and the second block hits too.
    d = make_request("d", list(range(9)))
    assert kv.get_computed_blocks(d)[1] == 8

    # Nothing in common.
    e = make_request("e", [5, 4, 3, 2, 1, 0])
    assert kv.get_computed_blocks(e) == ([], 0)
    kv.free(a)
    kv.assert_all_free()


def test_partial_last_block_is_cached_only_once_full():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])  # second block half full
    admit(kv, a)
    assert len(kv.block_pool.cached_block_map) == 1
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b)[1] == 4  # a's 5, 6 match but are not a full block

    decode(kv, a, 7)
    assert len(kv.block_pool.cached_block_map) == 1
    decode(kv, a, 8)  # a's second block is now full: cached on this step
    assert len(kv.block_pool.cached_block_map) == 2
    b2 = make_request("b2", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit_blocks, num_hit = kv.get_computed_blocks(b2)
    assert num_hit == 8 and [blk.block_id for blk in hit_blocks] == kv.get_block_ids("a")
    kv.free(a)
    kv.assert_all_free()


def test_hit_in_the_same_step_as_the_first_request():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    a = make_request("a", prompt)
    admit(kv, a)  # allocated, not yet computed by any model step
    b = make_request("b", prompt)
    new_blocks = admit(kv, b)
    assert b.num_computed_tokens == 13 and len(new_blocks) == 1
    assert kv.get_block_ids("b")[:3] == kv.get_block_ids("a")[:3]
    kv.free(a)
    kv.free(b)
    kv.assert_all_free()


def test_chained_hashes_depend_on_the_prefix():
    block = [5, 6, 7, 8]
    after_x = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], None), block, None)
    after_y = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9], None), block, None)
    at_start = hash_block_tokens(None, block, None)
    assert len({after_x, after_y, at_start}) == 3
    assert hash_block_tokens(None, block, None) == hash_block_tokens(None, tuple(block), None)
    assert 0 <= after_x < 2**64

    # The manager's hashes are this chain, and the same second block after a different
    # first block does not hit.
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4] + block + [0])
    admit(kv, a)
    assert a.block_hashes == [hash_block_tokens(None, [1, 2, 3, 4], None), after_x]
    b = make_request("b", [9, 9, 9, 9] + block + [0])
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)
    kv.assert_all_free()


def test_hashes_are_the_same_in_another_process():
    code = ("from llmd.core.kv_cache_manager import hash_block_tokens as h;"
            "print(h(h(None, [1, 2, 3], ('salt',)), [4, 5, 6], None))")
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True)
        outputs.add(int(result.stdout))
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3], ("salt",)), [4, 5, 6], None)
    assert outputs == {here}


def test_cache_salt_isolates_requests():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(9))
    admit(kv, make_request("plain", prompt))
    admit(kv, make_request("salted", prompt, cache_salt="tenant-a"))
    assert kv.get_computed_blocks(make_request("p2", prompt))[1] == 8
    assert kv.get_computed_blocks(make_request("s2", prompt, cache_salt="tenant-a"))[1] == 8
    assert kv.get_computed_blocks(make_request("s3", prompt, cache_salt="tenant-b")) == ([], 0)
    salted_ids = kv.get_block_ids("salted")
    plain_ids = kv.get_block_ids("plain")
    assert not set(salted_ids) & set(plain_ids)
    # Only the first block's key carries the salt; the rest are apart through the chain.
    pool = kv.block_pool
    assert pool.blocks[salted_ids[0]].extra_keys == ("tenant-a",)
    assert pool.blocks[salted_ids[1]].extra_keys is None
    for request_id in ("plain", "salted"):
        kv.free(make_request(request_id, []))
    kv.assert_all_free()


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, tokens, extra: 42)
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    assert list(kv.block_pool.cached_block_map) == [42]  # the second block could not take 42

    other = make_request("other", [11, 12, 13, 14, 15, 16, 17, 18, 19])
    assert kv.get_computed_blocks(other) == ([], 0)
    # Same tokens after a different parent: the parent hash is compared too.
    same = make_request("same", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit_blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4 and hit_blocks[0].block_id == kv.get_block_ids("a")[0]
    kv.free(a)
    kv.assert_all_free()


def test_identical_block_cached_twice_keeps_the_first():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    a = make_request("a", prompt)
    b = make_request("b", prompt)
    kv.allocate_slots(a, 9)  # no lookup for either (as with prompt logprobs)
    kv.allocate_slots(b, 9)
    kv.check_integrity()
    first = kv.get_block_ids("a")[:2]
    assert [b.block_id for b in kv.block_pool.cached_block_map.values()] == first
    assert [b.block_id for b in kv.get_computed_blocks(make_request("c", prompt))[0]] == first
    kv.free(a)
    kv.free(b)
    kv.assert_all_free()


def test_lazy_eviction_and_reverse_free_order():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))  # a0, a1 cached; a2 partial
    admit(kv, a)
    a0, a1, a2 = kv.get_block_ids("a")
    (spare,) = free_ids(kv)
    kv.free(a)
    # Tail first: a2, then a1, then the shared-most a0 is evicted last.
    assert free_ids(kv) == [spare, a2, a1, a0]

    probe = make_request("probe", list(range(9)))
    assert kv.get_computed_blocks(probe)[1] == 8  # freed, still hittable

    pool = kv.block_pool
    assert [b.block_id for b in pool.get_new_blocks(2)] == [spare, a2]
    assert kv.get_computed_blocks(probe)[1] == 8
    assert [b.block_id for b in pool.get_new_blocks(1)] == [a1]  # reallocated: evicted
    assert [b.block_id for b in kv.get_computed_blocks(probe)[0]] == [a0]
    assert pool.get_new_blocks(1)[0].block_id == a0
    assert kv.get_computed_blocks(probe) == ([], 0)
    assert pool.cached_block_map == {}
    pool.free_blocks(pool.blocks)
    kv.check_integrity()
    kv.assert_all_free()


def test_shared_blocks_are_counted_per_holder():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(9)) + [50, 51])
    admit(kv, a)
    admit(kv, b)
    pool = kv.block_pool
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]
    assert [pool.blocks[i].ref_cnt for i in a_ids + b_ids[2:]] == [2, 2, 1, 1]

    kv.free(a)
    kv.check_integrity()
    assert [pool.blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    assert free_ids(kv)[-1] == a_ids[2]  # only a's private block went back
    assert kv.num_free_blocks == 16 - 3
    kv.free(b)
    kv.assert_all_free()


def test_preempted_request_hits_its_previous_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    request = make_request("a", list(range(9)))
    admit(kv, request)
    for token in (100, 101, 102, 103, 104):
        decode(kv, request, token)
    old_ids = kv.get_block_ids("a")
    assert request.num_tokens == 14
    kv.free(request)  # preempted: recomputed later from prompt + output
    request.num_computed_tokens = 0

    hit_blocks, num_hit = kv.get_computed_blocks(request)
    assert num_hit == 12  # three full blocks out of 14 tokens
    assert [b.block_id for b in hit_blocks] == old_ids[:3]
    assert len(admit(kv, request)) == 1 and request.num_computed_tokens == 14
    kv.free(request)
    kv.assert_all_free()


def test_block_hashes_are_extended_not_recomputed(monkeypatch):
    calls = []

    def counting_hash(parent, tokens, extra):
        calls.append(tuple(tokens))
        return hash_block_tokens(parent, tokens, extra)

    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", counting_hash)
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    request = make_request("a", list(range(10)))
    kv.get_computed_blocks(request)
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # Not the helpers: check_integrity recomputes every cached hash on purpose.
    kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    for token in (10, 11, 12):  # 11 fills the third block
        request.append_output_token(token)
        kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    kv.free(request)
    kv.assert_all_free()


def test_prefix_cache_stats_are_exact():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)  # 10 looked up, 0 hit
    b = make_request("b", list(range(9)) + [70, 71, 72])
    admit(kv, b)  # 12 looked up, 8 hit
    c = make_request("c", list(range(8)))
    kv.get_computed_blocks(c)  # 8 looked up, 4 hit
    stats = kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (30, 12)
    assert stats.hit_rate == pytest.approx(12 / 30)
    old = kv.reset_prefix_cache_stats()
    assert (old.queries, old.hits) == (30, 12)
    fresh = kv.prefix_cache_stats
    assert (fresh.queries, fresh.hits, fresh.hit_rate) == (0, 0, 0.0)
    kv.free(a)
    kv.free(b)
    kv.assert_all_free()


def test_reset_prefix_cache_forgets_everything():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.reset_prefix_cache()
    kv.check_integrity()
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    kv.free(a)
    kv.assert_all_free()


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.block_pool.cached_block_map == {} and a.block_hashes == []
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (0, 0)
    kv.free(a)
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
