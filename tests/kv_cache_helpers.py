"""The KV cache tests' helpers (test_kv_cache_manager.py, test_prefix_cache.py): a request,
admitting it, decoding a token, and the pool's state in a comparable form."""
from __future__ import annotations

from llmd.core.block_pool import KVCacheBlock
from llmd.core.kv_cache_manager import KVCacheManager
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
