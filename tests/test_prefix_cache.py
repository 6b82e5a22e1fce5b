"""The prefix cache, checked without a model: expected hits are worked out by hand from
the token lists."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmd.core import kv_cache_manager
from llmd.core.kv_cache_manager import KVCacheManager, hash_block_tokens

from kv_cache_helpers import BS, admit, decode, free_ids, make_request


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
