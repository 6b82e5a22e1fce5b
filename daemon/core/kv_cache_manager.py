"""Which KV blocks each request holds, and the prefix cache that lets requests share them.

A request's tokens fill its blocks in order; once a block is full its content is fixed,
so it gets a chained hash (parent hash, its tokens, extra keys) and becomes findable in
the block pool. A request being admitted looks up its longest run of cached full blocks
and computes only the rest. No torch: this is bookkeeping over block ids.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

import msgspec

from llmd.core.block_pool import BlockPool, BlockUsage, KVCacheBlock
from llmd.core.request import Request

_encoder = msgspec.msgpack.Encoder()
_blake2b = hashlib.blake2b


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple | None) -> int:
    """A 64-bit hash of one full block, chained through its parent's hash.

    The same on every process and run (msgpack of the key, then blake2b), so hashes can
    cross process boundaries. Hits never rely on it alone: the pool compares the key.
    """
    data = _encoder.encode((parent_hash, token_ids, extra_keys))
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little")


class PrefixCacheStats(msgspec.Struct):
    queries: int = 0  # tokens looked up (whole requests, at admission)
    hits: int = 0  # tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _RequestBlocks:
    """A request's blocks, and how many of the leading ones were offered to the cache."""

    __slots__ = ("request", "blocks", "num_cached_blocks")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.blocks: list[KVCacheBlock] = []
        self.num_cached_blocks = 0


class KVCacheManager(BlockUsage):
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        # The pool's size and free queue: BlockUsage reads num_free_blocks and usage from them.
        self.num_blocks = self.block_pool.num_blocks
        self.free_block_queue = self.block_pool.free_block_queue
        self.prefix_cache_stats = PrefixCacheStats()
        self._held: dict[str, _RequestBlocks] = {}

    # -- prefix cache lookup --------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of a request being admitted,
        and how many tokens they hold. Takes no references: pass them to allocate_slots."""
        if not self.enable_prefix_caching:
            return [], 0
        assert request.num_computed_tokens == 0, f"{request.request_id} is already admitted"
        block_size = self.block_size
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        self._update_block_hashes(request, num_tokens // block_size)
        block_hashes = request.block_hashes
        lookup = self.block_pool.get_cached_block
        parent_hash = None
        extra_keys = _first_extra_keys(request)
        hit_blocks: list[KVCacheBlock] = []
        # Never the last token: it must be computed to produce the next token's logits.
        for i in range((num_tokens - 1) // block_size):
            start = i * block_size
            block_token_ids = tuple(token_ids[start:start + block_size])
            block = lookup(block_hashes[i], parent_hash, block_token_ids, extra_keys)
            if block is None:
                break
            hit_blocks.append(block)
            parent_hash = block_hashes[i]
            extra_keys = None
        num_hit_tokens = len(hit_blocks) * block_size
        self.prefix_cache_stats.queries += num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hit_blocks, num_hit_tokens

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        block_hashes = request.block_hashes
        if len(block_hashes) >= num_full_blocks:
            return
        block_size = self.block_size
        token_ids = request.all_token_ids
        parent_hash = block_hashes[-1] if block_hashes else None
        for i in range(len(block_hashes), num_full_blocks):
            extra_keys = _first_extra_keys(request) if i == 0 else None
            block_token_ids = token_ids[i * block_size:(i + 1) * block_size]
            parent_hash = hash_block_tokens(parent_hash, block_token_ids, extra_keys)
            block_hashes.append(parent_hash)

    # -- allocation -----------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_computed_tokens + num_new_computed_tokens +
        num_new_tokens + num_lookahead_tokens` tokens and return the newly allocated blocks.

        `new_computed_blocks` are prefix-cache hits from get_computed_blocks (admission
        only). Returns None, changing nothing, when the free blocks do not suffice.
        Blocks that become full with known tokens are cached right away, so a request
        admitted later in the same step can hit them: each layer writes the step's new
        K/V before attention reads any.
        """
        block_size = self.block_size
        held = self._held.get(request.request_id)
        num_held = len(held.blocks) if held is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // block_size)
        num_free = self.block_pool.num_free_blocks
        num_hit_blocks = 0
        if new_computed_blocks:
            num_hit_blocks = len(new_computed_blocks)
            assert num_held == 0 and request.num_computed_tokens == 0, \
                f"{request.request_id}: cache hits are only taken at admission"
            assert num_new_computed_tokens == num_hit_blocks * block_size, \
                f"{request.request_id}: {num_new_computed_tokens} hit tokens != {num_hit_blocks} full blocks"
            # Hit blocks nobody holds sit in the free queue; taking them shrinks it.
            num_free -= sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        num_new_blocks = num_required - num_held - num_hit_blocks
        if num_new_blocks > num_free:
            return None

        if held is None:
            held = self._held[request.request_id] = _RequestBlocks(request)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            held.blocks.extend(new_computed_blocks)
            held.num_cached_blocks = num_hit_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        held.blocks.extend(new_blocks)

        if self.enable_prefix_caching:
            num_known_tokens = min(num_computed + num_new_tokens, len(request.all_token_ids))
            num_full_blocks = num_known_tokens // block_size
            if num_full_blocks > held.num_cached_blocks:
                self._cache_full_blocks(held, num_full_blocks)
        return new_blocks

    def _cache_full_blocks(self, held: _RequestBlocks, num_full_blocks: int) -> None:
        request = held.request
        self._update_block_hashes(request, num_full_blocks)
        block_size = self.block_size
        token_ids = request.all_token_ids
        start = held.num_cached_blocks
        self.block_pool.cache_full_blocks(
            held.blocks[start:num_full_blocks],
            request.block_hashes[start:num_full_blocks],
            [tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(start, num_full_blocks)],
            parent_hash=request.block_hashes[start - 1] if start else None,
            first_extra_keys=None if start else _first_extra_keys(request),
        )
        held.num_cached_blocks = num_full_blocks

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks, tail first: the head of a sequence is the part
        most likely shared, so it should be evicted last. Unknown ids are ignored.

        `num_valid_tokens`: only this many leading tokens hold computed K/V (a request
        preempted after being scheduled, before its step ran). Blocks past them were
        cached at allocation and must not stay findable: nobody else can hold them yet,
        since hits are taken only at admission and a preempting step admits no one."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        if num_valid_tokens is not None:
            for block in held.blocks[num_valid_tokens // self.block_size:]:
                if block.block_hash is not None and block.ref_cnt == 1:
                    self.block_pool.uncache(block)
        self.block_pool.free_blocks(reversed(held.blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        held = self._held.get(request_id)
        return [block.block_id for block in held.blocks] if held is not None else []

    # -- cache control and stats ----------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget all cached blocks (e.g. after new weights). Held blocks stay held."""
        self.block_pool.reset_prefix_cache()

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Start counting afresh; returns the counts so far."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- checks (tests and debugging; O(num_blocks)) --------------------------------
    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        block_size = self.block_size
        num_holders: Counter[int] = Counter()
        for request_id, held in self._held.items():
            request = held.request
            assert request.request_id == request_id
            assert held.num_cached_blocks <= len(held.blocks), f"{request_id} cached past its blocks"
            num_holders.update(block.block_id for block in held.blocks)
            for i, block in enumerate(held.blocks):
                if block.block_hash is None:
                    continue
                # A request only holds a cached block at a position whose tokens it has.
                assert i < held.num_cached_blocks, f"{request_id} holds cached block {block.block_id} at {i}"
                assert block.block_hash == request.block_hashes[i], f"{request_id}: block {i} hash differs"
                assert block.token_ids == tuple(request.all_token_ids[i * block_size:(i + 1) * block_size]), \
                    f"{request_id}: block {i} holds other tokens"
        for block in self.block_pool.blocks:
            assert block.ref_cnt == num_holders[block.block_id], \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {num_holders[block.block_id]}"
        for block_hash, block in self.block_pool.cached_block_map.items():
            assert hash_block_tokens(block.parent_hash, block.token_ids, block.extra_keys) == block_hash, \
                f"block {block.block_id} is cached under a hash its key does not give"

    def assert_all_free(self) -> None:
        """Raise if any request still holds blocks or any block is still referenced."""
        if self._held:
            raise AssertionError(f"{len(self._held)} requests still hold blocks: {sorted(self._held)[:8]}")
        pool = self.block_pool
        referenced = [block.block_id for block in pool.blocks if block.ref_cnt != 0]
        if referenced:
            raise AssertionError(f"{len(referenced)} blocks still referenced: {referenced[:8]}")
        if pool.num_free_blocks != pool.num_blocks:
            raise AssertionError(f"only {pool.num_free_blocks} of {pool.num_blocks} blocks are free")


def _first_extra_keys(request: Request) -> tuple | None:
    # Only the first block needs the salt: every later hash chains through it.
    return None if request.cache_salt is None else (request.cache_salt,)
